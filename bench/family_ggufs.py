"""Write Q4_K_M GGUFs of the model shapes people run on CPUs, with random weights, the way a user
gets them: a Hugging Face folder converted by llama.cpp's own ``convert_hf_to_gguf.py`` and
quantized by its ``llama-quantize``.

    python bench/family_ggufs.py --llama-cpp DIR [--shapes llama-3.2-1b qwen3-1.7b gemma-3-1b]
        [--out /tmp/family-ggufs] [--quant Q4_K_M]

``DIR`` is a llama.cpp source tree with ``llama-quantize`` built under ``build/bin`` (the
``llama-cpp-python`` sdist vendors one under ``vendor/llama.cpp``). No model hub is needed:
``transformers`` builds each shape from its config class with random weights (bfloat16, small
normal noise), and every shape takes SmolLM2's tokenizer (exported from the default model's
GGUF), so its vocabulary is 49,152 — the real Llama 3.2, Qwen3 and Gemma 3 heads are 2.6–5x
larger. Prints one line per file: its path, size and the GGML types it holds.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("family_ggufs")

VOCAB = 49152  # SmolLM2's tokenizer

# transformers config class name and its keyword arguments, per shape (the real models' configs
# apart from the vocabulary)
SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-3.2-1b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rope_theta=500000.0, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )),
    "qwen3-1.7b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    )),
    "gemma-3-1b": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    )),
}


def write_hf_folder(shape: str, folder: Path, tokenizer_json: Path) -> None:
    """A Hugging Face folder of ``shape`` with random bfloat16 weights and SmolLM2's tokenizer."""
    import transformers

    config_name, model_name, kwargs = SHAPES[shape]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, **kwargs
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = getattr(transformers, model_name)(config)
        model.to_empty(device="cpu")
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Gemma stores w of its (1 + w) norms: zero is the identity there
                param.fill_(0.0 if "gemma" in shape else 1.0)
            else:
                param.normal_(0.0, 0.02)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (folder / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", '
        '"eos_token": "<|im_end|>", "model_max_length": 8192}'
    )


def export_tokenizer(path: Path) -> None:
    """SmolLM2's ``tokenizer.json``, rebuilt from the default model's GGUF metadata."""
    from services.common.model_source import resolve_model
    from services.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model("default"))
    tokenizer._backend.save(str(path))  # noqa: SLF001 - the rebuilt tokenizers.Tokenizer


def convert(folder: Path, out: Path, quant: str, llama_cpp: Path) -> Path:
    """``convert_hf_to_gguf.py`` to float16, then ``llama-quantize`` to ``quant``."""
    f16 = out.with_suffix(".f16.gguf")
    # the tree's own gguf-py first; what PYTHONPATH already holds (the converter's sentencepiece,
    # say) after it
    paths = [str(llama_cpp / "gguf-py"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    subprocess.run(
        [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outtype",
         "f16", "--outfile", str(f16)],
        check=True, env=env,
    )  # fmt: skip
    subprocess.run([str(llama_cpp / "build" / "bin" / "llama-quantize"), str(f16), str(out), quant],
                   check=True)  # fmt: skip
    f16.unlink()
    return out


def describe(path: Path) -> str:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    tensor_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    kinds = ", ".join(f"{name} x{n}" for name, n in types.most_common())
    return f"{path}  {path.stat().st_size / 2**20:.0f} MiB ({tensor_bytes / 2**20:.0f} MiB tensors): {kinds}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--out", type=Path, default=Path("/tmp/family-ggufs"))
    parser.add_argument("--quant", default="Q4_K_M")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer_json = args.out / "smollm2-tokenizer.json"
    if not tokenizer_json.exists():
        export_tokenizer(tokenizer_json)
    for shape in args.shapes:
        target = args.out / f"{shape}-{args.quant.lower()}.gguf"
        if not target.exists():
            folder = args.out / shape
            write_hf_folder(shape, folder, tokenizer_json)
            convert(folder, target, args.quant, args.llama_cpp)
        logger.info("%s", describe(target))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
