"""Load a GGUF file: model shape from its metadata, weights dequantized to float32 with the
``gguf`` package and renamed to Hugging Face names.

For Llama models llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` for its rotary layout
(interleaved pairs); we undo it so the weights match the Hugging Face ``rotate_half`` layout:
``w.reshape(heads, head_dim // 2, 2, in).swapaxes(1, 2).reshape(out, in)``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from services.common.errors import ModelLoadError
from services.engine.loaders.progress import progress
from services.engine.config_reader import field_value, gguf_config, open_gguf
from services.engine.model_config import ModelConfig

__all__ = ["field_value", "gguf_config", "iter_gguf_weights", "open_gguf", "unpermute"]

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


def iter_gguf_weights(reader: Any, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield dequantized float32 tensors under Hugging Face names, q/k un-permuted."""
    from gguf.quants import dequantize

    total = sum(int(t.n_bytes) for t in reader.tensors)
    with progress(total, "loading GGUF") as bar:
        for tensor in reader.tensors:
            name = _hf_name(tensor.name)
            if name is None:
                continue
            try:
                array = dequantize(tensor.data, tensor.tensor_type)
            except Exception as exc:
                raise ModelLoadError(f"cannot dequantize {tensor.name}: {exc}") from exc
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            weight = torch.from_numpy(np.require(array, np.float32, ["C", "W"])).reshape(shape)
            if config.architecture == "llama":  # only llama.cpp's LlamaModel permutes q/k
                if name.endswith(("q_proj.weight", "q_proj.bias")):
                    weight = unpermute(weight, config.num_heads)
                elif name.endswith(("k_proj.weight", "k_proj.bias")):
                    weight = unpermute(weight, config.num_kv_heads)
            bar.update(int(tensor.n_bytes))
            yield name, weight


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
