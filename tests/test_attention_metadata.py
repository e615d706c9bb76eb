"""Attention metadata built with tensor ops equals its per-token definition, and the varlen
prefill (every prompt of a step in one attention call) equals attending each prompt alone."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

from services.engine.core.attention import AttentionMetadata, TorchPagedAttention, _prefill_mask

BLOCK = 4


def _tables(context_lens: list[int], rng: random.Random) -> list[list[int]]:
    ids = list(range(1, 200))
    rng.shuffle(ids)
    tables, used = [], 0
    for ctx in context_lens:
        need = -(-ctx // BLOCK)
        tables.append(ids[used : used + need])
        used += need
    return tables


def test_build_matches_the_per_token_definition() -> None:
    rng = random.Random(0)
    for is_prefill in (True, False):
        for _ in range(20):
            batch = rng.randint(1, 6)
            query = [rng.randint(1, 9) if is_prefill else 1 for _ in range(batch)]
            context = [q + rng.randint(0, 11) for q in query]
            tables = _tables(context, rng)
            meta = AttentionMetadata.build(is_prefill=is_prefill, query_lens=query,
                                           context_lens=context, block_tables=tables,
                                           block_size=BLOCK)  # fmt: skip
            blocks = [t[p // BLOCK] for q, c, t in zip(query, context, tables) for p in range(c - q, c)]
            offsets = [p % BLOCK for q, c in zip(query, context) for p in range(c - q, c)]
            assert meta.slot_blocks.tolist() == blocks and meta.slot_offsets.tolist() == offsets
            width = max(len(t) for t in tables)
            assert meta.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
            if is_prefill:
                assert meta.token_seqs.tolist() == [b for b, q in enumerate(query) for _ in range(q)]
                assert meta.token_rows.tolist() == [j for q in query for j in range(q)]
            else:
                assert meta.context_lens_tensor.tolist() == context
                # the mask only PyTorch's attention reads: built at its first use, then kept
                assert meta.decode_mask is None
                mask = meta.decode_mask_for(width * BLOCK)
                if batch == 1:
                    assert mask is None  # one sequence attends to exactly its context
                else:
                    assert mask is not None and mask.shape == (batch, 1, 1, width * BLOCK)
                    assert mask[:, 0, 0].tolist() == [[p < c for p in range(width * BLOCK)]
                                                      for c in context]  # fmt: skip
                    assert meta.decode_mask_for(width * BLOCK) is mask


def _alone(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int) -> torch.Tensor:
    """One sequence, written out: its new queries over all its keys, causal from ``cached``."""
    n, ctx = q.shape[0], keys.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(cached, cached + n)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1),
                                         values.transpose(0, 1), attn_mask=mask, scale=0.25,
                                         enable_gqa=True)  # fmt: skip
    return out.transpose(0, 1)


def test_varlen_prefill_equals_each_prompt_alone() -> None:
    torch.manual_seed(0)
    rng = random.Random(1)
    heads, kv_heads, dim = 4, 2, 16
    query, cached = [5, 1, 9, 3], [0, 6, 0, 4]  # two prompts continue a cached prefix
    context = [q + c for q, c in zip(query, cached)]
    tables = _tables(context, rng)
    k_cache, v_cache = torch.randn(200, BLOCK, kv_heads, dim), torch.randn(200, BLOCK, kv_heads, dim)
    full_k = [torch.randn(c, kv_heads, dim) for c in context]  # every position's K and V
    full_v = [torch.randn(c, kv_heads, dim) for c in context]
    for t, keys, vals in zip(tables, full_k, full_v):  # the cached prefixes already in the pool
        for pos in range(keys.shape[0]):
            k_cache[t[pos // BLOCK], pos % BLOCK], v_cache[t[pos // BLOCK], pos % BLOCK] = keys[pos], vals[pos]
    q = torch.randn(sum(query), heads, dim)
    new_k = torch.cat([k[c:] for k, c in zip(full_k, cached)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, cached)])
    meta = AttentionMetadata.build(is_prefill=True, query_lens=query, context_lens=context,
                                   block_tables=tables, block_size=BLOCK)  # fmt: skip
    got = TorchPagedAttention().forward(q, new_k, new_v, k_cache, v_cache, meta, 0.25)
    start = 0
    for n, c, keys, vals in zip(query, cached, full_k, full_v):
        expected = _alone(q[start : start + n], keys, vals, c)
        assert torch.allclose(got[start : start + n], expected, atol=1e-5)
        start += n


def test_a_mixed_step_splits_its_one_token_rows_off() -> None:
    tables = _tables([9, 6, 4, 7], random.Random(2))
    meta = AttentionMetadata.build(is_prefill=True, query_lens=[5, 1, 4, 1],
                                   context_lens=[9, 6, 4, 7], block_tables=tables,
                                   block_size=BLOCK)  # fmt: skip
    split = meta.mixed
    assert split is not None
    assert split.decode_rows.tolist() == [5, 10] and not split.decode.is_prefill
    assert split.decode.context_lens == [6, 7] and split.decode.block_tables.tolist()[0] == tables[1]
    assert split.prefill_rows.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9] and split.prefill.is_prefill
    assert split.prefill.query_lens == [5, 4] and split.prefill.mixed is None
    for query in ([5, 4], [1, 1], [1]):  # nothing to split: all prompts, a decode step, one token
        context = [q + 2 for q in query]
        built = AttentionMetadata.build(is_prefill=query != [1, 1], query_lens=query,
                                        context_lens=context, block_tables=_tables(context, random.Random(3)),
                                        block_size=BLOCK)  # fmt: skip
        assert built.mixed is None


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_mixed_step_equals_the_padded_batch(backend: str) -> None:
    """Decode rows next to prompt chunks (the split) attend exactly as in one padded batch."""
    attention = TorchPagedAttention()
    if backend == "cpu":
        from services.engine.core.kernels.cpu_paged_attention import (
            CpuPagedAttention,
            load_cpu_attention,
        )

        if load_cpu_attention() is None:
            pytest.skip("no native attention kernel here")
        attention = CpuPagedAttention()
    torch.manual_seed(4)
    heads, kv_heads, dim = 4, 2, 16
    query, cached = [1, 7, 1, 1, 3, 1], [12, 5, 3, 0, 0, 30]
    context = [q + c for q, c in zip(query, cached)]
    tables = _tables(context, random.Random(5))
    caches = [torch.randn(200, BLOCK, kv_heads, dim) for _ in range(2)]
    q = torch.randn(sum(query), heads, dim)
    k, v = torch.randn(sum(query), kv_heads, dim), torch.randn(sum(query), kv_heads, dim)
    meta = AttentionMetadata.build(is_prefill=True, query_lens=query, context_lens=context,
                                   block_tables=tables, block_size=BLOCK)  # fmt: skip
    assert meta.mixed is not None
    got_caches = [c.clone() for c in caches]
    got = attention.forward(q, k, v, *got_caches, meta, 0.25)
    TorchPagedAttention.store_kv(k, v, *caches, meta)  # the reference: one padded batch
    padded = dataclasses.replace(meta, mixed=None, prefill_mask=_prefill_mask(
        query, context, torch.tensor(cached), torch.tensor(query), BLOCK, "cpu"))  # fmt: skip
    expected = TorchPagedAttention().prefill(q, k, v, *caches, padded, 0.25)
    assert torch.allclose(got, expected, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got_caches, caches))


def test_a_recomputed_sequence_splits_its_generated_rows_off() -> None:
    """Rows past a sequence's prompt (tokens it generated, recomputed after a preemption or a
    migration) attend as decode rows, each over its context up to itself."""
    tables = _tables([11, 4], random.Random(6))
    meta = AttentionMetadata.build(is_prefill=True, query_lens=[8, 4], context_lens=[11, 4],
                                   block_tables=tables, block_size=BLOCK, prompt_counts=[5, 4])  # fmt: skip
    split = meta.mixed
    assert split is not None and split.prefill is not None
    assert split.decode_rows.tolist() == [5, 6, 7] and split.decode.context_lens == [9, 10, 11]
    assert split.decode.block_tables.tolist() == [tables[0]] * 3
    assert split.prefill_rows.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11]
    assert split.prefill.query_lens == [5, 4] and split.prefill.context_lens == [8, 4]
    only = AttentionMetadata.build(is_prefill=True, query_lens=[3], context_lens=[9],
                                   block_tables=tables[:1], block_size=BLOCK, prompt_counts=[0])  # fmt: skip
    assert only.mixed is not None and only.mixed.prefill is None
    assert only.mixed.decode.context_lens == [7, 8, 9]
    one = AttentionMetadata.build(is_prefill=True, query_lens=[6], context_lens=[6],
                                  block_tables=tables[:1], block_size=BLOCK, prompt_counts=[5])  # fmt: skip
    assert one.mixed is not None and one.mixed.decode_rows.tolist() == [5]  # one generated row
    assert one.mixed.prefill is not None and one.mixed.prefill.query_lens == [5]


@pytest.mark.parametrize("window, softcap", [(None, None), (4, None), (None, 30.0)])
def test_recomputed_tokens_attend_bit_for_bit_as_when_generated(
    window: int | None, softcap: float | None
) -> None:
    """A prompt prefilled, then tokens decoded one step at a time; later the same sequence
    recomputed in one prefill step next to another prompt: the generated tokens' attention
    outputs are equal to the bit (an int8-rounding matmul after them would otherwise turn a
    last-bit difference into a quantum and a migrated stream could leave its greedy text)."""
    from services.engine.core.kernels.cpu_paged_attention import CpuPagedAttention, load_cpu_attention

    if load_cpu_attention() is None:
        pytest.skip("no native attention kernel here")
    attention = CpuPagedAttention()
    torch.manual_seed(7)
    heads, kv_heads, dim, prompt, generated = 4, 2, 16, 6, 5
    total = prompt + generated
    q = torch.randn(total, heads, dim)
    k, v = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    table = _tables([total], random.Random(8))[0]
    caches = [torch.zeros(200, BLOCK, kv_heads, dim) for _ in range(2)]
    first = AttentionMetadata.build(is_prefill=True, query_lens=[prompt], context_lens=[prompt],
                                    block_tables=[table], block_size=BLOCK)  # fmt: skip
    attention.forward(q[:prompt], k[:prompt], v[:prompt], *caches, first, 0.25, window, softcap)
    decoded = []
    for pos in range(prompt, total):
        step = AttentionMetadata.build(is_prefill=False, query_lens=[1], context_lens=[pos + 1],
                                       block_tables=[table], block_size=BLOCK)  # fmt: skip
        decoded.append(attention.forward(q[pos : pos + 1], k[pos : pos + 1], v[pos : pos + 1],
                                         *caches, step, 0.25, window, softcap))  # fmt: skip
    other = 7  # another prompt in the same recompute step
    tables = [_tables([total], random.Random(9))[0], [190, 191]]
    q2, k2, v2 = (torch.cat([t, torch.randn(other, *t.shape[1:])]) for t in (q, k, v))
    again = [torch.zeros(200, BLOCK, kv_heads, dim) for _ in range(2)]
    meta = AttentionMetadata.build(is_prefill=True, query_lens=[total, other],
                                   context_lens=[total, other], block_tables=tables,
                                   block_size=BLOCK, prompt_counts=[prompt, other])  # fmt: skip
    out = attention.forward(q2, k2, v2, *again, meta, 0.25, window, softcap)
    assert torch.equal(out[prompt:total], torch.cat(decoded))
