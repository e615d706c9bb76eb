"""Forgetting the native kernels a process has loaded, so the next load reads ``TANDEM_CPU_*``
again: each ``load_*`` function builds its kernel once per process (``functools.cache``), and a
benchmark or test that switches instruction sets must clear every one of them, or a row forced to
one set silently keeps another's build."""

from __future__ import annotations

from services.engine.core.kernels.cpu_decode_layers import load_cpu_decode_layers
from services.engine.core.kernels.cpu_fused import load_cpu_fused
from services.engine.core.kernels.cpu_gemv import load_cpu_gemv
from services.engine.core.kernels.cpu_paged_attention import load_cpu_attention
from services.engine.core.kernels.cpu_q4a8_gemm import forget_loaded as forget_q4a8
from services.engine.core.kernels.cpu_qgemv import load_cpu_qgemv

LOADERS = (load_cpu_gemv, load_cpu_qgemv, load_cpu_attention, load_cpu_fused, load_cpu_decode_layers)


def forget_loaded_kernels() -> None:
    """Clear every native kernel loader's cached build."""
    for loader in LOADERS:
        loader.cache_clear()
    forget_q4a8()  # cached per TANDEM_CPU_* setting; cleared too, for a measured VNNI choice
