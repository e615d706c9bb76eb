"""Triton kernel: batched decode attention over the paged KV cache.

One program per (sequence, query head). It walks the sequence's block table one block at a time
(``BLOCK_SIZE`` token slots), scores the slots against the query, keeps a running max and sum
(online softmax, as in FlashAttention / vLLM's paged attention v1) and accumulates the weighted
values, so no ``[B, L, D]`` gather of the context is ever materialised. Grouped-query attention
maps query head ``h`` to KV head ``h // (H / KVH)``.

Launched by :class:`TritonPagedAttention` for decode steps; prefill steps use the torch reference
(:class:`~services.engine.core.attention.TorchPagedAttention`), which is compute-bound anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.core.attention import AttentionMetadata, TorchPagedAttention


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr,
    scale,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_oh,
    stride_tb,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    dims = tl.arange(0, HEAD_DIM)
    slots = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + dims).to(tl.float32)
    length = tl.load(lens_ptr + seq)
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    num_blocks = tl.cdiv(length, BLOCK_SIZE)
    for b in range(0, num_blocks):
        block = tl.load(tables_ptr + seq * stride_tb + b)
        pos = b * BLOCK_SIZE + slots
        valid = pos < length
        k_off = block * stride_kb + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        k = tl.load(k_ptr + k_off, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m - m_new)
        v_off = block * stride_vb + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :]
        v = tl.load(v_ptr + v_off, mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        total = total * alpha + tl.sum(p, axis=0)
        m = m_new
    out = acc / total
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention: q ``[B, H, D]``, caches ``[NB, BS, KVH, D]`` (strided views are fine),
    ``block_tables [B, max_blocks]``, ``context_lens [B]`` → ``[B, H, D]``."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the head dimension must be contiguous")
    out = torch.empty_like(q)
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    _paged_decode_kernel[(batch, heads)](
        q, k_cache, v_cache, out, tables, lens,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        tables.stride(0),
        GROUP=heads // kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
    )
    return out


class TritonPagedAttention(TorchPagedAttention):
    """Decode steps through the Triton kernel; the rest through the torch reference."""

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return paged_decode_attention(
            q.contiguous(), k_cache, v_cache, meta.block_tables, meta.decode_context_lens(), scale
        )
