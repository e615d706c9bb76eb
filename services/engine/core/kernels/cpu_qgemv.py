"""Python side of the weight-only CPU matmul kernel (``cpu_qgemv.c``): tiling and calls.

A :class:`~services.engine.core.quant.quantized_weight.QuantizedWeight` (``q8_0`` or ``q4``, groups of
32 inputs; or ``bfloat16`` / ``float16`` values) is re-laid once, after loading, into the
kernel's tiles: ``[n_tiles, in / 32, block]`` bytes, one contiguous block per (tile of ``TILE``
output features, group) holding that group's float32 scales (and offsets) followed by its 8- or
4-bit values, or its 16-bit floats alone. Nothing is expanded to float32 in memory; the kernel
does that in registers. For many rows (prefill) :meth:`CpuQGemv.dequantize_t`
expands one weight into a transient float32 buffer for PyTorch's GEMM, as llama.cpp hands large
batches to BLAS; :meth:`CpuQGemv.untile` turns tiles back into the canonical form.

:func:`load_cpu_qgemv` builds the kernel once per process for the selected instruction set, or
returns ``None`` (one log line saying why); ``TANDEM_CPU_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from services.engine.core.kernels.native_build import load_kernel
from services.engine.core.quant.quantized_weight import (
    FORMAT_BF16,
    FORMAT_F16,
    FORMAT_Q4,
    FORMAT_Q8_0,
    GROUP,
    HALF_FORMATS,
    QuantizedWeight,
)

SOURCE = Path(__file__).with_name("cpu_qgemv.c")
FORMAT_CODES = {FORMAT_Q8_0: 0, FORMAT_Q4: 1, FORMAT_BF16: 2, FORMAT_F16: 3}


class CpuQGemv:
    """``y = x @ W.T + b`` for float32 ``x`` ``[rows, in]`` over a tiled quantized weight."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._qgemv = library.tandem_qgemv
        self._qgemv.restype = ctypes.c_int
        self._qgemv.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
        ]  # fmt: skip
        self.tile = int(library.tandem_qgemv_tile())
        block_bytes = library.tandem_qgemv_block_bytes
        block_bytes.restype = ctypes.c_int64
        block_bytes.argtypes = [ctypes.c_int]
        self.block_bytes = {fmt: int(block_bytes(code)) for fmt, code in FORMAT_CODES.items()}
        self._dequant_t = library.tandem_qdequant_t
        self._dequant_t.restype = ctypes.c_int
        self._dequant_t.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_int,
        ]  # fmt: skip
        self._gather = library.tandem_qgather_rows
        self._gather.restype = ctypes.c_int
        self._gather.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_void_p,
        ]  # fmt: skip
        isa = library.tandem_qgemv_isa
        isa.restype = ctypes.c_char_p
        self.isa: str = isa().decode()
        self.build = Path(str(library._name)).name  # the cached library's file name

    def tile_weight(self, weight: QuantizedWeight) -> torch.Tensor:
        """Canonical ``[out, in]`` weight → uint8 ``[ceil(out / tile), in / 32, block]`` tiles."""
        out_features, in_features = weight.shape
        tiles, tile, groups = -(-out_features // self.tile), self.tile, in_features // GROUP
        pad = tiles * tile - out_features

        def lay(t: torch.Tensor) -> torch.Tensor:  # [out, groups, k] → [tiles, groups, tile, k]
            t = t.reshape(out_features, groups, -1)
            if pad:
                t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
            return t.reshape(tiles, tile, groups, -1).permute(0, 2, 1, 3)

        def floats(t: torch.Tensor) -> torch.Tensor:  # per-group float32 → bytes [tiles, groups, 4 * tile]
            return lay(t.contiguous()).contiguous().view(torch.uint8).reshape(tiles, groups, -1)

        if weight.format in HALF_FORMATS:  # [T, G, 32, tile] 16-bit values, no scales
            q = lay(weight.qs.view(torch.int16)).transpose(2, 3)
            packed = q.contiguous().view(torch.uint8).reshape(tiles, groups, -1)
            self._check_block(packed, weight.format)
            return packed
        assert weight.scales is not None
        parts = [floats(weight.scales)]
        if weight.format == FORMAT_Q4:
            assert weight.mins is not None
            parts.append(floats(weight.mins))
            values = torch.stack([weight.qs & 0x0F, weight.qs >> 4], dim=-1)  # [out, in/2, 2]
            q = lay(values.reshape(out_features, in_features)).transpose(2, 3)  # [T, G, 32, tile]
            half = tile // 2
            parts.append((q[..., :half] | (q[..., half:] << 4)).reshape(tiles, groups, -1))
        else:
            q = lay(weight.qs).transpose(2, 3)  # [T, G, 32, tile] int8
            parts.append(q.contiguous().view(torch.uint8).reshape(tiles, groups, -1))
        packed = torch.cat(parts, dim=-1).contiguous()
        self._check_block(packed, weight.format)
        return packed

    def _check_block(self, packed: torch.Tensor, fmt: str) -> None:
        if packed.shape[-1] != self.block_bytes[fmt]:  # pragma: no cover - layout bug
            raise RuntimeError(f"tiled block is {packed.shape[-1]} bytes, kernel expects "
                               f"{self.block_bytes[fmt]}")

    def untile(self, packed: torch.Tensor, fmt: str, out_features: int) -> QuantizedWeight:
        """The inverse of :meth:`tile_weight` (padding rows dropped)."""
        tiles, groups, _ = packed.shape
        tile = self.tile

        def unlay(t: torch.Tensor) -> torch.Tensor:  # [tiles, groups, tile, k] → [out, groups * k]
            rows = t.permute(0, 2, 1, 3).reshape(tiles * tile, -1)
            return rows[:out_features].contiguous()

        def floats(start: int) -> torch.Tensor:
            raw = packed[..., start : start + 4 * tile].contiguous().view(torch.float32)
            return unlay(raw.reshape(tiles, groups, tile, 1))

        if fmt in HALF_FORMATS:
            q = packed.contiguous().view(torch.int16).reshape(tiles, groups, GROUP, tile)
            values = unlay(q.transpose(2, 3)).view(HALF_FORMATS[fmt])
            return QuantizedWeight(fmt, values, None, None)
        scales = floats(0)
        if fmt == FORMAT_Q4:
            mins = floats(4 * tile)
            q = packed[..., 8 * tile :].reshape(tiles, groups, GROUP, tile // 2)
            q = torch.cat([q & 0x0F, q >> 4], dim=-1).transpose(2, 3)  # [T, G, tile, 32]
            values = unlay(q).reshape(out_features, -1, 2)  # even, odd inputs
            return QuantizedWeight(fmt, values[..., 0] | (values[..., 1] << 4), scales, mins)
        q = packed[..., 4 * tile :].contiguous().view(torch.int8)
        q = q.reshape(tiles, groups, GROUP, tile).transpose(2, 3)
        return QuantizedWeight(fmt, unlay(q), scales, None)

    def dequantize_t(self, packed: torch.Tensor, fmt: str, out_features: int) -> torch.Tensor:
        """The float32 weight transposed, ``[in, out]``, dequantized by the C kernel (a transient
        buffer for one ``torch.mm`` over many rows; never kept)."""
        tiles, groups, block = packed.shape
        if block != self.block_bytes.get(fmt) or tiles * self.tile < out_features:
            raise ValueError(f"{fmt} tiles {tuple(packed.shape)} do not hold {out_features} outputs")
        in_features = groups * GROUP
        wt = torch.empty(in_features, out_features, dtype=torch.float32)
        self._dequant_t(
            FORMAT_CODES[fmt], packed.data_ptr(), in_features, out_features, wt.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return wt

    def gather_rows(
        self, packed: torch.Tensor, fmt: str, index: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        """Dequantized rows ``index`` of a tiled weight, ``[*index.shape, in]``: an embedding
        lookup on a tied head's tiles (only those rows are expanded, by the C kernel; the same
        values as :meth:`QuantizedWeight.rows`).

        Raises:
            IndexError: an index outside ``[0, out_features)``.
        """
        tiles, groups, block = packed.shape
        if block != self.block_bytes.get(fmt) or tiles * self.tile < out_features:
            raise ValueError(f"{fmt} tiles {tuple(packed.shape)} do not hold {out_features} outputs")
        flat = index.reshape(-1).to(torch.int64).contiguous()
        rows = torch.empty(flat.numel(), groups * GROUP, dtype=torch.float32)
        status = self._gather(
            FORMAT_CODES[fmt], packed.data_ptr(), groups * GROUP, out_features, flat.data_ptr(),
            flat.numel(), rows.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise IndexError(f"a token id outside [0, {out_features}) in an embedding lookup")
        return rows.reshape(*index.shape, groups * GROUP)

    def tile_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """The bias padded to a whole number of tiles (the kernel loads whole tiles)."""
        pad = -bias.numel() % self.tile
        return torch.cat([bias, bias.new_zeros(pad)]) if pad else bias.contiguous()

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        fmt: str,
        bias: torch.Tensor | None,
        out_features: int,
    ) -> torch.Tensor:
        """``x`` ``[rows, in]`` float32 with unit column stride; returns ``[rows, out_features]``."""
        return self.bind(packed, fmt, bias, out_features)(x)

    def bind(
        self, packed: torch.Tensor, fmt: str, bias: torch.Tensor | None, out_features: int
    ) -> QGemvCall:
        """One layer's call, its weight checked once (a decode step makes ~120 of them)."""
        tiles, groups, block = packed.shape
        if block != self.block_bytes.get(fmt) or tiles * self.tile < out_features:
            raise ValueError(f"a {fmt} weight of {out_features} outputs does not fit tiles {tuple(packed.shape)}")
        return QGemvCall(self._qgemv, FORMAT_CODES[fmt], packed, bias, groups * GROUP, out_features)


class QGemvCall:
    """``y = x @ W.T + b`` for one tiled weight: the kernel call with its weight's arguments
    prepared; per call only the input is checked."""

    __slots__ = ("_fn", "_format", "_packed", "_bias", "_weight_ptr", "_bias_ptr", "in_features",
                 "out_features")  # fmt: skip

    def __init__(
        self,
        fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
        format_code: int,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        in_features: int,
        out_features: int,
    ) -> None:
        self._fn, self._format = fn, format_code
        self._packed, self._bias = packed, bias  # kept alive: the call holds their pointers
        self._weight_ptr = packed.data_ptr()
        self._bias_ptr = None if bias is None else bias.data_ptr()
        self.in_features, self.out_features = in_features, out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = matmul_input(x, self.in_features, "the CPU quantized matmul kernel")
        rows, in_features = x.shape
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        status = self._fn(
            self._format, x.data_ptr(), x.stride(0), self._weight_ptr, self._bias_ptr,
            y.data_ptr(), rows, in_features, self.out_features, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("the CPU quantized matmul kernel could not allocate its buffers")
        return y


def matmul_input(x: torch.Tensor, in_features: int, kernel: str) -> torch.Tensor:
    """``x`` checked as float32 ``[rows, in_features]``, with unit column stride (copied if not).

    Raises:
        TypeError: not float32, or not 2-D.
        ValueError: the wrong number of inputs.
    """
    if x.dtype != torch.float32 or x.dim() != 2:
        raise TypeError(f"{kernel} takes float32 [rows, in] inputs, not {x.dtype} {tuple(x.shape)}")
    if x.shape[1] != in_features:
        raise ValueError(f"input {list(x.shape)} does not fit a weight of {in_features} inputs")
    return x if x.stride(1) == 1 else x.contiguous()


@functools.cache
def load_cpu_qgemv() -> CpuQGemv | None:
    """The kernel, built for this machine, or ``None`` when it is off or can't be built here."""
    return load_kernel(SOURCE, CpuQGemv, "CPU quantized matmul kernel")
