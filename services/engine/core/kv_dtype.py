"""Which dtype an engine's KV pool takes: ``--kv-cache-dtype`` resolved against the model, its
device and its attention backend (``kv_cache.kv_cache_dtype`` holds the rules; this file knows
the backends, which ``kv_cache.py`` sits below).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from services.common.errors import InvalidArgumentError
from services.engine.core.attention import TorchPagedAttention
from services.engine.core.kernels.cpu_paged_attention import CpuPagedAttention, auto_cache_dtype
from services.engine.core.kv_cache import Q8_0, KVDtype, kv_cache_dtype
from services.engine.core.loaders import LoadedModel

logger = logging.getLogger(__name__)


def engine_kv_dtype(loaded: LoadedModel, device: torch.device, requested: str | None) -> KVDtype:
    """The pool dtype for ``requested`` (None: the model's own): InvalidArgumentError for a
    combination the backends cannot read; logs when it differs from the model's dtype."""
    kv_dtype = kv_cache_dtype(requested, loaded.dtype, _auto_kv_dtype(loaded, device), device.type)
    if kv_dtype == Q8_0:
        _check_q8_0_backend(loaded)
    if kv_dtype != loaded.dtype:
        logger.info("KV cache in %s (the model computes in %s; kv cache dtype %s)",
                    dtype_name(kv_dtype), dtype_name(loaded.dtype), requested)  # fmt: skip
    return kv_dtype


def dtype_name(dtype: KVDtype) -> str:
    """``float16``, ``q8_0``, ...: a cache dtype as ``KVLayout`` names it."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _backend(loaded: LoadedModel) -> object | None:
    layers = loaded.model.layers
    return layers[0].self_attn.backend if layers else None


def _auto_kv_dtype(loaded: LoadedModel, device: torch.device) -> Callable[[], torch.dtype] | None:
    """What ``--kv-cache-dtype auto`` asks for a float32 model on CPU whose attention runs the C
    kernels: the cache dtype they read at least as fast as float32 on this instruction set; None
    elsewhere (the model's own dtype)."""
    if (not isinstance(_backend(loaded), CpuPagedAttention) or device.type != "cpu"
            or loaded.dtype != torch.float32):  # fmt: skip
        return None
    return auto_cache_dtype


def _check_q8_0_backend(loaded: LoadedModel) -> None:
    """A ``q8_0`` cache is read by the CPU kernels and the torch reference only (another
    backend, Triton under its CPU interpreter, reads float caches): InvalidArgumentError else."""
    backend = _backend(loaded)
    if backend is not None and type(backend) not in (CpuPagedAttention, TorchPagedAttention):
        raise InvalidArgumentError(
            f"--kv-cache-dtype q8_0 needs the cpu or torch attention backend, not "
            f"{type(backend).__name__}",
            param="kv_cache_dtype",
        )
