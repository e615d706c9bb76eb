"""Read a model's shape without torch: GGUF metadata or a Hugging Face ``config.json``.

Used by the engine's loaders and by torch-free services (the tokenizer service reports the model
fingerprint that the KV hand-off checks), so the two can never disagree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.common.errors import ModelLoadError
from services.common.model_source import ModelSource
from services.common.model_config import ModelConfig

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")


def read_model_config(source: ModelSource) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF file or HF folder (dummy shapes live with their loader)."""
    if source.kind == "gguf":
        return gguf_config(open_gguf(Path(source.path)))
    if source.kind == "hf":
        return read_hf_config(Path(source.path))
    raise ModelLoadError(f"no config file for a {source.kind} model")


def read_hf_config(folder: Path) -> ModelConfig:
    """Parse ``config.json`` into a :class:`ModelConfig` (one-line error when unreadable)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{folder / 'config.json'} is not a JSON object")
    return ModelConfig.from_hf_config(raw)


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` for ``path``, or a one-line ModelLoadError for a corrupt file."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/OSError/struct errors on bad files
        raise ModelLoadError(f"corrupt or unreadable GGUF file {path.name}: {exc}") from exc


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value (scalar, string or list) by key, or ``default``."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_config(reader: Any) -> ModelConfig:
    """Model shape from GGUF metadata; refuse architectures Tandem does not implement."""
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in GGUF; supported: "
            + ", ".join(SUPPORTED_GGUF_ARCHITECTURES)
        )
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelLoadError("GGUF file has no token_embd.weight")

    def need(key: str) -> Any:
        value = field_value(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(field_value(reader, f"{arch}.vocab_size", int(embd.shape[-1])))
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(field_value(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field_value(reader, f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(field_value(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )
