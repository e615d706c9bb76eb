"""Python side of the 4-bit-weight x 8-bit-activation CPU GEMM (``cpu_q4a8_gemm.c``).

``--dtype q4_a8`` runs prompt tokens' rows through this kernel: each row of the input is rounded
to int8 per group of 32 inputs (llama.cpp's activation scheme) and multiplied by the ``q4`` or
``q4_k`` tiles of :class:`~services.engine.core.kernels.cpu_qgemv.CpuQGemv` in integer arithmetic. It reads the
same tiles as the weight-only kernel (no second copy of the weight). Its results differ from
float32's by the activations' rounding, measured in docs/models.md; ``--dtype q4`` (float32
activations throughout) is the exact alternative.

:func:`load_cpu_q4a8_gemm` builds it once per process and instruction set (the one selected when it
is called), or returns ``None`` (one log line saying why); ``TANDEM_CPU_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from services.engine.core.kernels import prefetch_tuning
from services.engine.core.kernels.cpu_qgemv import FORMAT_CODES, TILE_Q5_0, matmul_input
from services.engine.core.kernels.native_build import load_kernel
from services.engine.core.quant.quantized_weight import (
    FORMAT_Q4,
    FORMAT_Q4_K,
    FORMAT_Q5,
    FORMAT_Q5_K,
    FORMAT_Q6_K,
    FORMAT_Q8_0,
    GROUP,
    SUPER,
)

SOURCE = Path(__file__).with_name("cpu_q4a8_gemm.c")


FORMATS = {FORMAT_Q4: GROUP, FORMAT_Q4_K: SUPER}  # the tile formats the GEMM reads: inputs per block
# the tile formats the decode-rows kernel (tandem_a8_gemv) reads: inputs per block
DECODE_FORMATS = {FORMAT_Q8_0: GROUP, FORMAT_Q4: GROUP, FORMAT_Q5: GROUP, TILE_Q5_0: GROUP,
                  FORMAT_Q4_K: SUPER, FORMAT_Q5_K: SUPER, FORMAT_Q6_K: SUPER}  # fmt: skip


class CpuQ4A8Gemm:
    """``y = x @ W.T + b`` for float32 ``x`` ``[rows, in]`` over q4 / q4_k tiles, x rounded to
    int8."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._gemm = library.tandem_q4a8_gemm
        self._gemm.restype = ctypes.c_int
        self._gemm.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
        ]  # fmt: skip
        self.tile = int(library.tandem_q4a8_tile())
        block_bytes = library.tandem_q4a8_block_bytes
        block_bytes.restype = ctypes.c_int64
        block_bytes.argtypes = [ctypes.c_int]
        self.block_bytes = {fmt: int(block_bytes(FORMAT_CODES[fmt])) for fmt in FORMATS}
        self._gemv = library.tandem_a8_gemv
        self._gemv.restype = ctypes.c_int
        self._gemv.argtypes = self._gemm.argtypes
        block_size = library.tandem_qgemv_block_bytes  # the unity build carries cpu_qgemv.c's
        block_size.restype = ctypes.c_int64
        block_size.argtypes = [ctypes.c_int]
        self.decode_block_bytes = {fmt: int(block_size(FORMAT_CODES[fmt])) for fmt in DECODE_FORMATS}
        isa = library.tandem_q4a8_isa
        isa.restype = ctypes.c_char_p
        self.isa: str = isa().decode()
        self.dpbusd = bool(library.tandem_q4a8_dpbusd())  # integer dots by vpdpbusd (VNNI)
        self.build = Path(str(library._name)).name
        self.library = library

    def bind(
        self, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
        fmt: str = FORMAT_Q4,
    ) -> Q4A8Call:
        """One layer's call over its ``fmt`` tiles (``CpuQGemv.tile_weight``'s ``[tiles, in /
        block inputs, block]``) and tiled bias.

        Raises:
            ValueError: a format it does not read, or tiles that do not fit this build.
        """
        if fmt not in FORMATS:
            raise ValueError(f"the q4 x int8 kernel reads {sorted(FORMATS)} tiles, not {fmt}")
        block = self.block_bytes[fmt]
        if (packed.dtype != torch.uint8 or packed.dim() != 3 or packed.shape[2] != block
                or packed.shape[0] * self.tile < out_features):
            raise ValueError(
                f"{fmt} tiles {tuple(packed.shape)} do not hold {out_features} outputs for the "
                f"{self.isa} build of the q4 x int8 kernel (tiles of {self.tile} outputs, "
                f"{block}-byte blocks)"
            )  # fmt: skip
        in_features = packed.shape[1] * FORMATS[fmt]
        return Q4A8Call(self._gemm, FORMAT_CODES[fmt], packed, bias, in_features, out_features)

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
        fmt: str = FORMAT_Q4,
    ) -> torch.Tensor:
        return self.bind(packed, bias, out_features, fmt)(x)

    def decode_tiles_shape(self, fmt: str, out_features: int, in_features: int) -> tuple[int, ...]:
        """The shape of the ``fmt`` tiles (:meth:`bind_decode`'s) of an ``[out, in]`` weight."""
        return (-(-out_features // self.tile), in_features // DECODE_FORMATS[fmt],
                self.decode_block_bytes[fmt])  # fmt: skip

    def bind_decode(
        self, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, fmt: str
    ) -> Q4A8Call:
        """One layer's decode-rows call (``tandem_a8_gemv``: a few rows, each rounded to int8 per
        32 inputs as the GEMM rounds them, times the tiles as stored) over ``fmt`` tiles.

        Raises:
            ValueError: a format it does not read, or tiles that do not fit this build.
        """
        if fmt not in DECODE_FORMATS:
            raise ValueError(f"the int8-activation decode kernel reads {sorted(DECODE_FORMATS)} "
                             f"tiles, not {fmt}")  # fmt: skip
        block = self.decode_block_bytes[fmt]
        if (packed.dtype != torch.uint8 or packed.dim() != 3 or packed.shape[2] != block
                or packed.shape[0] * self.tile < out_features):
            raise ValueError(
                f"{fmt} tiles {tuple(packed.shape)} do not hold {out_features} outputs for the "
                f"{self.isa} build of the int8-activation decode kernel (tiles of {self.tile} "
                f"outputs, {block}-byte blocks)"
            )  # fmt: skip
        in_features = packed.shape[1] * DECODE_FORMATS[fmt]
        return Q4A8Call(self._gemv, FORMAT_CODES[fmt], packed, bias, in_features, out_features)


class Q4A8Call:
    """``y = x @ W.T + b`` for one layer's tiles; per call only the input is checked."""

    __slots__ = ("_fn", "_format", "_packed", "_bias", "in_features", "out_features")

    def __init__(
        self,
        fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
        format_code: int,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        in_features: int,
        out_features: int,
    ) -> None:
        self._fn, self._format, self._packed, self._bias = fn, format_code, packed, bias
        self.in_features, self.out_features = in_features, out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = matmul_input(x, self.in_features, "the q4 x int8 kernel")
        rows, in_features = x.shape
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        status = self._fn(
            self._format, x.data_ptr(), x.stride(0), self._packed.data_ptr(),
            None if self._bias is None else self._bias.data_ptr(), y.data_ptr(), rows,
            in_features, self.out_features, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("the q4 x int8 kernel could not allocate its buffers")
        return y


def load_cpu_q4a8_gemm() -> CpuQ4A8Gemm | None:
    """The kernel, built for the instruction set selected now, or ``None`` when it is off or can't
    be built here.

    Cached per ``TANDEM_CPU_ISA`` / ``TANDEM_CPU_KERNELS`` setting, not once per process: it reads
    the weight-only kernel's tiles, whose width and block size are the instruction set's, and
    :func:`~services.engine.core.kernels.loaded.forget_loaded_kernels` (a benchmark's per-set rows)
    makes that kernel follow a new setting. Cached once, this one kept the first set's build:
    AVX-512 tiles of 32 outputs meeting AVX2 ones of 16 (``q4 tiles (128, 64, 384) do not hold
    2048 outputs``).
    """
    return _load(os.environ.get("TANDEM_CPU_ISA", ""), os.environ.get("TANDEM_CPU_KERNELS", ""))


def forget_loaded() -> None:
    """Drop the builds loaded so far: the next load selects the instruction set again (after
    ``tandem tune`` measured VNNI, which the environment does not show)."""
    _load.cache_clear()


@functools.cache
def _load(isa_setting: str, kernels_setting: str) -> CpuQ4A8Gemm | None:
    del isa_setting, kernels_setting  # the cache key only: load_kernel reads both itself
    return load_kernel(
        SOURCE, lambda library: CpuQ4A8Gemm(prefetch_tuning.apply(library)), "CPU q4 x int8 GEMM"
    )
