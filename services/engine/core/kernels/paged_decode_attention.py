"""Triton kernels: batched decode attention over the paged KV cache, split over the context.

Decode attention is a memory-bound pass over every cached K and V of the batch, so the kernel is
built to stream them once at the device's bandwidth (flash-decoding, as in vLLM's paged
attention v2 and FlashDecoding):

1. **One program per (sequence, KV head, context partition).** All the query heads that share a
   KV head (grouped-query attention: ``GROUP = H / KVH``) are scored together as the rows of one
   matrix product, so each K/V row is read once per KV head, not once per query head. The
   context is cut into partitions of ``partition`` tokens so that a batch of one long sequence
   still spreads over every multiprocessor; a partition past a sequence's length exits at once.
2. Each program walks its partition ``BLOCK_N`` token slots at a time (several KV blocks; each
   slot's block id is read from the block table), keeps a running max and sum (online softmax)
   and writes its partial result: the un-normalised output, the max and the sum.
3. **A second kernel** (one program per (sequence, query head)) rescales the partitions' partial
   results to a common max and normalises: the exact softmax over the whole context.

The partition size depends only on the batch size, the KV heads and the block table's width, so
a CUDA graph captured for a batch size replays the same grid whatever the contexts' lengths.
Float32 caches use IEEE float32 products (the parity path); bfloat16 / float16 ones multiply in
their type and accumulate in float32 (under float32 queries, a 16-bit cache is widened as it is
read: ``--kv-cache-dtype``; an ``fp8`` cache is widened to the queries' type the same way).
Offsets into the pool are 64-bit: a pool of a large model passes 2**31 elements. A head size that
is not a power of two (Phi-3-mini's 96) is padded to the next one inside the kernel, the extra
lanes masked.

Sliding-window layers (``window``: the query at position p sees keys p - window < k <= p) skip the
partitions wholly before the window, and the reduce kernel starts at the first one that is not;
soft-capped layers (``softcap``, Gemma 2) turn each score s into softcap * tanh(s / softcap)
before the softmax.

Launched by :class:`TritonPagedAttention` for decode steps; prefill steps use the torch reference
(:class:`~services.engine.core.attention.TorchPagedAttention`), whose SDPA call is compute-bound
and already fused (and, for windowed or soft-capped layers, the reference of
:func:`~services.engine.core.attention._windowed_forward`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.core.attention import AttentionMetadata, TorchPagedAttention, _windowed_forward
from services.engine.core.kv_quant import FP8_MAX

BLOCK_N = 64
"""Token slots one loop iteration of the partition kernel scores."""
MIN_PARTITION = 256
"""Fewest context tokens one program covers (smaller partitions only add partial results)."""
REDUCE_CHUNK = 16
"""Partitions the reduce kernel reads per iteration."""


@triton.jit
def _partition_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, acc_ptr, max_ptr, sum_ptr,
    scale, window, softcap,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,
    num_heads, num_parts,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PARTITION: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    length = tl.load(lens_ptr + seq)
    # the first position the query sees (window 0: no window)
    seen = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    start = part * PARTITION
    if (start < length) & (start + PARTITION > seen):
        end = tl.minimum(start + PARTITION, length)
        start = tl.maximum(start, seen)
        rows = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + rows
        live = rows < GROUP
        dims = tl.arange(0, HEAD_PAD)  # a power of two; lanes past HEAD_DIM (Phi-3's 96) masked
        real = dims < HEAD_DIM
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                    mask=live[:, None] & real[None, :], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
        slots = tl.arange(0, BLOCK_N)
        for first in range(start, end, BLOCK_N):
            pos = first + slots
            valid = pos < end
            block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0)
            block = block.to(tl.int64)  # pool offsets pass 2**31 elements
            offset = pos % BLOCK_SIZE
            k = tl.load(k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks
                        + kv_head * stride_kh + dims[None, :], mask=valid[:, None] & real[None, :],
                        other=0.0)
            k = k.to(q.dtype)  # a 16-bit cache under float32 queries, or fp8: widened
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if SOFTCAP:  # softcap * tanh(scores / softcap), tanh(y) = 2 sigmoid(2y) - 1
                scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs
                        + kv_head * stride_vh + dims[None, :], mask=valid[:, None] & real[None, :],
                        other=0.0)
            v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            total = total * alpha + tl.sum(p, axis=1)
            m = m_new
        row = (seq * num_heads + heads) * num_parts + part
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=live[:, None] & real[None, :])
        tl.store(max_ptr + row, m, mask=live)
        tl.store(sum_ptr + row, total, mask=live)


@triton.jit
def _reduce_kernel(
    acc_ptr, max_ptr, sum_ptr, lens_ptr, out_ptr, window,
    stride_ob, stride_oh,
    num_heads, num_parts,
    PARTITION: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    length = tl.load(lens_ptr + seq)
    used = tl.cdiv(length, PARTITION)
    # partitions wholly before the window (they wrote nothing)
    skipped = tl.where(window > 0, tl.maximum(length - window, 0) // PARTITION, 0)
    base = (seq * num_heads + head) * num_parts
    idx = tl.arange(0, CHUNK)
    dims = tl.arange(0, HEAD_PAD)
    real = dims < HEAD_DIM
    top = tl.full([CHUNK], float("-inf"), tl.float32)
    for first in range(skipped, used, CHUNK):
        parts = first + idx
        top = tl.maximum(top, tl.load(max_ptr + base + parts, mask=parts < used,
                                      other=float("-inf")))
    best = tl.max(top, axis=0)
    total = tl.zeros([CHUNK], tl.float32)
    acc = tl.zeros([HEAD_PAD], tl.float32)
    for first in range(skipped, used, CHUNK):
        parts = first + idx
        inside = parts < used
        weight = tl.exp(tl.load(max_ptr + base + parts, mask=inside, other=float("-inf")) - best)
        weight = tl.where(inside, weight, 0.0)
        total += weight * tl.load(sum_ptr + base + parts, mask=inside, other=0.0)
        partial = tl.load(acc_ptr + (base + parts)[:, None] * HEAD_DIM + dims[None, :],
                          mask=inside[:, None] & real[None, :], other=0.0)
        acc += tl.sum(partial * weight[:, None], axis=0)
    out = acc / tl.sum(total, axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=real)


@triton.jit
def _bf16_rne(x):
    """float32 -> bfloat16, rounded to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fp8_sat(x, limit: tl.constexpr):
    """float32 / 16-bit -> float8 e4m3, saturated at +-limit, rounded to nearest even."""
    return tl.clamp(x.to(tl.float32), -limit, limit).to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, blocks_ptr, offsets_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
    HEAD_DIM: tl.constexpr, TO_BF16: tl.constexpr, TO_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    block = tl.load(blocks_ptr + token).to(tl.int64)
    offset = tl.load(offsets_ptr + token).to(tl.int64)
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dims)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dims)
    if TO_BF16:  # float32 into a bfloat16 cache, to nearest even as PyTorch rounds (spelled out:
        # Triton's interpreter truncates)
        k = _bf16_rne(k)
        v = _bf16_rne(v)
    if TO_FP8:  # an fp8 cache: saturated at +-FP8_MAX, then to nearest even (kv_quant.store_form)
        k = _fp8_sat(k, FP8_MAX)
        v = _fp8_sat(v, FP8_MAX)
    tl.store(k_cache_ptr + block * stride_cb + offset * stride_cs + head * stride_ch + dims, k)
    tl.store(v_cache_ptr + block * stride_db + offset * stride_ds + head * stride_dh + dims, v)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """``k_cache[slot_blocks, slot_offsets] = k`` and the same for ``v``, in one kernel (two
    ``index_put_`` otherwise). k/v ``[T, KVH, D]`` with contiguous heads; caches as above."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _store_kv_kernel[(tokens, kv_heads)](
        k, v, k_cache, v_cache, slot_blocks, slot_offsets,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, TO_BF16=k.dtype == torch.float32 and k_cache.dtype == torch.bfloat16,
        TO_FP8=k_cache.dtype == torch.float8_e4m3fn, FP8_MAX=FP8_MAX,
    )  # fmt: skip


PARTIAL_BUDGET = 32 << 20
"""Bytes the partial results (per sequence, head and partition: an output row, a max and a sum)
may take before partitions are made longer."""


def partition_size(batch: int, heads: int, kv_heads: int, head_dim: int, max_tokens: int,
                   multiprocessors: int) -> int:
    """Context tokens per program (a power of two, never below :data:`MIN_PARTITION`).

    The grid covers the block table's whole width (a CUDA graph replays one grid whatever the
    lengths), so a short context in a wide table has only its first partitions live: the smaller
    they are, the more programs share its tokens and the sooner the step ends (a 1,024-token
    context in a 40,960-token table was one 1,024-token program per KV head). Partitions are the
    smallest whose partial results fit :data:`PARTIAL_BUDGET`, and no longer than it takes to
    give every multiprocessor about four programs over the whole width."""
    wanted = max(1, -(-4 * multiprocessors // max(1, batch * kv_heads)))
    spread = max(MIN_PARTITION, triton.next_power_of_2(max(1, -(-max_tokens // wanted))))
    row = heads * (head_dim + 2) * 4  # float32 output row, max and sum per head
    size = MIN_PARTITION
    while size < spread and batch * -(-max_tokens // size) * row > PARTIAL_BUDGET:
        size *= 2
    return size


_MULTIPROCESSORS: dict[int, int] = {}


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter on CPU: the value only shapes the grid
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MULTIPROCESSORS:
        _MULTIPROCESSORS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _MULTIPROCESSORS[index]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention: q ``[B, H, D]`` (any strides but the last), caches ``[NB, BS, KVH, D]``
    (strided views are fine; q's dtype or, under float32 queries, 16-bit), ``block_tables
    [B, max_blocks]``, ``context_lens [B]`` (each at least 1) → ``[B, H, D]``; ``window`` /
    ``softcap``: as :meth:`~services.engine.core.attention.PagedAttention.forward` takes them.

    Block tables and lengths already in int32 are used as they are (no conversion kernel: a
    CUDA graph's static inputs are kept so)."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the head dimension must be contiguous")
    if head_dim < 16 or head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16, got {head_dim}")
    if k_cache.dtype not in (q.dtype, torch.float8_e4m3fn) and q.dtype != torch.float32:
        raise ValueError(f"a {k_cache.dtype} cache under {q.dtype} queries")
    if window is not None and window < 1 or softcap is not None and not softcap > 0:
        raise ValueError(f"window must be at least 1 and softcap positive, got {window}, {softcap}")
    group = heads // kv_heads
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    lens = context_lens if context_lens.dtype == torch.int32 else context_lens.to(torch.int32)
    tables, lens = tables.contiguous(), lens.contiguous()
    partition = partition_size(batch, heads, kv_heads, head_dim, tables.shape[1] * block_size,
                               _multiprocessors(q.device))  # fmt: skip
    parts = -(-tables.shape[1] * block_size // partition)
    acc = torch.empty(batch, heads, parts, head_dim, dtype=torch.float32, device=q.device)
    maxes = torch.empty(batch, heads, parts, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxes)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit
    _partition_kernel[(batch, kv_heads, parts)](
        q, k_cache, v_cache, tables, lens, acc, maxes, sums,
        scale, window or 0, softcap or 1.0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tables.stride(0),
        heads, parts,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim), PARTITION=partition,
        BLOCK_N=BLOCK_N, PRECISION=precision, SOFTCAP=softcap is not None,
    )  # fmt: skip
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _reduce_kernel[(batch, heads)](
        acc, maxes, sums, lens, out, window or 0,
        out.stride(0), out.stride(1),
        heads, parts,
        PARTITION=partition, HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim),
        CHUNK=REDUCE_CHUNK,
    )  # fmt: skip
    return out


class TritonPagedAttention(TorchPagedAttention):
    """Decode steps and K/V stores through the Triton kernels (sliding windows and soft-capping
    included); prefill attention through the torch reference."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Windowed or soft-capped layers: decode rows (a decode step's, a mixed step's) through
        the kernel, prompts through the reference; the rest as the torch backend splits them."""
        if window is None and softcap is None:
            return super().forward(q, k, v, k_cache, v_cache, meta, scale)
        self.store_kv(k, v, k_cache, v_cache, meta)
        if not meta.is_prefill:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                          meta.decode_context_lens(), scale, window, softcap)  # fmt: skip
        split = meta.mixed
        if split is None:
            return _windowed_forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
        out = torch.empty_like(q)
        decode = split.decode
        out[split.decode_rows] = paged_decode_attention(
            q[split.decode_rows], k_cache, v_cache, decode.block_tables,
            decode.decode_context_lens(), scale, window, softcap,
        )  # fmt: skip
        if split.prefill is not None:
            rows = split.prefill_rows
            out[rows] = _windowed_forward(q[rows], k[rows], v[rows], k_cache, v_cache,
                                          split.prefill, scale, window, softcap)  # fmt: skip
        return out

    @staticmethod
    def store_kv(
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        if k.stride(-1) != 1 or v.stride(-1) != 1 or k.shape[-1] & (k.shape[-1] - 1):
            TorchPagedAttention.store_kv(k, v, k_cache, v_cache, meta)
            return
        store_kv(k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return paged_decode_attention(  # q: heads of the fused projection's rows, strided
            q, k_cache, v_cache, meta.block_tables, meta.decode_context_lens(), scale
        )

    def graph_safe(self) -> bool:
        """Decode steps read only tensors (no host values), so a CUDA graph can capture them."""
        return True
