"""Python side of the float32 CPU GEMV kernel (``cpu_gemv.c``): weight tiling and calls.

Batch-1 CPU decode is weight streaming: every token reads all float32 weights once. PyTorch's
BLAS GEMV reads these skinny products well below the socket's bandwidth; the C kernel reads a
tiled copy of each weight front to back. Rows come in register blocks that share each load of the
weight, so it also serves batched decode and prefill (docs/benchmarks.md has the tables per
instruction set). :func:`load_cpu_gemv` builds it once per process for the selected instruction
set (``TANDEM_CPU_ISA``, see native_build.py) or returns ``None`` (with one log line saying why)
so callers keep the PyTorch path. ``TANDEM_CPU_KERNELS=0`` turns it off. Whether it is used for
a given row count is decided by measurement (:mod:`services.engine.core.kernels.autotune`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from services.engine.core.kernels.native_build import load_kernel

SOURCE = Path(__file__).with_name("cpu_gemv.c")


class CpuGemv:
    """``y = x @ W.T + b`` for float32 ``x`` ``[rows, in]`` over a tiled weight."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._gemv = library.tandem_gemv
        self._gemv.restype = None
        self._gemv.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
        ]  # fmt: skip
        self.tile = int(library.tandem_gemv_tile())
        isa = library.tandem_gemv_isa
        isa.restype = ctypes.c_char_p
        self.isa: str = isa().decode()
        self.build = Path(str(library._name)).name  # the cached library's file name

    def tile_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``[out, in]`` → ``[ceil(out / tile), in, tile]``, the last tile padded with zeros."""
        out_features, in_features = weight.shape
        tiles = -(-out_features // self.tile)
        pad = tiles * self.tile - out_features
        if pad:
            weight = torch.cat([weight, weight.new_zeros(pad, in_features)])
        return weight.reshape(tiles, self.tile, in_features).transpose(1, 2).contiguous()

    def tile_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """The bias padded to a whole number of tiles (the kernel loads whole tiles)."""
        pad = -bias.numel() % self.tile
        return torch.cat([bias, bias.new_zeros(pad)]) if pad else bias.contiguous()

    def __call__(
        self, x: torch.Tensor, tiled: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        """``x`` ``[rows, in]`` float32 with unit column stride; returns ``[rows, out_features]``."""
        if x.dtype != torch.float32:
            raise TypeError(f"the CPU GEMV kernel takes float32 inputs, not {x.dtype}")
        rows, in_features = x.shape
        tiles, tiled_in, tile = tiled.shape
        if tiled_in != in_features or tile != self.tile or tiles * tile < out_features:
            raise ValueError(f"input [{rows}, {in_features}] does not fit weight tiles {tuple(tiled.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty(rows, out_features, dtype=torch.float32, device=x.device)
        self._gemv(
            x.data_ptr(), x.stride(0), tiled.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(),
            rows, in_features, out_features, torch.get_num_threads(),
        )  # fmt: skip
        return y


@functools.cache
def load_cpu_gemv() -> CpuGemv | None:
    """The kernel, built for this machine, or ``None`` when it is off or can't be built here."""
    return load_kernel(SOURCE, CpuGemv, "CPU float32 matmul kernel")
