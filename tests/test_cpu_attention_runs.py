"""A verify step's rows (one sequence's consecutive decode rows: its last token and its drafts)
attend together in the C decode kernel, each key tile transposed once for all of them, and every
row gets exactly the bits it gets attending alone: the same as ``d + 1`` one-token steps."""

from __future__ import annotations

import pytest
import torch

from services.engine.core import kv_quant
from services.engine.core.attention import AttentionMetadata
from services.engine.core.kernels import cpu_paged_attention
from tests.conftest import native_kernel_or_skip

BLOCK = 16
# (first position, rows) per sequence, in batch order: runs of 2 .. 17 rows across key tiles
# (64 keys) and blocks, from position 0 and deep into a 530-token context, between single rows;
# the single row at 205 sits right after the run ending at 204 (consecutive positions) but has
# its own table, and the two runs at 300 hold the same positions of two sequences
SEQUENCES = [
    (120, 17), (45, 1), (63, 2), (530, 9), (5, 1), (200, 5), (205, 1), (0, 3), (300, 16),
    (300, 4), (90, 1), (250, 8),
]  # fmt: skip
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]  # uint8: q8_0


@pytest.fixture(autouse=True)
def _kernel_available() -> None:
    native_kernel_or_skip()
    if cpu_paged_attention.load_cpu_attention() is None:
        pytest.fail("the matmul kernel builds here but the attention kernel does not")


def _cache(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen)
    return kv_quant.quantize(x) if dtype == torch.uint8 else x.to(dtype)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, None), (None, 30.0), (70, 50.0)])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 128), (9, 3, 64), (8, 2, 128), (16, 4, 64)])
