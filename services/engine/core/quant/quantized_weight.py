"""A compact ``[out, in]`` weight (quantized, or 16-bit floats) in one canonical, row-major form
per format, and its converters.

Formats and their tensors (every tensor ``[out, ...]``, row ``o`` for output ``o``; a value's
4-bit low part in ``qs``, element ``i`` of a row in byte ``i // 2``, the low nibble when ``i`` is
even; groups are 32 inputs unless said)::

    q8_0:  value = qs * scales[g]                   qs int8 [out, in]; scales float32 per 32
    q4:    value = qs * scales[g] + mins[g]          qs 0..15; scales, mins float32 per 32
    q5:    value = q * scales[g] + mins[g]           q = qs | qh << 4 (0..31), qh bit i % 8 of
                                                     byte i // 8; scales, mins float32 per 32
    q4_k:  value = q * (d * scales[g]) - dmin * mins[g]    q 0..15; scales, mins uint8 (6-bit)
    q5_k:  the same with q5's 5-bit q                      per 32; d, dmin float16 per 256
    q6_k:  value = (q - 32) * (d * scales[g])        q = qs | qh << 4 (0..63), qh bits 2 (i % 4)
                                                     of byte i // 4; scales int8 per 16;
                                                     d float16 per 256

The 16-bit float formats hold the values themselves: ``"bfloat16"`` / ``"float16"``: ``qs`` is a
``torch.bfloat16`` / ``torch.float16`` ``[out, in]`` tensor and nothing else. On CPU they are
weight-only formats: half the bytes of float32 per decode step, float32 arithmetic (the kernel
widens each value in registers, exactly), so they ride the same tiles, kernel and autotune as the
quantized ones.

Why these forms: GGUF spreads the same information over many block layouts (Q4_0 and Q4_1 put
element ``j`` and ``j + 16`` of a block in one byte; Q5 keeps the fifth bits as a 32-bit mask;
the K types pack sub-block scales under float16 super-block scales). Converting them once at load
time (:mod:`~services.engine.core.quant.gguf_blocks`) leaves the matmul kernels (which re-tile
these forms for themselves) and the plain torch reference a few regular layouts. The K formats
keep their integer sub-block scales and float16 super-block scales, not a float32 per group, so
they hold about the file's bytes (here Q4_K is 4.625 bits a weight, its 6-bit scales a byte each;
the kernel's tiles pack them back: the file's 4.5; Q6_K is 6.5625 bits, the file's, in both).
The conversion is exact: every scale and offset is a float16 value times a small
integer, which float32 holds without rounding, and so is a value times its scale, so
:meth:`QuantizedWeight.dequantize` gives bit for bit what ``gguf.quants.dequantize`` gives.

Conversion is vectorised over whole tensors (no Python loop over blocks) and touches only
byte-sized temporaries, never a float32 copy of the weight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
from gguf import GGMLQuantizationType

from services.engine.core.quant.gguf_blocks import CANONICAL_FORMATS, unpack_blocks

GROUP = 32  # inputs per quantization group (one scale and one min per group)
SUPER = 256  # inputs per K-format super-block
FORMAT_Q8_0 = "q8_0"
FORMAT_Q4 = "q4"
FORMAT_Q5 = "q5"
FORMAT_Q4_K = "q4_k"
FORMAT_Q5_K = "q5_k"
FORMAT_Q6_K = "q6_k"
FORMAT_BF16 = "bfloat16"
FORMAT_F16 = "float16"
HALF_FORMATS: dict[str, torch.dtype] = {FORMAT_BF16: torch.bfloat16, FORMAT_F16: torch.float16}

_U8, _F32, _F16 = torch.uint8, torch.float32, torch.float16
# per format: each tensor it holds, with its dtype and how many inputs one of its elements covers
# (a row of it has in_features // that elements)
LAYOUTS: dict[str, dict[str, tuple[torch.dtype, int]]] = {
    FORMAT_Q8_0: {"qs": (torch.int8, 1), "scales": (_F32, GROUP)},
    FORMAT_Q4: {"qs": (_U8, 2), "scales": (_F32, GROUP), "mins": (_F32, GROUP)},
    FORMAT_Q5: {"qs": (_U8, 2), "qh": (_U8, 8), "scales": (_F32, GROUP), "mins": (_F32, GROUP)},
    FORMAT_Q4_K: {
        "qs": (_U8, 2), "scales": (_U8, GROUP), "mins": (_U8, GROUP), "d": (_F16, SUPER),
        "dmin": (_F16, SUPER),
    },
    FORMAT_Q5_K: {
        "qs": (_U8, 2), "qh": (_U8, 8), "scales": (_U8, GROUP), "mins": (_U8, GROUP),
        "d": (_F16, SUPER), "dmin": (_F16, SUPER),
    },
    FORMAT_Q6_K: {"qs": (_U8, 2), "qh": (_U8, 4), "scales": (torch.int8, 16), "d": (_F16, SUPER)},
    **{fmt: {"qs": (dtype, 1)} for fmt, dtype in HALF_FORMATS.items()},
}  # fmt: skip
FORMATS = frozenset(LAYOUTS)
SUPPORTED_GGML_TYPES: frozenset[GGMLQuantizationType] = frozenset(CANONICAL_FORMATS)

_QUANTIZE_CHUNK = 1 << 22  # elements per slice in quantize_q8_0, to bound float32 temporaries


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """An ``[out, in]`` weight in one of :data:`FORMATS` (the module docstring gives each one's
    values); every tensor has one row per output feature.

    Attributes:
        format: a name from :data:`FORMATS`.
        qs: the values' low 4 bits (q4, q5, K formats: uint8 ``[out, in // 2]``), the values
            (q8_0: int8 ``[out, in]``; bfloat16 / float16: ``[out, in]`` of that dtype).
        scales: per group: float32 (q8_0, q4, q5), uint8 (q4_k, q5_k), int8 per 16 (q6_k).
        mins: per group: float32 (q4, q5), uint8 (q4_k, q5_k); otherwise None.
        qh: the values' high bits, uint8 (q5, q5_k: ``[out, in // 8]``; q6_k: ``[out, in // 4]``).
        d: float16 ``[out, in // 256]`` super-block scales (q4_k, q5_k, q6_k).
        dmin: float16 ``[out, in // 256]`` super-block offset scales (q4_k, q5_k).
    """

    format: str
    qs: torch.Tensor
    scales: torch.Tensor | None
    mins: torch.Tensor | None
    qh: torch.Tensor | None = None
    d: torch.Tensor | None = None
    dmin: torch.Tensor | None = None

    def __post_init__(self) -> None:
        layout = LAYOUTS.get(self.format)
        if layout is None:
            raise ValueError(f"unknown format {self.format!r}; expected one of {sorted(FORMATS)}")
        qs_dtype, per_qs = layout["qs"]
        if self.qs.dim() != 2 or self.qs.dtype != qs_dtype:
            raise ValueError(
                f"{self.format} qs must be a 2-D {qs_dtype} tensor, got {self.qs.dtype} "
                f"{list(self.qs.shape)}"
            )
        out, n_in = int(self.qs.shape[0]), int(self.qs.shape[1]) * per_qs
        for name in _TENSORS[1:]:
            tensor = getattr(self, name)
            if name not in layout:
                if tensor is not None:
                    raise ValueError(f"{self.format} weights have no {name}")
                continue
            if tensor is None:
                raise ValueError(f"{self.format} weights need {name}")
            dtype, per = layout[name]
            if n_in % per or tensor.dtype != dtype or tuple(tensor.shape) != (out, n_in // per):
                raise ValueError(
                    f"{self.format} {name} must be {dtype} [{out}, {n_in // per}] for qs "
                    f"{list(self.qs.shape)} (in_features a multiple of {per}), got "
                    f"{tensor.dtype} {list(tensor.shape)}"
                )

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)`` of the weight this stands for."""
        return int(self.qs.shape[0]), int(self.qs.shape[1]) * LAYOUTS[self.format]["qs"][1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this format holds, by field name (``qs`` first)."""
        return {name: getattr(self, name) for name in LAYOUTS[self.format]}

    def require_shape(self, shape: tuple[int, int], what: str) -> None:
        """ValueError unless this weight is ``shape`` (``[out, in]``) for ``what``."""
        if self.shape != shape:
            raise ValueError(f"quantized weight {self.shape} does not fit {what} of shape {shape}")

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight (exactly what ``gguf.quants.dequantize`` gives)."""
        return _dequantize(self)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Dequantized float32 rows ``index`` only, shaped ``[*index.shape, in]``.

        An embedding lookup on the quantized table: only the selected rows are expanded.
        """
        flat = index.reshape(-1)
        picked = _dequantize(self.map_rows(lambda t: t[flat]))
        return picked.reshape(*index.shape, self.shape[1])

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """A new weight with ``fn`` applied to every tensor it holds.

        ``fn`` must act along dim 0 only (a row permutation or selection, a device move), so the
        tensors stay aligned row for row.
        """
        return QuantizedWeight(self.format, **{k: fn(v) for k, v in self.tensors().items()},
                               **_absent(self.format))  # fmt: skip

    @property
    def block(self) -> int:
        """Inputs per block: the fewest whole inputs that every tensor of this format covers a
        whole number of elements of (32; 256 for the K formats; 1 for the 16-bit floats). A slice
        of input columns keeps the values exactly where it starts and ends on a block boundary."""
        return max(per for _, per in LAYOUTS[self.format].values())

    def columns(self, start: int, count: int) -> QuantizedWeight:
        """Input columns ``start .. start + count`` of every row (a row-parallel rank's part of a
        matrix), the blocks kept whole and bit for bit.

        Raises:
            ValueError: ``start`` or ``count`` is not a multiple of :attr:`block`, or the slice
                runs past the weight's inputs.
        """
        block, n_in = self.block, self.shape[1]
        if start % block or count % block or start < 0 or count <= 0 or start + count > n_in:
            raise ValueError(
                f"input columns {start}..{start + count} of a {self.format} weight of {n_in} "
                f"inputs do not start and end on its {block}-value blocks"
            )
        parts = {}
        for name, tensor in self.tensors().items():
            per = LAYOUTS[self.format][name][1]
            parts[name] = tensor[:, start // per : (start + count) // per].contiguous()
        return QuantizedWeight(self.format, **parts, **_absent(self.format))

    def nbytes(self) -> int:
        """Bytes held by all its tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

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
        joined = {name: torch.cat([getattr(p, name) for p in parts]) for name in first.tensors()}
        return QuantizedWeight(first.format, **joined, **_absent(first.format))


_TENSORS = tuple(f.name for f in fields(QuantizedWeight) if f.name != "format")


def _absent(fmt: str) -> dict[str, None]:
    """The tensor fields ``fmt`` does not hold, as None (the rest are keyword arguments)."""
    return {name: None for name in _TENSORS if name not in LAYOUTS[fmt]}


def to_half(weight: torch.Tensor | QuantizedWeight, fmt: str) -> QuantizedWeight:
    """A float (or quantized) ``[out, in]`` weight held as 16-bit floats, ``fmt`` ``"bfloat16"``
    or ``"float16"`` (PyTorch's round-to-nearest-even cast; exact for weights stored in it)."""
    if fmt not in HALF_FORMATS:
        raise ValueError(f"{fmt!r} is not a 16-bit float format")
    if isinstance(weight, QuantizedWeight):
        weight = weight.dequantize()
    return QuantizedWeight(fmt, weight.to(HALF_FORMATS[fmt]).contiguous(), None, None)


def _dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The values in float32, in gguf's order of operations: the scale (an exact product for the
    K formats) times the value, plus the offset; the 16-bit float formats widened."""
    if weight.format in HALF_FORMATS:
        return weight.qs.to(torch.float32)
    out = weight.qs.shape[0]
    if weight.format == FORMAT_Q8_0:
        q = weight.qs.to(torch.float32)
    else:
        q = unpack_values(weight).to(torch.float32)
    scales, mins = group_scales(weight)
    if weight.format == FORMAT_Q6_K:
        q -= 32.0  # exact: (q - 32) * (d * sc), as gguf computes it
    values = q.reshape(out, scales.shape[1], -1) * scales.unsqueeze(-1)
    if mins is not None:
        values += mins.unsqueeze(-1)
    return values.reshape(out, -1)


def unpack_values(weight: QuantizedWeight) -> torch.Tensor:
    """The integer values of a 4-, 5- or 6-bit weight, uint8 ``[out, in]`` (no scale, no offset;
    q6_k's 0..63 before its -32)."""
    out = weight.qs.shape[0]
    q = torch.stack([weight.qs & 0x0F, weight.qs >> 4], dim=-1).reshape(out, -1)
    if weight.qh is not None:
        if weight.format == FORMAT_Q6_K:
            shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
            high = (weight.qh.unsqueeze(-1) >> shifts) & 3
        else:
            high = (weight.qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        q |= high.reshape(out, -1) << 4
    return q


def group_scales(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 scale and offset per group (of 32 inputs; of 16 for q6_k) and output: the stored
    ones, or the K formats' ``d * sc`` and ``-(dmin * m)`` (exact products). q6_k's offset is
    left to the caller (its values are ``q - 32``)."""
    assert weight.scales is not None
    if weight.d is None:
        return weight.scales, weight.mins
    per = weight.scales.shape[1] // weight.d.shape[1]
    scales = weight.d.to(torch.float32).repeat_interleave(per, dim=1) * weight.scales
    if weight.dmin is None or weight.mins is None:
        return scales, None
    dmin = weight.dmin.to(torch.float32).repeat_interleave(per, dim=1)
    return scales, -(dmin * weight.mins)


def from_gguf_blocks(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, int]
) -> QuantizedWeight | None:
    """Convert a GGUF tensor's block bytes to a :class:`QuantizedWeight`.

    Args:
        raw: the block bytes (``GGUFReader`` tensor ``.data``), any shape; read, never written.
        ggml_type: the tensor's GGML type.
        shape: ``(out, in)`` in PyTorch order (GGUF lists dimensions the other way round).

    Returns:
        The canonical weight (Q8_0 -> ``"q8_0"``; Q4_0, Q4_1 -> ``"q4"``; Q5_0, Q5_1 -> ``"q5"``;
        Q4_K, Q5_K, Q6_K -> ``"q4_k"``, ``"q5_k"``, ``"q6_k"``), or None when ``ggml_type`` is
        not in :data:`SUPPORTED_GGML_TYPES`.

    Raises:
        ValueError: ``in`` is not a multiple of the block size, or ``raw`` has the wrong size.
    """
    unpacked = unpack_blocks(raw, ggml_type, shape)
    if unpacked is None:
        return None
    fmt, arrays = unpacked
    tensors = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
    return QuantizedWeight(fmt, **tensors, **_absent(fmt))  # type: ignore[arg-type]


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
