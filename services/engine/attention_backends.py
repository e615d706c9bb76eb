"""Attention backends by name: ``torch`` (reference, everywhere) and ``triton`` (paged decode
kernel; GPUs, or CPU under ``TRITON_INTERPRET=1``). ``auto`` picks triton on CUDA when it
imports, else torch."""

from __future__ import annotations

import torch

from services.common.errors import InvalidArgumentError
from services.engine.attention import PagedAttention, TorchPagedAttention

BACKENDS = ("auto", "torch", "triton")


def make_attention_backend(name: str, device: torch.device | str) -> PagedAttention:
    """Build the named backend for ``device``."""
    if name not in BACKENDS:
        raise InvalidArgumentError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if name == "torch" or (name == "auto" and torch.device(device).type != "cuda"):
        return TorchPagedAttention()
    try:
        from services.engine.kernels.paged_decode_attention import TritonPagedAttention
    except ImportError:
        if name == "triton":
            raise
        return TorchPagedAttention()
    return TritonPagedAttention()