def test_rows_of_one_sequence_have_their_bits_alone(
    isa: str, heads: int, kv_heads: int, dim: int, window: int | None, softcap: float | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """One batched call (the step's K/V stored, then every row attending) equals the rows taken
    one at a time in order (each a batch of one, storing its own K/V first): outputs and caches,
    bit for bit, every cache dtype; and the same batch over the filled cache with no store (a
    recomputed sequence's decode rows) too."""
    monkeypatch.setenv("TANDEM_CPU_ISA", isa)
    cpu_paged_attention.load_cpu_attention.cache_clear()
    try:
        assert cpu_paged_attention.load_cpu_attention() is not None
        gen = torch.Generator().manual_seed(heads * 1000 + dim)
        tables: list[list[int]] = []
        lens: list[int] = []
        free = torch.randperm(400, generator=gen) + 1  # block ids out of order
        for first, rows in SEQUENCES:
            need = -(-(first + rows) // BLOCK)
            table = free[:need].tolist()
            free = free[need:]
            tables += [table] * rows
            lens += range(first + 1, first + rows + 1)
        meta = AttentionMetadata.build(
            is_prefill=False, query_lens=[1] * len(lens), context_lens=lens, block_tables=tables,
            block_size=BLOCK,
        )
        batch, scale = len(lens), dim**-0.5
        q = torch.randn(batch, heads, dim, generator=gen) * 3
        k = torch.randn(batch, kv_heads, dim, generator=gen)
        v = torch.randn(batch, kv_heads, dim, generator=gen)
        for dtype in KV_DTYPES:
            k_cache = _cache(dtype, (401, BLOCK, kv_heads, dim), gen)
            v_cache = _cache(dtype, (401, BLOCK, kv_heads, dim), gen)
            k_alone, v_alone = k_cache.clone(), v_cache.clone()
            tables_t, lens_t = meta.block_tables, meta.decode_context_lens()
            together = cpu_paged_attention.cpu_paged_decode_attention(
                q, k_cache, v_cache, tables_t, lens_t, scale,
                new_kv=(k, v, meta.slot_blocks, meta.slot_offsets), window=window, softcap=softcap,
            )  # fmt: skip
            alone = torch.cat([
                cpu_paged_attention.cpu_paged_decode_attention(
                    q[i : i + 1], k_alone, v_alone, tables_t[i : i + 1], lens_t[i : i + 1], scale,
                    new_kv=(k[i : i + 1], v[i : i + 1], meta.slot_blocks[i : i + 1],
                            meta.slot_offsets[i : i + 1]),
                    window=window, softcap=softcap,
                )  # fmt: skip
                for i in range(batch)
            ])
            assert torch.equal(k_cache, k_alone) and torch.equal(v_cache, v_alone), dtype
            differ = (together != alone).flatten(1).any(1).nonzero().flatten().tolist()
            assert not differ, (dtype, "rows", differ)
            stored = cpu_paged_attention.cpu_paged_decode_attention(
                q, k_cache, v_cache, tables_t, lens_t, scale, window=window, softcap=softcap
            )
            assert torch.equal(stored, alone), dtype
    finally:
        cpu_paged_attention.load_cpu_attention.cache_clear()


@pytest.mark.parametrize("rows", [9, 17])
def test_a_run_cut_for_the_threads_keeps_the_prefill_rows_bits(rows: int) -> None:
    """A run's pieces (cut so that each thread has tasks) do not change a row's bits: one
    sequence's rows against the prefill kernel, at 1 to 4 threads."""
    gen = torch.Generator().manual_seed(rows)
    heads, kv_heads, dim, ctx = 9, 3, 64, 300
    blocks = -(-ctx // BLOCK)
    k_cache = torch.randn(blocks + 1, BLOCK, kv_heads, dim, generator=gen).to(torch.float16)
    v_cache = torch.randn(blocks + 1, BLOCK, kv_heads, dim, generator=gen).to(torch.float16)
    table = (torch.randperm(blocks, generator=gen) + 1).view(1, -1)
    q = torch.randn(rows, heads, dim, generator=gen) * 3
    prefill = cpu_paged_attention.cpu_paged_prefill_attention(
        q, k_cache, v_cache, table, [ctx], [rows], dim**-0.5, None, None
    )
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            decode = cpu_paged_attention.cpu_paged_decode_attention(
                q, k_cache, v_cache, table.expand(rows, -1), torch.arange(ctx - rows + 1, ctx + 1),
                dim**-0.5,
            )  # fmt: skip
            assert torch.equal(prefill, decode), n
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 128), (32, 8, 64), (64, 2, 64)]
)
def test_a_rows_kv_heads_in_one_task_or_several_keep_its_bits(
    heads: int, kv_heads: int, dim: int
) -> None:
    """Single rows of different sequences (a batched decode step): a task walks several of a
    row's KV heads, all of them or a chunk (to give every thread a task, or a long row its share
    of the threads), depending on the batch, the threads and the lengths. Either way a row has
    the bits it has with one task per KV head (the row alone at more threads than KV heads) and,
    for the 16- and 32-bit caches, the prefill kernel's: batches of 1 to 8 rows at 1 to 4
    threads, every dtype."""
    gen = torch.Generator().manual_seed(heads + kv_heads)
    contexts = [300, 17, 64, 129, 1, 200, 65, 90]
    lens = torch.tensor(contexts)
    threads = torch.get_num_threads()
    try:
        for dtype in KV_DTYPES:
            shape = (sum(-(-c // BLOCK) for c in contexts) + 1, BLOCK, kv_heads, dim)
            k_cache, v_cache = _cache(dtype, shape, gen), _cache(dtype, shape, gen)
            ids = (torch.randperm(k_cache.shape[0] - 1, generator=gen) + 1).tolist()
            tables = [[ids.pop() for _ in range(-(-c // BLOCK))] for c in contexts]
            width = max(len(t) for t in tables)
            table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
            q = torch.randn(len(contexts), heads, dim, generator=gen) * 3
            scale = dim**-0.5
            torch.set_num_threads(64)  # more threads than KV heads: a task per (row, KV head)
            alone = torch.cat([
                cpu_paged_attention.cpu_paged_decode_attention(
                    q[i : i + 1], k_cache, v_cache, table_t[i : i + 1], lens[i : i + 1], scale
                )
                for i, c in enumerate(contexts)
            ])  # fmt: skip
            if dtype != torch.uint8:
                for i, c in enumerate(contexts):
                    prefill = cpu_paged_attention.cpu_paged_prefill_attention(
                        q[i : i + 1], k_cache, v_cache, table_t[i : i + 1], [c], [1], scale
                    )
                    assert torch.equal(prefill, alone[i : i + 1]), (dtype, i)
            for n in (1, 2, 3, 4):
                torch.set_num_threads(n)
                for batch in (1, 2, 3, 8):
                    together = cpu_paged_attention.cpu_paged_decode_attention(
                        q[:batch], k_cache, v_cache, table_t[:batch], lens[:batch], scale
                    )
                    assert torch.equal(together, alone[:batch]), (dtype, n, batch)
    finally:
        torch.set_num_threads(threads)
