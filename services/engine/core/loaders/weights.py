"""Build a model of the checkpoint's family and fill it from ``(hf_name, tensor)`` pairs.

Every loader (HF safetensors, GGUF, dummy) yields weights under Hugging Face names; this module
maps them onto Tandem's fused parameters (``q/k/v_proj`` → ``qkv_proj``, ``gate/up_proj`` →
``gate_up_proj``, an MoE expert's too) and checks nothing is missing. The model is built on the ``meta`` device first,
so no memory is spent initialising weights that are about to be overwritten. A base checkpoint
(``Qwen3Model``, ``LlamaModel``: an embedding model) stores the same names without the ``model.``
prefix and no ``lm_head``; unless tied, its model has no head to fill (``NoLMHead``).

Quantized models (``quantize="q8_0"`` or ``"q4"``): linear and embedding weights arrive as
:class:`QuantizedWeight` (a GGUF's blocks) or as float tensors, which are quantized to Q8_0 here;
their float parameters are never allocated. ``quantize="bfloat16"`` / ``"float16"`` (CPU's
weight-only 16-bit formats) casts them to 16-bit floats here, from whatever arrives. Fused parts
in different formats (a Q4_K_M file's Q4_K ``q`` and ``k`` next to a Q6_K ``v``) stay as stored:
the layer holds one run of rows per format (:meth:`Linear.set_parts`).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from services.common.errors import ModelLoadError
from services.engine.core.attention import PagedAttention
from services.engine.core.embedding import Embedding
from services.engine.core.linear import Linear
from services.engine.core.models import CausalLM, model_class
from services.common.model_config import ModelConfig
from services.engine.core.quant.quantized_weight import (
    GROUP,
    HALF_FORMATS,
    QuantizedWeight,
    quantize_q8_0,
    to_half,
)

Weight = torch.Tensor | QuantizedWeight
logger = logging.getLogger(__name__)

_BASE_PREFIXES = ("layers.", "embed_tokens.", "norm.")  # a base checkpoint's top-level names
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# the last two name parts of a fused part -> (the fused parameter's, which part, of how many);
# whatever precedes them (``self_attn.``, ``mlp.``, ``mlp.experts.7.``) carries over
_FUSED = {
    "q_proj.weight": ("qkv_proj.weight", 0, 3),
    "k_proj.weight": ("qkv_proj.weight", 1, 3),
    "v_proj.weight": ("qkv_proj.weight", 2, 3),
    "q_proj.bias": ("qkv_proj.bias", 0, 3),
    "k_proj.bias": ("qkv_proj.bias", 1, 3),
    "v_proj.bias": ("qkv_proj.bias", 2, 3),
    "gate_proj.weight": ("gate_up_proj.weight", 0, 2),
    "up_proj.weight": ("gate_up_proj.weight", 1, 2),
}


def empty_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: PagedAttention | None = None,
    *,
    quantized: bool = False,
) -> CausalLM:
    """An uninitialised model of ``dtype`` on ``device`` (rope tables computed).

    With ``quantized`` the linear and embedding weights are left empty (they arrive quantized).
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(config)(config, backend)
            if quantized:
                for module in model.modules():
                    if isinstance(module, Linear | Embedding):
                        module.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    for rope in model.rotary_embeddings():
        rope.reset_tables()
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        model.embed_tokens.weight._tandem_shared = True  # type: ignore[attr-defined]
    return model.eval().requires_grad_(False)


