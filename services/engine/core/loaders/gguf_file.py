"""Load a GGUF file: model shape from its metadata, weights renamed to Hugging Face names,
dequantized to float32 with the ``gguf`` package or, for a quantized model (``quantize``), kept as
the file stores them where the kernels read that type (:func:`_quantized`; other types are
re-quantized to Q8_0 from their float32 values).

Names go through the ``gguf`` package's own tables, the ones llama.cpp's ``convert_hf_to_gguf.py``
wrote the file with: each family lists the Hugging Face modules its checkpoint has
(:data:`HF_MODULES`), ``gguf.TensorNameMap`` for the file's ``general.architecture`` turns each
into its GGUF name, and the loader reads that map backwards. Tensors the model has no module for
(``rope_freqs``, Phi-3's ``rope_factors_*``: :func:`~services.common.config_reader.gguf_config`
reads those) are skipped.

Values, where the converter changed them:

* Llama: ``attn_q`` / ``attn_k`` rows are permuted for llama.cpp's interleaved rotary layout; we
  undo it so the weights match the Hugging Face ``rotate_half`` layout:
  ``w.reshape(heads, head_dim // 2, 2, in).swapaxes(1, 2).reshape(out, in)``;
* Gemma 2/3: every RMSNorm weight (``attn_norm``, ``post_attention_norm``, ``ffn_norm``,
  ``post_ffw_norm``, ``attn_q_norm``, ``attn_k_norm``, ``output_norm``) is stored as ``1 + w``
  (``Gemma2Model`` / ``Gemma3Model.modify_tensors``); the model scales by ``1 + w`` itself, so
  1 is subtracted here (exact in float32);
* Qwen3-MoE: each expert's matrices are stacked in one 3-D tensor per layer
  (``ffn_gate_exps`` ...); they are yielded per expert, as ``mlp.experts.{e}.gate_proj.weight``
  (the Hugging Face checkpoint's names), each a slice of the file's blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from services.common.errors import ModelLoadError
from services.engine.core.loaders.progress import progress
from services.common.config_reader import GGUF_ARCHITECTURES, field_value, gguf_config, open_gguf
from services.common.model_config import ModelConfig
from services.engine.core.quant.type_summary import summarize_weight_types
from services.engine.core.quant.quantized_weight import (
    FORMAT_Q8_0,
    GROUP,
    SUPPORTED_GGML_TYPES,
    QuantizedWeight,
    from_gguf_blocks,
    quantize_q8_0,
)

__all__ = [
    "HF_MODULES", "field_value", "gguf_config", "gguf_weight_types", "hf_names", "iter_gguf_weights",
    "open_gguf", "unpermute",
]

_LLAMA_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_QK_NORM = ("self_attn.q_norm", "self_attn.k_norm")
_GATED_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_GEMMA_NORMS = (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
# Per GGUF architecture: the Hugging Face modules of one decoder layer (``model.layers.{i}.``).
HF_MODULES: dict[str, tuple[str, ...]] = {
    "llama": ("input_layernorm", *_LLAMA_ATTENTION, "post_attention_layernorm", *_GATED_MLP),
    "qwen2": ("input_layernorm", *_LLAMA_ATTENTION, "post_attention_layernorm", *_GATED_MLP),
    "qwen3": (
        "input_layernorm", *_LLAMA_ATTENTION, *_QK_NORM, "post_attention_layernorm", *_GATED_MLP,
    ),
    "gemma2": (*_GEMMA_NORMS, *_LLAMA_ATTENTION, *_GATED_MLP),
    "gemma3": (*_GEMMA_NORMS, *_LLAMA_ATTENTION, *_QK_NORM, *_GATED_MLP),
    "phi3": (
        "input_layernorm", "self_attn.qkv_proj", "self_attn.o_proj", "post_attention_layernorm",
        "mlp.gate_up_proj", "mlp.down_proj",
    ),
    "qwen3moe": (
        "input_layernorm", *_LLAMA_ATTENTION, *_QK_NORM, "post_attention_layernorm", "mlp.gate",
        "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj",
    ),
}
_HF_TOP = ("model.embed_tokens", "model.norm", "lm_head")
_EXPERTS = ".mlp.experts."
_GEMMA = ("gemma2", "gemma3")

logger = logging.getLogger(__name__)


def iter_gguf_weights(
    reader: Any, config: ModelConfig, quantize: str | None = None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield weights under Hugging Face names, converted back where llama.cpp's converter changed
    them (this module's docstring): float32 tensors, or with ``quantize`` (``"q8_0"`` / ``"q4"``)
    matrices as :class:`QuantizedWeight` (``"q8_0"`` turns 4-bit blocks into Q8_0 too)."""
    arch = field_value(reader, "general.architecture")
    names = hf_names(arch, config.num_layers)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    held: list[tuple[Any, torch.Tensor | QuantizedWeight]] = []  # (GGML type, what it became)
    with progress(total, "loading GGUF") as bar:
        for tensor in reader.tensors:
            name = names.get(tensor.name)
            if name is None:
                bar.update(int(tensor.n_bytes))
                continue
            if _EXPERTS in name:
                for expert_name, weight in _experts(tensor, name, quantize):
                    held.append((tensor.tensor_type, weight))
                    yield expert_name, weight
            else:
                weight = _weight(tensor, config, name, quantize)
                held.append((tensor.tensor_type, weight))
                yield name, weight
            bar.update(int(tensor.n_bytes))
    logger.info("GGUF tensor types: %s", summarize_weight_types(held))


