"""Python side of the weight-only CPU matmul kernel (``cpu_qgemv.c``): tiling and calls.

A :class:`~services.engine.core.quant.quantized_weight.QuantizedWeight` (``q8_0``, ``q4``, ``q5``,
``q4_k``, ``q5_k``, ``q6_k``; or ``bfloat16`` / ``float16`` values) is re-laid once, after
loading, into the kernel's tiles: ``[n_tiles, in / span, block]`` bytes, one contiguous block per
(tile of ``TILE`` output features, ``span`` inputs: 32, or a 256-input super-block for the K
formats) holding that block's scales (and offsets) followed by its values' bits, or its 16-bit
floats alone (``cpu_qgemv.c`` draws each layout). Nothing is expanded to float32 in memory; the
kernel does that in registers. For many rows (prefill) :meth:`CpuQGemv.dequantize_t`
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

from services.engine.core.kernels import prefetch_tuning
from services.engine.core.kernels.native_build import load_kernel
from services.engine.core.kernels.tile_formats import FORMAT_CODES, TILE_Q5_0
from services.engine.core.quant.quantized_weight import (
    FORMAT_Q4,
    FORMAT_Q4_K,
    FORMAT_Q5,
    FORMAT_Q5_K,
    FORMAT_Q6_K,
    FORMAT_Q8_0,
    HALF_FORMATS,
    LAYOUTS,
    QuantizedWeight,
)

SOURCE = Path(__file__).with_name("cpu_qgemv.c")
_F32, _F16, _I32 = torch.float32, torch.float16, torch.int32
_NIBBLES = "nibbles"  # the values' low 4 bits, two columns a byte
_K_SCALES = "k_scales"  # a K super-block's 8 six-bit scales and mins in 12 bytes, as in the file
# Per format, a block's parts in order (cpu_qgemv.c's layouts): the canonical tensor each comes
# from, its dtype in the tiles and the inputs one of its entries covers; per part a block holds
# [span / that][TILE] entries. "qh" is read as 32-bit words (a group's fifth bits, or 16 inputs'
# bits 4-5), the nibbles [span][TILE / 2] bytes, column c low and c + TILE / 2 high, in step
# order (to_steps: 4 inputs of a column byte side by side); the K
# scales [12][TILE] bytes per super-block, made from the canonical scales and mins.
_PARTS: dict[str, list[tuple[str, torch.dtype, int]]] = {
    FORMAT_Q8_0: [("scales", _F32, 32), ("qs", torch.int8, 1)],
    FORMAT_Q4: [("scales", _F16, 32), ("mins", _F16, 32), (_NIBBLES, torch.uint8, 1)],
    FORMAT_Q5: [("scales", _F16, 32), ("mins", _F16, 32), ("qh", _I32, 32),
                (_NIBBLES, torch.uint8, 1)],
    TILE_Q5_0: [("scales", _F16, 32), ("qh", _I32, 32), (_NIBBLES, torch.uint8, 1)],
    FORMAT_Q6_K: [("d", _F16, 256), ("scales", torch.int8, 16), ("qh", _I32, 16),
                  (_NIBBLES, torch.uint8, 1)],
    FORMAT_Q4_K: [("d", _F16, 256), ("dmin", _F16, 256), (_K_SCALES, torch.uint8, 256),
                  (_NIBBLES, torch.uint8, 1)],
    FORMAT_Q5_K: [("d", _F16, 256), ("dmin", _F16, 256), (_K_SCALES, torch.uint8, 256),
                  ("qh", _I32, 32), (_NIBBLES, torch.uint8, 1)],
    **{fmt: [("qs", torch.int16, 1)] for fmt in HALF_FORMATS},
}  # fmt: skip


class CpuQGemv:
    """``y = x @ W.T + b`` for float32 ``x`` ``[rows, in]`` over a tiled quantized weight."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
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
        block_inputs = library.tandem_qgemv_block_inputs
        block_inputs.restype = ctypes.c_int64
        block_inputs.argtypes = [ctypes.c_int]
        self.block_inputs = {fmt: int(block_inputs(code)) for fmt, code in FORMAT_CODES.items()}
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

    @staticmethod
    def tile_format(weight: QuantizedWeight) -> str:
        """The tile format :meth:`tile_weight` lays ``weight`` out in (the kernels' ``fmt``): its
        own format, or ``q5_0`` for a q5 weight whose every offset is -16 times its scale."""
        if weight.format == FORMAT_Q5 and weight.mins is not None and weight.scales is not None:
            if torch.equal(weight.mins, weight.scales * -16.0):
                return TILE_Q5_0
        return weight.format

    def tile_weight(self, weight: QuantizedWeight, fmt: str | None = None) -> torch.Tensor:
        """Canonical ``[out, in]`` weight → uint8 ``[ceil(out / tile), in / span, block]`` tiles,
        in ``fmt``, :meth:`tile_format`'s choice (the default: asked here).

        Raises:
            ValueError: ``in`` is not a multiple of the format's block inputs, or a q4 / q5
                scale or offset is not a float16 value.
        """
        fmt, (out_features, in_features) = fmt or self.tile_format(weight), weight.shape
        span = self.block_inputs[fmt]
        if in_features % span:
            raise ValueError(f"{fmt} tiles need a multiple of {span} inputs, got {in_features}")
        tiles, blocks = -(-out_features // self.tile), in_features // span
        packed = []
        for name, dtype, _ in _PARTS[fmt]:
            if name == _NIBBLES:
                qs = weight.qs
                low = torch.stack([qs & 0x0F, qs >> 4], dim=-1).reshape(out_features, in_features)
                q = self._columns(low, blocks)  # [T, B, span, tile]
                half = self.tile // 2
                rows = q[..., :half] | (q[..., half:] << 4)  # [T, B, span, half]
                packed.append(to_steps(rows, fmt).reshape(tiles, blocks, -1))
                continue
            if name == _K_SCALES:
                assert weight.scales is not None and weight.mins is not None
                source = pack_k_scales(weight.scales, weight.mins)
            else:
                source = _stored(getattr(weight, name), dtype, fmt, name)
            part = self._columns(source, blocks).contiguous().view(torch.uint8)
            packed.append(part.reshape(tiles, blocks, -1))
        tiled = torch.cat(packed, dim=-1).contiguous()
        if tiled.shape[-1] != self.block_bytes[fmt]:  # pragma: no cover - layout bug
            raise RuntimeError(f"tiled block is {tiled.shape[-1]} bytes, kernel expects "
                               f"{self.block_bytes[fmt]}")  # fmt: skip
        return tiled

    def _columns(self, t: torch.Tensor, blocks: int) -> torch.Tensor:
        """``[out, blocks * k]`` → ``[tiles, blocks, k, tile]`` (rows padded to whole tiles)."""
        out_features = t.shape[0]
        tiles = -(-out_features // self.tile)
        t = t.reshape(out_features, blocks, -1)
        pad = tiles * self.tile - out_features
        if pad:
            t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
        return t.reshape(tiles, self.tile, blocks, -1).permute(0, 2, 3, 1)

    def untile(self, packed: torch.Tensor, fmt: str, out_features: int) -> QuantizedWeight:
        """The inverse of :meth:`tile_weight` (padding rows dropped; ``q5_0`` tiles give the q5
        weight, its offsets -16 times its scales)."""
        tiles, blocks, _ = packed.shape
        tile, span = self.tile, self.block_inputs[fmt]

        def unlay(t: torch.Tensor) -> torch.Tensor:  # [tiles, blocks, k, tile] → [out, blocks * k]
            rows = t.permute(0, 3, 1, 2).reshape(tiles * tile, -1)
            return rows[:out_features].contiguous()

        tensors: dict[str, torch.Tensor] = {}
        start = 0
        for name, dtype, per in _PARTS[fmt]:
            if name == _NIBBLES:
                steps = packed[..., start : start + span * tile // 2]
                q = from_steps(steps.reshape(tiles, blocks, span, -1), fmt)
                values = unlay(torch.cat([q & 0x0F, q >> 4], dim=-1)).reshape(out_features, -1, 2)
                tensors["qs"] = values[..., 0] | (values[..., 1] << 4)
                start += span * tile // 2
                continue
            if name == _K_SCALES:
                raw = packed[..., start : start + 12 * tile].reshape(tiles, blocks, 12, tile)
                tensors["scales"], tensors["mins"] = unpack_k_scales(unlay(raw))
                start += 12 * tile
                continue
            size = span // per * tile * dtype.itemsize
            raw = packed[..., start : start + size].contiguous().view(dtype)
            canonical = LAYOUTS[FORMAT_Q5 if fmt == TILE_Q5_0 else fmt][name][0]
            stored = unlay(raw.reshape(tiles, blocks, span // per, tile))
            tensors[name] = (
                stored.to(canonical) if stored.is_floating_point() and canonical.is_floating_point
                else stored.view(canonical)
            )
            start += size
        if fmt == TILE_Q5_0:
            fmt, tensors["mins"] = FORMAT_Q5, tensors["scales"] * -16.0
        return QuantizedWeight(fmt, **tensors, **{  # type: ignore[arg-type]
            name: None for name in ("scales", "mins", "qh", "d", "dmin") if name not in tensors
        })  # fmt: skip

    def dequantize_t(self, packed: torch.Tensor, fmt: str, out_features: int) -> torch.Tensor:
        """The float32 weight transposed, ``[in, out]``, dequantized by the C kernel (a transient
        buffer for one ``torch.mm`` over many rows; never kept)."""
        tiles, groups, block = packed.shape
        if block != self.block_bytes.get(fmt) or tiles * self.tile < out_features:
            raise ValueError(f"{fmt} tiles {tuple(packed.shape)} do not hold {out_features} outputs")
        in_features = groups * self.block_inputs[fmt]
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
        in_features = groups * self.block_inputs[fmt]
        rows = torch.empty(flat.numel(), in_features, dtype=torch.float32)
        status = self._gather(
            FORMAT_CODES[fmt], packed.data_ptr(), in_features, out_features, flat.data_ptr(),
            flat.numel(), rows.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise IndexError(f"a token id outside [0, {out_features}) in an embedding lookup")
        return rows.reshape(*index.shape, in_features)

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
        in_features = groups * self.block_inputs[fmt]
        return QGemvCall(self._qgemv, FORMAT_CODES[fmt], packed, bias, in_features, out_features)


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


def _stored(source: torch.Tensor, dtype: torch.dtype, fmt: str, name: str) -> torch.Tensor:
    """A canonical part as the tiles hold it: the same bits viewed as ``dtype``, or (q4 and q5's
    float32 scales and offsets) rounded to float16, which must keep every value: GGUF's Q4_0 /
    Q4_1 / Q5_0 / Q5_1 store them as float16 (Q4_0 and Q5_0's offsets -8 d and -16 d are exact).

    Raises:
        ValueError: a value float16 does not hold exactly.
    """
    source = source.contiguous()
    if source.dtype == dtype or not (source.is_floating_point() and dtype.is_floating_point):
        return source.view(dtype)
    narrow = source.to(dtype)
    if not torch.equal(narrow.to(source.dtype), source):
        raise ValueError(f"{fmt} {name} must be float16 values (as GGUF stores them) for the CPU tiles")
    return narrow


# Inputs per step group of the nibble formats' step order, and whether a step's 4 inputs are
# strided through the group (cpu_qgemv.c's "step order"): q4 and q4_k 4k..4k+3 of 32; q5 and q5_k
# k, k+8, k+16, k+24 of 32; q6_k k, k+4, k+8, k+12 of 16 (their high bits' words hold a group's
# bits input by input, so a strided step's bits are one shift away).
_STEP_GROUPS: dict[str, tuple[int, bool]] = {
    FORMAT_Q4: (32, False), FORMAT_Q4_K: (32, False), FORMAT_Q5: (32, True),
    FORMAT_Q5_K: (32, True), FORMAT_Q6_K: (16, True), TILE_Q5_0: (32, True),
}  # fmt: skip


def to_steps(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """Nibble rows ``[..., span, half]`` (input, column byte) → the step order
    ``[..., span / 4, half, 4]``: per group of inputs and step k, column byte c's 4 inputs side by
    side (one 32-bit word per column), the order ``vpmaddubsw`` multiplies them in."""
    sub, strided = _STEP_GROUPS[fmt]
    *lead, span, half = rows.shape
    g = rows.reshape(*lead, span // sub, sub, half)
    if strided:  # input k + (sub / 4) i at step k, place i
        steps = g.reshape(*lead, span // sub, 4, sub // 4, half).permute(
            *range(len(lead)), -4, -2, -1, -3)
    else:  # input 4k + i
        steps = g.reshape(*lead, span // sub, sub // 4, 4, half).transpose(-1, -2)
    return steps.reshape(*lead, span // 4, half, 4).contiguous()


def from_steps(steps: torch.Tensor, fmt: str) -> torch.Tensor:
    """The inverse of :func:`to_steps`: ``[..., span, half]`` bytes in step order (the same
    number of bytes, read as ``[span / 4, half, 4]``) → nibble rows ``[..., span, half]``."""
    sub, strided = _STEP_GROUPS[fmt]
    *lead, span, half = steps.shape
    g = steps.reshape(*lead, span // sub, sub // 4, half, 4)
    if strided:  # [k][c][i] → [i][k][c]
        rows = g.permute(*range(len(lead)), -4, -1, -3, -2)
    else:  # [k][c][i] → [k][i][c]
        rows = g.transpose(-1, -2)
    return rows.reshape(*lead, span, half).contiguous()


def pack_k_scales(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Six-bit scales and mins (uint8 ``[out, 8 n]``) packed 12 bytes per 8 (``[out, 12 n]``), as
    Q4_K / Q5_K store them: bytes 0-3 ``sc[j] | (sc[j + 4] >> 4) << 6``, 4-7 ``m[j] | (m[j + 4] >>
    4) << 6``, 8-11 ``(sc[j + 4] & 15) | (m[j + 4] & 15) << 4`` (``j < 4``)."""
    sc, m = scales.reshape(scales.shape[0], -1, 8), mins.reshape(mins.shape[0], -1, 8)
    packed = torch.cat([
        (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
        (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
        (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4),
    ], dim=-1)  # fmt: skip
    return packed.reshape(scales.shape[0], -1)


def unpack_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_k_scales` (llama.cpp's ``get_scale_min_k4``)."""
    p = packed.reshape(packed.shape[0], -1, 12)
    lo, mid, hi = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=-1)
    m = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc.reshape(packed.shape[0], -1), m.reshape(packed.shape[0], -1)


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
    return load_kernel(
        SOURCE, lambda library: CpuQGemv(prefetch_tuning.apply(library)), "CPU quantized matmul kernel"
    )
