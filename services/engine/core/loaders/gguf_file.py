"""Load a GGUF file: model shape from its metadata, weights renamed to Hugging Face names,
dequantized to float32 with the ``gguf`` package or, for a quantized model (``quantize``), kept as
the file stores them (:func:`~services.engine.core.quant.quantized_weight.from_gguf_blocks`: Q8_0,
Q4_0, Q4_1, Q4_K; other types are re-quantized to Q8_0 from their float32 values).

For Llama models llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` for its rotary layout
(interleaved pairs); we undo it so the weights match the Hugging Face ``rotate_half`` layout:
``w.reshape(heads, head_dim // 2, 2, in).swapaxes(1, 2).reshape(out, in)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from services.common.errors import ModelLoadError
from services.engine.core.loaders.progress import progress
from services.common.config_reader import field_value, gguf_config, open_gguf
from services.common.model_config import ModelConfig
from services.engine.core.quant.quantized_weight import (
    FORMAT_Q8_0,
    GROUP,
    SUPPORTED_GGML_TYPES,
    QuantizedWeight,
    from_gguf_blocks,
    quantize_q8_0,
)

__all__ = [
    "field_value", "gguf_config", "gguf_weight_types", "iter_gguf_weights", "open_gguf", "unpermute",
]

_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def iter_gguf_weights(
    reader: Any, config: ModelConfig, quantize: str | None = None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield weights under Hugging Face names, q/k un-permuted: float32 tensors, or with
    ``quantize`` (``"q8_0"`` / ``"q4"``) matrices as :class:`QuantizedWeight` (``"q8_0"`` turns
    4-bit blocks into Q8_0 too)."""
    total = sum(int(t.n_bytes) for t in reader.tensors)
    with progress(total, "loading GGUF") as bar:
        for tensor in reader.tensors:
            name = _hf_name(tensor.name)
            if name is None:
                continue
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            weight: torch.Tensor | QuantizedWeight
            if quantize and len(shape) == 2 and shape[1] % GROUP == 0:
                weight = _quantized(tensor, shape, quantize)
            else:
                weight = _dequantized(tensor, shape)
            if config.architecture == "llama":  # only llama.cpp's LlamaModel permutes q/k
                if name.endswith(("q_proj.weight", "q_proj.bias")):
                    weight = _rows(weight, lambda t: unpermute(t, config.num_heads))
                elif name.endswith(("k_proj.weight", "k_proj.bias")):
                    weight = _rows(weight, lambda t: unpermute(t, config.num_kv_heads))
            bar.update(int(tensor.n_bytes))
            yield name, weight


def _dequantized(tensor: Any, shape: tuple[int, ...]) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except Exception as exc:
        raise ModelLoadError(f"cannot dequantize {tensor.name}: {exc}") from exc
    return torch.from_numpy(np.require(array, np.float32, ["C", "W"])).reshape(shape)


def _quantized(tensor: Any, shape: tuple[int, ...], quantize: str) -> QuantizedWeight:
    """The tensor's own blocks, kept as stored, when the kernels read them (Q8_0, Q4_0, Q4_1,
    Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: :data:`SUPPORTED_GGML_TYPES`) and ``quantize`` is not
    ``"q8_0"``; else Q8_0 from its float32 values (``"q8_0"`` re-quantizes every type)."""
    if tensor.tensor_type in SUPPORTED_GGML_TYPES:
        try:
            weight = from_gguf_blocks(tensor.data, tensor.tensor_type, (shape[0], shape[1]))
        except ValueError as exc:
            raise ModelLoadError(f"cannot read {tensor.name}: {exc}") from exc
        if weight is not None and (quantize != FORMAT_Q8_0 or weight.format == FORMAT_Q8_0):
            return weight
    return quantize_q8_0(_dequantized(tensor, shape))


def _rows(
    weight: torch.Tensor | QuantizedWeight, fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor | QuantizedWeight:
    return weight.map_rows(fn) if isinstance(weight, QuantizedWeight) else fn(weight)


def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a q/k projection (weight or bias)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _hf_name(name: str) -> str | None:
    if name in _NAMES:
        return _NAMES[name]
    match = _BLOCK.match(name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"


def gguf_weight_types(reader: Any) -> set[str]:
    """Names of the GGML types of the file's 2-D weights (e.g. ``{"Q4_1", "Q8_0"}``)."""
    return {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
