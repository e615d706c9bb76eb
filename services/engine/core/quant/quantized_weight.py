"""A compact ``[out, in]`` weight (quantized, or 16-bit floats) in one canonical, row-major form,
and its converters.

Every quantized format is stored the same way, per group of :data:`GROUP` inputs of one row::

    value[o, i] = qs[o, i] * scales[o, i // 32] + mins[o, i // 32]      (mins absent -> 0)

* ``"q8_0"``: ``qs`` int8 ``[out, in]``, ``scales`` float32, ``mins`` None.
* ``"q4"``: ``qs`` uint8 ``[out, in // 2]`` holding 4-bit values 0..15; element ``i`` of a row
  is in byte ``i // 2``, the low nibble when ``i`` is even and the high one when it is odd;
  ``scales`` and ``mins`` float32 ``[out, in // 32]``.

The 16-bit float formats hold the values themselves: ``"bfloat16"`` / ``"float16"``: ``qs`` is a
``torch.bfloat16`` / ``torch.float16`` ``[out, in]`` tensor, ``scales`` and ``mins`` None. On CPU
they are weight-only formats: half the bytes of float32 per decode step, float32 arithmetic (the
kernel widens each value in registers, exactly), so they ride the same tiles, kernel and
autotune as the quantized ones.

Why one form: GGUF spreads the same information over several block layouts (Q4_0 and Q4_1
put element ``j`` and ``j + 16`` of a block in one byte; Q4_K packs 8 sub-blocks with 6-bit
scales into 256-element super-blocks). Converting them once at load time means a matmul kernel
(which re-tiles this form for itself) and the plain torch reference handle two formats, not
four. The conversion is exact: every canonical scale and min is a float16 value times a small
integer, which float32 holds without rounding, so :meth:`QuantizedWeight.dequantize` gives
bit for bit what ``gguf.quants.dequantize`` gives.

Conversion is vectorised over whole tensors (no Python loop over blocks) and touches only
byte-sized temporaries, never a float32 copy of the weight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GROUP = 32  # inputs per quantization group (one scale and one min per group)
FORMAT_Q8_0 = "q8_0"
FORMAT_Q4 = "q4"
FORMAT_BF16 = "bfloat16"
FORMAT_F16 = "float16"
HALF_FORMATS: dict[str, torch.dtype] = {FORMAT_BF16: torch.bfloat16, FORMAT_F16: torch.float16}
FORMATS = frozenset({FORMAT_Q8_0, FORMAT_Q4, *HALF_FORMATS})

SUPPORTED_GGML_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q4_K,
    }
)

_QUANTIZE_CHUNK = 1 << 22  # elements per slice in quantize_q8_0, to bound float32 temporaries


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """value[o, i] = qs[o, i] * scales[o, i // 32] + mins[o, i // 32]  (mins absent = 0), or
    for the 16-bit float formats value[o, i] = qs[o, i].

    Attributes:
        format: ``"q8_0"``, ``"q4"``, ``"bfloat16"`` or ``"float16"``.
        qs: q8_0: int8 ``[out, in]``; q4: uint8 ``[out, in // 2]``, element ``i`` of a row in
            byte ``i // 2``, low nibble when ``i`` is even, high nibble when odd (values 0..15);
            bfloat16 / float16: the values, ``[out, in]`` of that dtype.
        scales: float32 ``[out, in // 32]``; None for the 16-bit float formats.
        mins: q4: float32 ``[out, in // 32]``; otherwise None.
    """

    format: str
    qs: torch.Tensor
    scales: torch.Tensor | None
    mins: torch.Tensor | None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown format {self.format!r}; expected one of {sorted(FORMATS)}")
        if self.format in HALF_FORMATS:
            dtype = HALF_FORMATS[self.format]
            if self.qs.dim() != 2 or self.qs.dtype != dtype:
                raise ValueError(
                    f"{self.format} values must be a 2-D {dtype} tensor, got "
                    f"{self.qs.dtype} {list(self.qs.shape)}"
                )
            if self.scales is not None or self.mins is not None:
                raise ValueError(f"{self.format} weights have no scales or mins")
            return
        if self.scales is None:
            raise ValueError(f"{self.format} weights need scales")
        if self.qs.dim() != 2 or self.scales.dim() != 2:
            raise ValueError(
                f"qs and scales must be 2-D, got {list(self.qs.shape)}, {list(self.scales.shape)}"
            )
        if self.scales.dtype != torch.float32:
            raise ValueError(f"scales must be float32, got {self.scales.dtype}")
        out, groups = self.scales.shape
        per_row = groups * GROUP if self.format == FORMAT_Q8_0 else groups * GROUP // 2
        qs_dtype = torch.int8 if self.format == FORMAT_Q8_0 else torch.uint8
        if self.qs.dtype != qs_dtype or tuple(self.qs.shape) != (out, per_row):
            raise ValueError(
                f"{self.format} qs must be {qs_dtype} [{out}, {per_row}] for scales "
                f"[{out}, {groups}], got {self.qs.dtype} {list(self.qs.shape)}"
            )
        if self.format == FORMAT_Q8_0:
            if self.mins is not None:
                raise ValueError("q8_0 weights have no mins")
        elif (
            self.mins is None
            or self.mins.dtype != torch.float32
            or self.mins.shape != self.scales.shape
        ):
            raise ValueError(f"q4 mins must be float32 [{out}, {groups}]")

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)`` of the weight this stands for."""
        if self.scales is None:
            return int(self.qs.shape[0]), int(self.qs.shape[1])
        return int(self.scales.shape[0]), int(self.scales.shape[1]) * GROUP

    def require_shape(self, shape: tuple[int, int], what: str) -> None:
        """ValueError unless this weight is ``shape`` (``[out, in]``) for ``what``."""
        if self.shape != shape:
            raise ValueError(f"quantized weight {self.shape} does not fit {what} of shape {shape}")

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight (exactly what ``gguf.quants.dequantize`` gives)."""
        return _dequantize(self.format, self.qs, self.scales, self.mins)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Dequantized float32 rows ``index`` only, shaped ``[*index.shape, in]``.

        An embedding lookup on the quantized table: only the selected rows are expanded.
        """
        flat = index.reshape(-1)
        scales = None if self.scales is None else self.scales[flat]
        mins = None if self.mins is None else self.mins[flat]
        picked = _dequantize(self.format, self.qs[flat], scales, mins)
        return picked.reshape(*index.shape, self.shape[1])

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """A new weight with ``fn`` applied to ``qs``, ``scales`` and ``mins``.

        ``fn`` must act along dim 0 only (a row permutation or selection, a device move), so the
        three tensors stay aligned row for row.
        """
        scales = None if self.scales is None else fn(self.scales)
        mins = None if self.mins is None else fn(self.mins)
        return QuantizedWeight(self.format, fn(self.qs), scales, mins)

    def nbytes(self) -> int:
        """Bytes held by ``qs``, ``scales`` and ``mins``."""
        held = [t for t in (self.qs, self.scales, self.mins) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    @staticmethod
    def cat(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Stack weights along rows (dim 0), e.g. to fuse q/k/v or gate/up projections.

        Raises:
            ValueError: no parts, or parts whose formats or in_features differ.
        """
        if not parts:
            raise ValueError("QuantizedWeight.cat needs at least one part")
        first = parts[0]
        for part in parts[1:]:
            if part.format != first.format or part.shape[1] != first.shape[1]:
                raise ValueError(
                    f"cannot concatenate {part.format} {part.shape} onto {first.format} "
                    f"{first.shape}: formats and in_features must match"
                )
        scales = mins = None
        if first.scales is not None:
            scales = torch.cat([p.scales for p in parts if p.scales is not None])
        if first.mins is not None:
            mins = torch.cat([p.mins for p in parts if p.mins is not None])
        return QuantizedWeight(first.format, torch.cat([p.qs for p in parts]), scales, mins)


def to_half(weight: torch.Tensor | QuantizedWeight, fmt: str) -> QuantizedWeight:
    """A float (or quantized) ``[out, in]`` weight held as 16-bit floats, ``fmt`` ``"bfloat16"``
    or ``"float16"`` (PyTorch's round-to-nearest-even cast; exact for weights stored in it)."""
    if fmt not in HALF_FORMATS:
        raise ValueError(f"{fmt!r} is not a 16-bit float format")
    if isinstance(weight, QuantizedWeight):
        weight = weight.dequantize()
    return QuantizedWeight(fmt, weight.to(HALF_FORMATS[fmt]).contiguous(), None, None)


def _dequantize(
    fmt: str, qs: torch.Tensor, scales: torch.Tensor | None, mins: torch.Tensor | None
) -> torch.Tensor:
    """``q * scale + min`` in float32, broadcasting each group's scale over its 32 inputs (the
    16-bit float formats: the values widened to float32)."""
    if scales is None:
        return qs.to(torch.float32)
    out = qs.shape[0]
    if fmt == FORMAT_Q4:
        qs = torch.stack([qs & 0x0F, qs >> 4], dim=-1)  # [out, in // 2, 2]: even, odd elements
    q = qs.reshape(out, -1, GROUP).to(torch.float32)
    values = q * scales.unsqueeze(-1)
    if mins is not None:
        values += mins.unsqueeze(-1)
    return values.reshape(out, -1)


def from_gguf_blocks(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, int]
) -> QuantizedWeight | None:
    """Convert a GGUF tensor's block bytes to a :class:`QuantizedWeight`.

    Args:
        raw: the block bytes (``GGUFReader`` tensor ``.data``), any shape; read, never written.
        ggml_type: the tensor's GGML type.
        shape: ``(out, in)`` in PyTorch order (GGUF lists dimensions the other way round).

    Returns:
        The canonical weight (Q8_0 -> ``"q8_0"``; Q4_0, Q4_1, Q4_K -> ``"q4"``), or None when
        ``ggml_type`` is not in :data:`SUPPORTED_GGML_TYPES`.

    Raises:
        ValueError: ``in`` is not a multiple of the block size, or ``raw`` has the wrong size.
    """
    if ggml_type not in SUPPORTED_GGML_TYPES:
        return None
    ggml_type = GGMLQuantizationType(ggml_type)
    out, n_in = (int(d) for d in shape)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if n_in % block_size != 0:
        raise ValueError(
            f"{ggml_type.name} rows need a multiple of {block_size} inputs, got {n_in}"
        )
    n_blocks = out * (n_in // block_size)
    data = np.asarray(raw).view(np.uint8).reshape(-1)
    if data.size != n_blocks * type_size:
        raise ValueError(
            f"{ggml_type.name} [{out}, {n_in}] needs {n_blocks * type_size} bytes, got {data.size}"
        )
    blocks = data.reshape(n_blocks, type_size)
    groups = n_in // GROUP
    if ggml_type == GGMLQuantizationType.Q8_0:
        qs = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).reshape(out, n_in)
        scales_q8 = torch.from_numpy(_f16(blocks[:, 0:2]).reshape(out, groups))
        return QuantizedWeight(FORMAT_Q8_0, torch.from_numpy(qs), scales_q8, None)
    if ggml_type == GGMLQuantizationType.Q4_0:
        scales = _f16(blocks[:, 0:2])
        mins = scales * np.float32(-8.0)  # (q - 8) * d == q * d + (-8 * d), exactly
        qs = _repack_nibbles(blocks[:, 2:])
    elif ggml_type == GGMLQuantizationType.Q4_1:
        scales = _f16(blocks[:, 0:2])
        mins = _f16(blocks[:, 2:4])
        qs = _repack_nibbles(blocks[:, 4:])
    else:  # Q4_K: 8 sub-blocks of 32 per 256-element super-block
        d = _f16(blocks[:, 0:2])
        dmin = _f16(blocks[:, 2:4])
        sc, m = _q4_k_scale_min(blocks[:, 4:16])
        scales = d * sc.astype(np.float32)  # f16 (11 bits) * 6-bit integer: exact in float32
        mins = -(dmin * m.astype(np.float32))
        qs = _repack_nibbles(blocks[:, 16:].reshape(-1, 32))
    return QuantizedWeight(
        FORMAT_Q4,
        torch.from_numpy(qs.reshape(out, n_in // 2)),
        torch.from_numpy(scales.reshape(out, groups)),
        torch.from_numpy(mins.reshape(out, groups)),
    )


def _f16(pairs: np.ndarray) -> np.ndarray:
    """Little-endian float16 values from ``[n, 2]`` bytes, as float32 ``[n, 1]``."""
    return np.ascontiguousarray(pairs).view(np.float16).astype(np.float32)


def _repack_nibbles(packed: np.ndarray) -> np.ndarray:
    """GGUF nibble order to the canonical one, chunk by chunk.

    Each row of ``packed`` (``[n, w]`` bytes) holds ``2 * w`` values: value ``j`` is the low
    nibble of byte ``j`` and value ``j + w`` the high nibble. The result has the same shape
    with value ``k`` in byte ``k // 2`` (low nibble if ``k`` is even): its first half pairs up
    the low nibbles of neighbouring bytes, its second half their high nibbles.
    """
    even = packed[:, 0::2]
    odd = packed[:, 1::2]
    low = (even & np.uint8(0x0F)) | ((odd & np.uint8(0x0F)) << np.uint8(4))
    high = (even >> np.uint8(4)) | (odd & np.uint8(0xF0))
    return np.concatenate([low, high], axis=1)


def _q4_k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of each Q4_K super-block (llama.cpp ``get_scale_min_k4``).

    For sub-block ``j < 4``: ``sc = s[j] & 63``, ``m = s[j + 4] & 63``; for ``j >= 4``:
    ``sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4``, ``m = (s[j + 4] >> 4) | (s[j] >> 6) << 4``.
    """
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    six, four, low6 = np.uint8(6), np.uint8(4), np.uint8(63)
    sc_high = (hi & np.uint8(15)) | ((lo >> six) << four)
    m_high = (hi >> four) | ((mid >> six) << four)
    sc = np.concatenate([lo & low6, sc_high], axis=1)
    m = np.concatenate([mid & low6, m_high], axis=1)
    return sc, m


def quantize_q8_0(weight: torch.Tensor) -> QuantizedWeight:
    """Quantize a float ``[out, in]`` weight to q8_0 exactly as llama.cpp ``quantize_row_q8_0_ref``.

    Per group of 32: ``d = max|x| / 127``, ``q = roundf(x / d)`` (half away from zero, using
    ``x * (1 / d)`` like the reference, 0 when ``d`` is 0), and ``d`` is kept as float16, so
    the stored scale is ``float32(float16(d))``.

    Raises:
        ValueError: ``weight`` is not 2-D or ``in`` is not a multiple of 32.
    """
    if weight.dim() != 2 or weight.shape[1] % GROUP != 0:
        raise ValueError(
            f"q8_0 needs a 2-D weight with in_features a multiple of {GROUP}, "
            f"got {list(weight.shape)}"
        )
    out, n_in = weight.shape
    qs = torch.empty(out, n_in, dtype=torch.int8, device=weight.device)
    scales = torch.empty(out, n_in // GROUP, dtype=torch.float32, device=weight.device)
    step = max(1, _QUANTIZE_CHUNK // max(n_in, 1))
    for start in range(0, out, step):  # row slices bound the float32 temporaries
        x = weight[start : start + step].to(torch.float32).reshape(-1, n_in // GROUP, GROUP)
        d = x.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        qs[start : start + step] = _roundf(x * inv).to(torch.int8).reshape(-1, n_in)
        scales[start : start + step] = d.squeeze(-1).to(torch.float16).to(torch.float32)
    return QuantizedWeight(FORMAT_Q8_0, qs, scales, None)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: round half away from zero (``torch.round`` rounds half to even).

    ``floor(a + 0.5)`` would be wrong for ``a = 0.49999997`` (the sum rounds up to 1), so the
    fraction is taken exactly first.
    """
    a = x.abs()
    whole = torch.floor(a)
    return torch.sign(x) * (whole + torch.floor(2 * (a - whole)))
