"""GGUF block layouts unpacked into the canonical tensors of
:class:`~services.engine.core.quant.quantized_weight.QuantizedWeight` (numpy only).

Each GGML type spreads the same few things over its own block: 4-bit low parts whose element
``j`` and ``j + w`` share a byte, a fifth bit or a high pair kept apart (as a 32-bit mask or a
byte per 4 elements), float16 scales, and for the K types 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K)
sub-block scales under a float16 super-block scale. :func:`unpack_blocks` turns them into
row-major canonical tensors without changing a value:

* ``qs``: the low 4 bits, element ``i`` of a row in byte ``i // 2`` (low nibble when even);
* ``qh``: the fifth bit (``q5``, ``q5_k``: bit ``i % 8`` of byte ``i // 8``) or bits 4-5
  (``q6_k``: bits ``2 (i % 4)`` of byte ``i // 4``);
* ``scales`` / ``mins``: float32 per group of 32 (``q8_0``, ``q4``, ``q5``), or the K types'
  integer sub-block scales (``q4_k``, ``q5_k``: 6-bit scale and min per 32, as uint8; ``q6_k``:
  int8 scale per 16), with ``d`` (and ``dmin``) the float16 super-block scales per 256.

Vectorised over whole tensors (no Python loop over blocks), with byte-sized temporaries only.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

# GGML type -> the canonical format it becomes
CANONICAL_FORMATS: dict[GGMLQuantizationType, str] = {
    T.Q8_0: "q8_0",
    T.Q4_0: "q4",
    T.Q4_1: "q4",
    T.Q5_0: "q5",
    T.Q5_1: "q5",
    T.Q4_K: "q4_k",
    T.Q5_K: "q5_k",
    T.Q6_K: "q6_k",
}

_U8 = np.uint8


def unpack_blocks(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, int]
) -> tuple[str, dict[str, np.ndarray]] | None:
    """The canonical format and tensors (each ``[out, ...]``) of a GGUF tensor's block bytes, or
    None when ``ggml_type`` has no canonical form here.

    Raises:
        ValueError: ``in`` is not a multiple of the block size, or ``raw`` has the wrong size.
    """
    if ggml_type not in CANONICAL_FORMATS:
        return None
    ggml_type = GGMLQuantizationType(ggml_type)
    out, n_in = (int(d) for d in shape)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if n_in % block_size != 0:
        raise ValueError(
            f"{ggml_type.name} rows need a multiple of {block_size} inputs, got {n_in}"
        )
    n_blocks = out * (n_in // block_size)
    data = np.asarray(raw).view(_U8).reshape(-1)
    if data.size != n_blocks * type_size:
        raise ValueError(
            f"{ggml_type.name} [{out}, {n_in}] needs {n_blocks * type_size} bytes, got {data.size}"
        )
    blocks = data.reshape(n_blocks, type_size)
    fields = _UNPACK[ggml_type](blocks)
    return CANONICAL_FORMATS[ggml_type], {k: v.reshape(out, -1) for k, v in fields.items()}


def _q8_0(blocks: np.ndarray) -> dict[str, np.ndarray]:
    return {"qs": np.ascontiguousarray(blocks[:, 2:]).view(np.int8), "scales": _f16(blocks[:, 0:2])}


def _q4_0(blocks: np.ndarray) -> dict[str, np.ndarray]:
    d = _f16(blocks[:, 0:2])
    # (q - 8) * d == q * d + (-8 * d), exactly
    return {"qs": _repack_nibbles(blocks[:, 2:]), "scales": d, "mins": d * np.float32(-8.0)}


def _q4_1(blocks: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "qs": _repack_nibbles(blocks[:, 4:]), "scales": _f16(blocks[:, 0:2]),
        "mins": _f16(blocks[:, 2:4]),
    }  # fmt: skip


def _q5_0(blocks: np.ndarray) -> dict[str, np.ndarray]:
    d = _f16(blocks[:, 0:2])
    # the 32 fifth bits are a little-endian uint32, bit i for element i: already qh's order
    return {
        "qs": _repack_nibbles(blocks[:, 6:]), "qh": np.ascontiguousarray(blocks[:, 2:6]),
        "scales": d, "mins": d * np.float32(-16.0),  # (q - 16) * d, exactly
    }  # fmt: skip


def _q5_1(blocks: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "qs": _repack_nibbles(blocks[:, 8:]), "qh": np.ascontiguousarray(blocks[:, 4:8]),
        "scales": _f16(blocks[:, 0:2]), "mins": _f16(blocks[:, 2:4]),
    }  # fmt: skip


def _q4_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """8 sub-blocks of 32 per 256-element super-block: ``q * d * sc - dmin * m``."""
    sc, m = _k_scale_min(blocks[:, 4:16])
    return {
        "qs": _repack_nibbles(blocks[:, 16:].reshape(-1, 32)), "scales": sc, "mins": m,
        "d": _f16_raw(blocks[:, 0:2]), "dmin": _f16_raw(blocks[:, 2:4]),
    }  # fmt: skip


def _q5_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q4_K's scales and low parts, and element ``32 s + l``'s fifth bit in bit ``s`` of
    ``qh[l]``."""
    sc, m = _k_scale_min(blocks[:, 4:16])
    bits = (blocks[:, None, 16:48] >> np.arange(8, dtype=_U8)[None, :, None]) & _U8(1)
    return {
        "qs": _repack_nibbles(blocks[:, 48:].reshape(-1, 32)),
        "qh": np.packbits(bits, axis=-1, bitorder="little"),  # [n, 8, 4]: 32 elements each
        "scales": sc, "mins": m, "d": _f16_raw(blocks[:, 0:2]), "dmin": _f16_raw(blocks[:, 2:4]),
    }  # fmt: skip


