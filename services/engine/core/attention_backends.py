"""Attention backends by name: ``torch`` (reference, everywhere), ``cpu`` (float32 paged decode
kernel in C, built and timed against the reference once the model has loaded) and ``triton``
(paged decode kernel; GPUs, or CPU under ``TRITON_INTERPRET=1``). ``auto`` picks triton on CUDA
when it imports, else torch; on CPU it picks cpu, which itself runs the torch path when its kernel
can't be built here or lost to the reference. (Building after the load, not here, keeps a model
that fails to load from logging about kernels first.)"""

from __future__ import annotations

import torch

from services.common.errors import InvalidArgumentError
from services.engine.core.attention import PagedAttention, TorchPagedAttention

BACKENDS = ("auto", "torch", "cpu", "triton")


def make_attention_backend(name: str, device: torch.device | str) -> PagedAttention:
    """Build the named backend for ``device``."""
    if name not in BACKENDS:
        raise InvalidArgumentError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    kind = torch.device(device).type
    if name == "torch":
        return TorchPagedAttention()
    if name == "cpu" or (name == "auto" and kind == "cpu"):
        from services.engine.core.kernels.cpu_paged_attention import (
            CpuPagedAttention,
            load_cpu_attention,
        )

        if kind != "cpu":
            raise InvalidArgumentError(f"the cpu attention backend runs on CPU, not {kind}")
        if name == "cpu" and load_cpu_attention() is None:
            raise InvalidArgumentError("the cpu attention kernel can't be built here (see the log)")
        return CpuPagedAttention()
    if name == "auto" and kind != "cuda":
        return TorchPagedAttention()
    try:
        from services.engine.core.kernels.paged_decode_attention import TritonPagedAttention
    except ImportError:
        if name == "triton":
            raise
        return TorchPagedAttention()
    return TritonPagedAttention()