def load_weights(
    model: CausalLM,
    weights: Iterable[tuple[str, Weight]],
    quantize: str | None = None,
) -> None:
    """Copy Hugging Face-named weights into ``model``; raise ModelLoadError on gaps or misfits.

    ``quantize`` (``"q8_0"`` / ``"q4"`` / ``"bfloat16"`` / ``"float16"``) keeps linear and
    embedding weights in that compact format.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    pending: dict[str, dict[int, Weight]] = {}
    parted: Counter[str] = Counter()  # fused projections whose parts came in different formats
    for name, tensor in weights:
        target = _target_name(name)
        if target is None:
            continue
        dest_name, part, count = target
        if part is None:
            _place(model, params, dest_name, tensor, quantize)
            loaded.add(dest_name)
            continue
        parts = pending.setdefault(dest_name, {})
        parts[part] = tensor
        if len(parts) == count:
            fused = _fuse([parts[i] for i in range(len(parts))], quantize)
            if isinstance(fused, list):
                parted["+".join(p.format for p in fused)] += 1
            _place(model, params, dest_name, fused, quantize)
            loaded.add(dest_name)
            del pending[dest_name]
    if model.config.tie_word_embeddings:
        loaded.add("lm_head.weight")
        if model.embed_tokens.quant is not None:
            model.lm_head.set_quantized(model.embed_tokens.quant)
        else:
            model.lm_head.weight = model.embed_tokens.weight
    if parted:
        logger.info("fused projections kept in their parts' formats: %s",
                    ", ".join(f"{kinds} x{n}" for kinds, n in parted.most_common()))
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise ModelLoadError(f"checkpoint is missing {len(missing)} weights: {shown}")


def _target_name(name: str) -> tuple[str, int | None, int] | None:
    """Where a checkpoint weight goes: (parameter, part of a fused one or None, parts). A base
    checkpoint's names (``layers.0...``, ``embed_tokens.weight``, ``norm.weight``: an embedding
    model's) are read as the causal LM's ``model.`` ones."""
    if name.startswith(_BASE_PREFIXES):
        name = "model." + name
    if name == "lm_head.weight":
        return "lm_head.weight", None, 1
    if name.startswith("model.") and not name.startswith("model.layers."):
        return name.removeprefix("model."), None, 1
    match = _LAYER.match(name)
    if match is None:
        return None
    layer, rest = match.groups()
    parts = rest.rsplit(".", 2)
    leaf = ".".join(parts[-2:])
    if leaf in _FUSED:
        dest, part, count = _FUSED[leaf]
        prefix = parts[0] + "." if len(parts) == 3 else ""
        return f"layers.{layer}.{prefix}{dest}", part, count
    if rest.endswith("rotary_emb.inv_freq"):
        return None
    return f"layers.{layer}.{rest}", None, 1


def _fuse(parts: list[Weight], quantize: str | None) -> Weight | list[QuantizedWeight]:
    """Concatenate fused parts along rows. Quantized parts in different formats (kept
    quantized: ``quantize`` is a quantized format) become one weight per run of same-format parts,
    in order, a float part quantized to Q8_0 as a weight of its own would be; otherwise the
    parts meet in float32 (``_place`` converts them as one weight)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, dim=0)  # type: ignore[arg-type]
    if all(isinstance(p, QuantizedWeight) for p in parts):
        formats = {p.format for p in parts}  # type: ignore[union-attr]
        if len(formats) == 1:
            return QuantizedWeight.cat(parts)  # type: ignore[arg-type]
    if quantize and quantize not in HALF_FORMATS:
        runs: list[list[QuantizedWeight]] = []
        for part in parts:
            held = part if isinstance(part, QuantizedWeight) else quantize_q8_0(part.float())
            if runs and runs[-1][0].format == held.format:
                runs[-1].append(held)
            else:
                runs.append([held])
        return [QuantizedWeight.cat(run) for run in runs]
    return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p.float() for p in parts])


def _place(
    model: nn.Module,
    params: dict[str, torch.nn.Parameter],
    name: str,
    value: Weight | list[QuantizedWeight],
    quantize: str | None,
) -> None:
    """Put one (possibly quantized, or in parts: see :func:`_fuse`) weight where ``name`` says."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if isinstance(value, list):
        if not isinstance(module, Linear) or attr != "weight":
            raise ModelLoadError(f"weight {name} comes in parts but is not a linear layer's")
        try:
            module.set_parts(value)
        except ValueError as exc:
            raise ModelLoadError(f"weight {name}: {exc}") from exc
        return
    if quantize and attr == "weight" and isinstance(module, Linear | Embedding):
        fits = isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] % GROUP == 0
        if quantize in HALF_FORMATS and (fits or isinstance(value, QuantizedWeight)):
            value = to_half(value, quantize)
        elif fits:
            value = quantize_q8_0(value)
        if isinstance(value, QuantizedWeight):
            try:
                module.set_quantized(value)
            except ValueError as exc:
                raise ModelLoadError(f"weight {name}: {exc}") from exc
            return
        expected = tuple(
            (module.out_features, module.in_features) if isinstance(module, Linear)
            else (module.num_embeddings, module.embedding_dim)
        )
        if tuple(value.shape) != expected:
            raise ModelLoadError(f"weight {name} has shape {tuple(value.shape)}, expected {expected}")
        module.weight = nn.Parameter(value.to(torch.float32).contiguous(), requires_grad=False)
        return
    if isinstance(value, QuantizedWeight):
        value = value.dequantize()
    _copy(params, name, value)


def _copy(params: dict[str, torch.nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    param = params.get(name)
    if param is None:
        raise ModelLoadError(f"unexpected weight {name} in checkpoint")
    if tuple(param.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)