def _q6_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """16 sub-blocks of 16 per super-block: ``(q - 32) * d * sc``. Per half (128 elements) the
    low parts are 64 bytes (element ``b`` low nibble, ``64 + b`` high) and bits 4-5 of element
    ``32 k + l`` are bits ``2k`` of ``qh[l]``."""
    n = blocks.shape[0]
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=_U8)[:, None]
    pairs = (qh & _U8(3)).reshape(n, 64, 4)  # element order, 4 per output byte
    packed = pairs[..., 0] | (pairs[..., 1] << 2) | (pairs[..., 2] << 4) | (pairs[..., 3] << 6)
    return {
        "qs": _repack_nibbles(blocks[:, :128].reshape(-1, 64)), "qh": packed,
        "scales": np.ascontiguousarray(blocks[:, 192:208]).view(np.int8),
        "d": _f16_raw(blocks[:, 208:210]),
    }  # fmt: skip


_UNPACK = {
    T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q4_K: _q4_k,
    T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}  # fmt: skip


def _f16(pairs: np.ndarray) -> np.ndarray:
    """Little-endian float16 values from ``[n, 2]`` bytes, as float32 ``[n, 1]``."""
    return _f16_raw(pairs).astype(np.float32)


def _f16_raw(pairs: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(pairs).view(np.float16)


def _repack_nibbles(packed: np.ndarray) -> np.ndarray:
    """GGUF nibble order to the canonical one, chunk by chunk.

    Each row of ``packed`` (``[n, w]`` bytes) holds ``2 * w`` values: value ``j`` is the low
    nibble of byte ``j`` and value ``j + w`` the high nibble. The result has the same shape
    with value ``k`` in byte ``k // 2`` (low nibble if ``k`` is even): its first half pairs up
    the low nibbles of neighbouring bytes, its second half their high nibbles.
    """
    even = packed[:, 0::2]
    odd = packed[:, 1::2]
    low = (even & _U8(0x0F)) | ((odd & _U8(0x0F)) << _U8(4))
    high = (even >> _U8(4)) | (odd & _U8(0xF0))
    return np.concatenate([low, high], axis=1)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of each Q4_K / Q5_K super-block (llama.cpp
    ``get_scale_min_k4``).

    For sub-block ``j < 4``: ``sc = s[j] & 63``, ``m = s[j + 4] & 63``; for ``j >= 4``:
    ``sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4``, ``m = (s[j + 4] >> 4) | (s[j] >> 6) << 4``.
    """
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    six, four, low6 = _U8(6), _U8(4), _U8(63)
    sc_high = (hi & _U8(15)) | ((lo >> six) << four)
    m_high = (hi >> four) | ((mid >> six) << four)
    sc = np.concatenate([lo & low6, sc_high], axis=1)
    m = np.concatenate([mid & low6, m_high], axis=1)
    return sc, m