def hf_names(arch: str, layers: int) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name for a file of ``general.architecture`` ``arch``,
    from ``gguf.TensorNameMap`` (see the module docstring)."""
    if arch not in HF_MODULES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in GGUF; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return dict(_hf_names(arch, layers))


@lru_cache(maxsize=8)
def _hf_names(arch: str, layers: int) -> tuple[tuple[str, str], ...]:
    import gguf

    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    table = gguf.TensorNameMap(model_arch, layers)
    modules = list(_HF_TOP) + [
        f"model.layers.{i}.{module}" for i in range(layers) for module in HF_MODULES[arch]
    ]
    found: dict[str, str] = {}
    for module in modules:
        gguf_name = table.get_name(module)
        if gguf_name is None:  # not in this architecture's files (Gemma 2 has no untied head)
            continue
        for suffix in (".weight", ".bias"):
            if found.setdefault(gguf_name + suffix, module + suffix) != module + suffix:
                raise ModelLoadError(  # pragma: no cover - two modules, one GGUF name
                    f"{module} and {found[gguf_name + suffix]} share the GGUF name {gguf_name}"
                )
    return tuple(found.items())


def _weight(
    tensor: Any, config: ModelConfig, name: str, quantize: str | None
) -> torch.Tensor | QuantizedWeight:
    """One tensor under its Hugging Face name, its values as the Hugging Face checkpoint has them."""
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
    elif config.architecture in _GEMMA and name.endswith("norm.weight"):
        assert isinstance(weight, torch.Tensor)  # norms are 1-D, never quantized
        weight = weight - 1.0  # stored as 1 + w
    return weight


def _experts(
    tensor: Any, name: str, quantize: str | None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """A stacked ``[experts, out, in]`` tensor as one ``mlp.experts.{e}.<proj>.weight`` each."""
    if len(tensor.shape) != 3:
        raise ModelLoadError(f"{tensor.name} should stack the experts' matrices in 3 dimensions")
    layer, proj = name.split(_EXPERTS)
    cols, rows, experts = (int(d) for d in tensor.shape.tolist())
    for e in range(experts):
        part = tensor._replace(
            name=f"{tensor.name}[{e}]",
            shape=np.array([cols, rows], dtype=np.uint64),
            n_elements=cols * rows,
            n_bytes=int(tensor.n_bytes) // experts,
            data=tensor.data[e],
        )
        expert: torch.Tensor | QuantizedWeight
        if quantize and cols % GROUP == 0:
            expert = _quantized(part, (rows, cols), quantize)
        else:
            expert = _dequantized(part, (rows, cols))
        yield f"{layer}{_EXPERTS}{e}.{proj}", expert


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


def gguf_weight_types(reader: Any) -> set[str]:
    """Names of the GGML types of the file's matrices, stacked experts' included (e.g.
    ``{"Q4_1", "Q8_0"}``)."""
    return {t.tensor_type.name for t in reader.tensors if len(t.shape) in (2, 3)}
