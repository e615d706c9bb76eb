"""Build a :class:`LlamaForCausalLM` and fill it from ``(hf_name, tensor)`` pairs.

Every loader (HF safetensors, GGUF, dummy) yields weights under Hugging Face names; this module
maps them onto Tandem's fused parameters (``q/k/v_proj`` → ``qkv_proj``, ``gate/up_proj`` →
``gate_up_proj``) and checks nothing is missing. The model is built on the ``meta`` device first,
so no memory is spent initialising weights that are about to be overwritten.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from services.common.errors import ModelLoadError
from services.engine.attention import PagedAttention
from services.engine.model import LlamaForCausalLM
from services.engine.model_config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", 0),
    "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", 1),
    "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
}
_PARTS = {"self_attn.qkv_proj.weight": 3, "self_attn.qkv_proj.bias": 3, "mlp.gate_up_proj.weight": 2}


def empty_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: PagedAttention | None = None,
) -> LlamaForCausalLM:
    """An uninitialised model of ``dtype`` on ``device`` (rope tables computed)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config, backend)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    model.rope.reset_tables()
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        model.embed_tokens.weight._tandem_shared = True  # type: ignore[attr-defined]
    return model.eval().requires_grad_(False)


def load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy Hugging Face-named tensors into ``model``; raise ModelLoadError on gaps or misfits."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights:
        target = _target_name(name)
        if target is None:
            continue
        dest_name, part = target
        if part is None:
            _copy(params, dest_name, tensor)
            loaded.add(dest_name)
            continue
        parts = pending.setdefault(dest_name, {})
        parts[part] = tensor
        if len(parts) == _PARTS[dest_name.split(".", 2)[2]]:
            _copy(params, dest_name, torch.cat([parts[i] for i in range(len(parts))], dim=0))
            loaded.add(dest_name)
            del pending[dest_name]
    if model.config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise ModelLoadError(f"checkpoint is missing {len(missing)} weights: {shown}")


def _target_name(name: str) -> tuple[str, int | None] | None:
    if name == "lm_head.weight":
        return "lm_head.weight", None
    if name.startswith("model.") and not name.startswith("model.layers."):
        return name.removeprefix("model."), None
    match = _LAYER.match(name)
    if match is None:
        return None
    layer, rest = match.groups()
    if rest in _FUSED:
        dest, part = _FUSED[rest]
        return f"layers.{layer}.{dest}", part
    if rest.endswith("rotary_emb.inv_freq"):
        return None
    return f"layers.{layer}.{rest}", None


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
