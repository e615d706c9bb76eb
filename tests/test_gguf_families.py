"""Every family's GGUF, as llama.cpp's ``convert_hf_to_gguf.py`` writes it, loads into the same
network as the Hugging Face folder it was converted from.

For each family a tiny random checkpoint (norm weights random too, so Gemma's stored ``1 + w`` is
checked) is saved by ``transformers`` and converted to float32 GGUF; Tandem loads both, and the
config read from the GGUF metadata must equal the one read from ``config.json`` and the first
step's logits and 8 greedy tokens must agree. This covers the tensor names (``gguf``'s tables),
Llama 3's ``rope_freqs``, Phi-3's fused QKV / gate-up and LongRoPE factors, Qwen3-MoE's stacked
experts, Gemma 2's soft-caps and sliding pattern, and Gemma's ``1 + w`` norms.

The converter is not a dependency: set ``TANDEM_LLAMA_CPP`` to a llama.cpp source tree (the
``llama-cpp-python`` sdist vendors one under ``vendor/llama.cpp``) to run these; they skip
otherwise. The converter insists on a tokenizer it recognises, so the conversion runs through a
small wrapper that lets any tokenizer pass as GPT-2's (the vocabulary is not under test here).
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import LoadedModel, load_model

pytestmark = pytest.mark.slow

LLAMA_CPP = os.environ.get("TANDEM_LLAMA_CPP")
_COMMON = dict(
    vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=64,
    intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=2048,
)  # fmt: skip
_GEMMA_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
    )),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=32, sliding_window=8, rope_parameters=_GEMMA_ROPE,
    )),
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_key_value_heads=4, tie_word_embeddings=False, partial_rotary_factor=0.75,
        original_max_position_embeddings=64,
        rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 64,
                      "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                      "long_factor": [1.2, 1.5, 2.0, 3.0, 5.0, 8.0]},
    )),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True, tie_word_embeddings=False,
    )),
}  # fmt: skip
_CONVERT = """
import sys
sys.path.insert(0, sys.argv.pop(1))
import convert_hf_to_gguf as convert
try:  # newer trees split the model classes into a package
    from conversion import base, gemma, phi
    modules = (base, gemma, phi, convert)
except ImportError:
    modules = (convert,)
for module in modules:
    for name in ("TextModel", "Model"):
        if hasattr(module, name):
            getattr(module, name).get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    for name in ("Gemma2Model", "Phi3MiniModel"):
        if hasattr(module, name):
            getattr(module, name).set_vocab = lambda self: self._set_vocab_gpt2()
convert.main()
"""


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.common.model_source import resolve_model
    from services.tokenizer.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    Tokenizer.load(resolve_model("default"))._backend.save(str(path))  # noqa: SLF001
    return path


def _convert(family: str, root: Path, tokenizer_json: Path) -> tuple[Path, Path]:
    import transformers

    assert LLAMA_CPP is not None
    config_name, model_name, kwargs = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_COMMON, **kwargs})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if "norm" in name else 0.05)
    folder, gguf = root / family, root / f"{family}.gguf"
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (folder / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", '
        '"eos_token": "<|im_end|>"}'
    )
    env = dict(os.environ, PYTHONPATH=str(Path(LLAMA_CPP) / "gguf-py"))
    subprocess.run(
        [sys.executable, "-c", _CONVERT, LLAMA_CPP, str(folder), "--outtype", "f32",
         "--outfile", str(gguf)],
        check=True, env=env, capture_output=True,
    )  # fmt: skip
    return folder, gguf


def _run(loaded: LoadedModel, prompts: list[list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64))
    first: list[torch.Tensor] = []
    sample = engine.runner.sampler

    def capture(logits: torch.Tensor, states):  # type: ignore[no-untyped-def]
        first.append(logits.clone())
        return sample(logits, states)

    engine.runner.sampler = capture  # type: ignore[assignment]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = [o.new_token_ids for o in engine.generate(prompts, params)]
    return first[0], tokens


@pytest.mark.skipif(LLAMA_CPP is None, reason="set TANDEM_LLAMA_CPP to a llama.cpp source tree")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_converted_gguf_loads_as_its_hf_folder(
    family: str, tmp_path: Path, tokenizer_json: Path
) -> None:
    folder, gguf = _convert(family, tmp_path, tokenizer_json)
    from_gguf, from_folder = load_model(str(gguf), torch.float32), load_model(str(folder), torch.float32)
    for field in dataclasses.fields(from_gguf.config):
        ours, theirs = getattr(from_gguf.config, field.name), getattr(from_folder.config, field.name)
        if field.name == "rms_norm_eps":  # stored as float32 in the GGUF
            assert math.isclose(ours, theirs, rel_tol=1e-6)
        elif field.name == "rope_scaling" and ours is not None and ours.rope_type != theirs.rope_type:
            assert family == "llama3" and ours.rope_type == "longrope"  # rope_freqs: the divisors
        elif field.name not in ("rope_scaling", "eos_token_ids", "bos_token_id"):
            assert ours == theirs, field.name
    prompts = [list(range(5, 45)), [7, 8, 9], list(range(100, 200))]  # past the window and 64
    logits, tokens = _run(from_gguf, prompts)
    expected_logits, expected_tokens = _run(from_folder, prompts)
    assert (logits - expected_logits).abs().max().item() < 1e-4
    assert tokens == expected_tokens
