"""Read a model's shape without torch: GGUF metadata or a Hugging Face ``config.json``.

Used by the engine's loaders and by torch-free services (the tokenizer service reports the model
fingerprint that the KV hand-off checks), so the two can never disagree.

GGUF metadata follows llama.cpp's keys (``gguf.Keys``) and its loader's defaults
(``src/llama-model.cpp``, ``load_hparams``) where the file states nothing:

* every family: ``<arch>.embedding_length``, ``block_count``, ``attention.head_count(_kv)``,
  ``attention.key_length`` (the head size, where it is not hidden / heads), ``rope.freq_base``,
  ``context_length``; the head is tied when there is no ``output.weight``, q/k/v carry a bias
  when ``blk.0.attn_q.bias`` exists, q/k heads are normalised when ``blk.0.attn_q_norm`` exists;
* ``gemma2`` / ``gemma3``: tanh GELU, the score scale ``1/sqrt(key_length)`` (27B:
  ``1/sqrt(hidden / heads)``), a sliding window on layers picked by
  ``attention.sliding_window_pattern`` (a period or one flag per layer), by default Gemma 2's one
  in two (from layer 0: window 4096 when unstated) and Gemma 3's five in six (every 6th layer
  global); Gemma 3's sliding layers use ``rope.freq_base_swa``, by default 10000; Gemma 2's
  attention and final soft-caps default to 50 and 30. ``<end_of_turn>`` ends generation too
  (Gemma's ``generation_config``);
* ``llama``: Llama 3.1+ files hold their rope scaling as per-frequency divisors
  (``rope_freqs.weight``), kept here as a ``longrope`` table with equal short and long factors
  (the same formula: each inverse frequency divided by its factor);
* ``phi3``: ``rope.dimension_count`` below the head size is partial rotary; LongRoPE's factors
  are the ``rope_factors_short`` / ``rope_factors_long`` tensors, with
  ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``. Like llama.cpp and
  transformers' GGUF loader, a Phi-3 file's sliding window is not applied;
* ``qwen3moe``: ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``; every
  layer is an MoE layer and the top-k weights are renormalised (``expert_weights_norm``, true
  when unstated, as llama.cpp's Qwen3-MoE graph does).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from services.common.errors import ModelLoadError
from services.common.model_source import ModelSource
from services.common.model_config import FULL, SLIDING, ModelConfig, RopeScaling

# GGUF ``general.architecture`` -> Tandem's model family (a value of model_config.ARCHITECTURES)
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)
# llama.cpp's sliding-window period per Gemma architecture (the last layer of each is global)
_GEMMA_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
_GEMMA_END_OF_TURN = "<end_of_turn>"


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
    """A ``gguf.GGUFReader`` for ``path`` (:func:`fast_gguf_reader`'s), or a one-line
    ModelLoadError for a corrupt file."""
    try:
        return fast_gguf_reader()(str(path))
    except Exception as exc:  # the reader raises ValueError/OSError/struct errors on bad files
        raise ModelLoadError(f"corrupt or unreadable GGUF file {path.name}: {exc}") from exc


@lru_cache(maxsize=1)
def fast_gguf_reader() -> type:
    """``gguf.GGUFReader`` with its metadata arrays read in one go.

    The stock reader builds two numpy memmap views per array element: 15-25 s for the 262,144
    tokens, scores and types of a Gemma 3 vocabulary, paid by every process that opens the
    file. Here an array of numbers is one view (``ReaderField.data`` then holds one index, and
    ``contents()`` returns the whole list as before) and an array of strings is one plain
    byte-slice per string; 0.6 s for the same file. Byte-swapped files take the stock path.
    """
    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    class FastGGUFReader(GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            count, offs = int(alen[0]), orig_offs + 12
            itype = GGUFValueType(int(raw_itype[0]))
            types = [GGUFValueType.ARRAY] + ([itype] if count else [])
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                values = self._get(offs, nptype, count)
                return 12 + int(values.nbytes), [raw_itype, alen, values], [2], types
            if itype != GGUFValueType.STRING:
                return super()._get_field_parts(orig_offs, raw_type)  # nested arrays
            raw = self.data.view(np.ndarray)  # slicing a plain ndarray skips memmap's hooks
            view = memoryview(raw)
            parts: list[Any] = [raw_itype, alen]
            for _ in range(count):
                length = int.from_bytes(view[offs : offs + 8], "little")
                parts.append(raw[offs + 8 : offs + 8 + length])
                offs += 8 + length
            return offs - orig_offs, parts, list(range(2, 2 + count)), types

    return FastGGUFReader


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value (scalar, string or list) by key, or ``default``."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_config(reader: Any) -> ModelConfig:
    """Model shape from GGUF metadata (the rules in this module's docstring); refuse
    architectures Tandem does not implement."""
    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in GGUF; supported: "
            + ", ".join(SUPPORTED_GGUF_ARCHITECTURES)
        )
    family = GGUF_ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("GGUF file has no token_embd.weight")

    def get(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{key}", default)

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    layers = int(need("block_count"))
    heads = _per_layer_max(need("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    max_pos = int(get("context_length", 4096))
    vocab = int(get("vocab_size", int(tensors["token_embd.weight"].shape[-1])))
    gemma = family in ("gemma2", "gemma3")
    window, types = _sliding_layers(reader, arch, layers)
    rotary = get("rope.dimension_count")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = () if eos is None else (int(eos),)
    if gemma:
        eos_ids += tuple(i for i in _token_ids(reader, _GEMMA_END_OF_TURN) if i not in eos_ids)
    moe = family == "qwen3_moe"
    return ModelConfig(
        architecture=family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", 0) or 0),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_per_layer_max(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=_gguf_rope_scaling(reader, arch, tensors, max_pos),
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        hidden_act="gelu_tanh" if gemma else "silu",
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        query_scale=_gemma_query_scale(arch, layers, hidden, heads, head_dim) if gemma else None,
        sliding_window=window,
        layer_types=types,
        local_rope_theta=float(get("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
        attn_softcap=_cap(get("attn_logit_softcapping", 50.0)) if arch == "gemma2" else None,
        final_softcap=_cap(get("final_logit_softcapping", 30.0 if arch == "gemma2" else None)),
        partial_rotary_factor=1.0 if rotary is None else int(rotary) / head_dim,
        num_experts=int(need("expert_count")) if moe else 0,
        num_experts_per_tok=int(need("expert_used_count")) if moe else 0,
        moe_intermediate_size=int(need("expert_feed_forward_length")) if moe else 0,
        norm_topk_prob=bool(get("expert_weights_norm", True)),
    )


def _per_layer_max(value: Any) -> int:
    """A head count stated once or per layer (then the largest)."""
    return max(int(v) for v in value) if isinstance(value, list) else int(value)


def _sliding_layers(reader: Any, arch: str, layers: int) -> tuple[int | None, tuple[str, ...]]:
    """The window and the per-layer types, llama.cpp's way: only Gemma files slide here."""
    if arch not in _GEMMA_SWA_PERIOD:
        return None, ()
    default = 4096 if arch == "gemma2" else None
    window = field_value(reader, f"{arch}.attention.sliding_window", default)
    if not window:
        return None, ()
    pattern = field_value(reader, f"{arch}.attention.sliding_window_pattern", _GEMMA_SWA_PERIOD[arch])
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelLoadError(
                f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers"
            )
        flags = [bool(p) for p in pattern]
    else:
        period = int(pattern)  # llama.cpp's set_swa_pattern: the last layer of each period is global
        flags = [i % period < period - 1 for i in range(layers)]
    return int(window), tuple(SLIDING if f else FULL for f in flags)


def _gemma_query_scale(arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> float:
    """llama.cpp's ``f_attention_scale``: Gemma 2/3 27B scale by hidden / heads (its
    ``query_pre_attn_scalar``), the other sizes by the head size."""
    is_27b = layers == (46 if arch == "gemma2" else 62)
    return float(hidden // heads if is_27b else head_dim) ** -0.5


def _gguf_rope_scaling(
    reader: Any, arch: str, tensors: dict[str, Any], max_pos: int
) -> RopeScaling | None:
    """A linear factor, Llama 3's ``rope_freqs`` divisors or Phi-3's LongRoPE factors."""
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    original = int(field_value(reader, f"{arch}.rope.scaling.original_context_length", max_pos))
    if "rope_factors_short.weight" in tensors and "rope_factors_long.weight" in tensors:
        attention = field_value(reader, f"{arch}.rope.scaling.attn_factor", 1.0)
        return RopeScaling(
            factor=max_pos / original, original_max_position_embeddings=original,
            rope_type="longrope",
            short_factor=_vector(tensors["rope_factors_short.weight"]),
            long_factor=_vector(tensors["rope_factors_long.weight"]),
            attention_factor=float(attention),
        )  # fmt: skip
    if "rope_freqs.weight" in tensors:
        divisors = _vector(tensors["rope_freqs.weight"])
        return RopeScaling(
            factor=1.0, original_max_position_embeddings=max_pos, rope_type="longrope",
            short_factor=divisors, long_factor=divisors,
        )  # fmt: skip
    if kind in (None, "none") or factor in (None, 0.0, 1.0):
        return None
    if kind != "linear":
        raise ModelLoadError(f"unsupported GGUF rope scaling {kind!r}; supported: linear")
    return RopeScaling(factor=float(factor), rope_type="linear")


def _vector(tensor: Any) -> tuple[float, ...]:
    """A small float32 tensor's values (rope factors are stored as F32)."""
    if tensor.tensor_type.name != "F32":
        raise ModelLoadError(f"{tensor.name} is {tensor.tensor_type.name}; expected F32")
    return tuple(float(v) for v in tensor.data.reshape(-1).tolist())


def _token_ids(reader: Any, text: str) -> tuple[int, ...]:
    """Ids of the vocabulary entries spelled ``text``, without decoding the whole vocabulary."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return ()
    wanted = text.encode()
    return tuple(i for i, part in enumerate(field.data) if bytes(field.parts[part]) == wanted)


def _cap(value: Any) -> float | None:
    return None if value in (None, 0, 0.0) else float(value)
