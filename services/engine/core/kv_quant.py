"""The ``q8_0`` KV cache format in PyTorch: how a K or V row is quantized as it is stored, and
widened back as attention reads it (and the CUDA ``fp8`` cache's saturating cast,
:func:`store_form`). The reference for ``cpu_paged_attention.c``, which does the same arithmetic
in C (tests/test_kv_cache_q8.py checks the two bit for bit), and for the Triton store of an
``fp8`` cache (tests/test_gpu_fp8_kv.py).

A row is one (slot, KV head)'s ``head_dim`` values, stored as ``row_bytes(head_dim)`` bytes::

    [ int8 q[0] ... q[head_dim - 1] | float16 d[0] ... d[groups - 1] ]   groups = ceil(head_dim / 32)

Group ``g`` is values ``32 g .. 32 g + 31`` (the last group shorter when ``head_dim`` is not a
multiple of 32, as in the tiny test models), llama.cpp's ``q8_0`` block with the quants and the
scales of a row split apart so that a kernel reads the row's quants as one contiguous run:

1. ``amax`` = the group's largest ``|x|``; ``d = amax / 127`` (float32); ``id = 1 / d`` (0 for an
   all-zero group);
2. ``q = round(x * id)`` to nearest, ties to even (llama.cpp's reference rounds ties away from
   zero: a tie is rare, and ties-to-even is what a vector unit does in one instruction);
3. the scale is stored as ``float16(d)`` (round to nearest even).

Read back, a value is ``float(q) * float(d16)``: exact in float32 (7 bits times 11), so the
kernels' float32 arithmetic over a ``q8_0`` cache is their arithmetic over a float32 cache that
holds these values. Non-finite K/V (a broken model) quantize to unspecified bytes.
"""

from __future__ import annotations

import torch

GROUP = 32  # values per scale, as llama.cpp's q8_0


def groups(head_dim: int) -> int:
    """Scales per row: one per 32 values, the last group possibly shorter."""
    return -(-head_dim // GROUP)


def row_bytes(head_dim: int) -> int:
    """Bytes of one stored row: ``head_dim`` int8 quants, then a float16 scale per group."""
    return head_dim + 2 * groups(head_dim)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., head_dim]`` (any float dtype; quantized from their float32 values) → stored
    rows ``[..., row_bytes(head_dim)]`` uint8."""
    head_dim = x.shape[-1]
    n = groups(head_dim)
    x = x.float()
    padded = torch.nn.functional.pad(x, (0, n * GROUP - head_dim)).unflatten(-1, (n, GROUP))
    amax = padded.abs().amax(-1, keepdim=True)
    d = amax / torch.full_like(amax, 127.0)  # true divisions (a scalar one may multiply)
    inverse = torch.where(d != 0, torch.ones_like(d) / d, torch.zeros_like(d))
    q = torch.round(padded * inverse).clamp_(-127, 127).to(torch.int8).flatten(-2)[..., :head_dim]
    scales = d.squeeze(-1).to(torch.float16)
    return torch.cat([q.view(torch.uint8), scales.view(torch.uint8)], dim=-1)


def dequantize(rows: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored rows ``[..., row_bytes(head_dim)]`` uint8 → values ``[..., head_dim]`` in ``dtype``
    (computed in float32: ``float(q) * float(scale)``, exact)."""
    q = rows[..., :head_dim].contiguous().view(torch.int8).float()
    scales = rows[..., head_dim:].contiguous().view(torch.float16).float()
    per_value = scales.repeat_interleave(GROUP, dim=-1)[..., :head_dim]
    return (q * per_value).to(dtype)


FP8_MAX = 448.0
"""The largest float8 e4m3 value: K/V are clamped to +-FP8_MAX before the cast, which saturates
as the GPU's conversion does (PyTorch's own cast makes an out-of-range value NaN)."""


def read_kv(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype,
            head_dim: int) -> torch.Tensor:  # fmt: skip
    """``cache[index]`` as attention reads it, in ``dtype``: a ``q8_0`` cache (uint8 rows)
    dequantized, a float cache cast (an ``fp8`` one gathered as bytes: PyTorch's indexing
    kernels do not all take float8)."""
    if cache.dtype == torch.uint8:
        return dequantize(cache[index], head_dim, dtype)
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8)[index].view(cache.dtype).to(dtype)
    return cache[index].to(dtype)


def write_kv(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
             x: torch.Tensor) -> None:  # fmt: skip
    """``cache[blocks, offsets] = x`` as the cache stores it (:func:`store_form`; an ``fp8``
    cache written as bytes, as :func:`read_kv` reads it)."""
    rows = store_form(x, cache.dtype)
    if cache.dtype == torch.float8_e4m3fn:
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache[blocks, offsets] = rows


def store_form(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` as a cache of ``cache_dtype`` stores it (uint8: ``q8_0`` rows;
    float8: saturated at +-:data:`FP8_MAX`, then rounded to nearest even)."""
    if cache_dtype == torch.uint8:
        return quantize(x)
    if cache_dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)
    return x.to(cache_dtype)


def as_stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded through a cache of ``cache_dtype`` and back, in ``x``'s dtype: what a later
    step reads for it."""
    if cache_dtype == torch.uint8:
        return dequantize(quantize(x), x.shape[-1], x.dtype)
    return store_form(x, cache_dtype).to(x.dtype)
