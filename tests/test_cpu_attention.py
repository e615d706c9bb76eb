"""The C paged decode- and prefill-attention kernels equal the torch reference, a decode row has
the bits of the same row in a prefill, and ``auto`` picks the kernels on CPU."""

from __future__ import annotations


import pytest
import torch

from services.common.errors import InvalidArgumentError
from services.engine.core.attention import AttentionMetadata, TorchPagedAttention
from services.engine.core.attention_backends import make_attention_backend
from services.engine.core.kernels import cpu_paged_attention
from services.engine.core.kernels.cpu_paged_attention import CpuPagedAttention
from tests.conftest import native_kernel_or_skip
from tests.paged_tables import reversed_tables


@pytest.fixture(autouse=True)
def _kernel_available() -> None:
    native_kernel_or_skip()
    if cpu_paged_attention.load_cpu_attention() is None:
        pytest.fail("the matmul kernel builds here but the attention kernel does not")


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block", "lens", "q_scale"),
    [
        (4, 2, 16, 4, [1, 7, 13, 4], 1.0),  # GQA, partial last blocks, a 1-token context
        (6, 6, 32, 8, [20, 3], 1.0),  # multi-head attention
        (9, 3, 64, 16, [40], 1.0),  # SmolLM2's shape, batch 1
        (14, 2, 64, 16, [100, 3, 17, 64], 1.0),  # 7 query heads per KV head
        (4, 2, 128, 16, [33, 5], 1.0),  # head_dim 128 (Llama 3, Qwen)
        (9, 3, 64, 16, [70, 9], 60.0),  # peaked scores: most weights underflow to exactly 0
        (8, 8, 24, 4, [5, 9], 1.0),  # head_dim not a multiple of the vector width
    ],
)
def test_decode_matches_torch_reference(
    heads: int, kv_heads: int, dim: int, block: int, lens: list[int], q_scale: float
) -> None:
    torch.manual_seed(heads * 100 + dim)
    layers = 3
    pool = torch.randn(64, layers, 2, block, kv_heads, dim)  # the KVPool layout: strided views
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    tables, next_id = [], 1
    for n in lens:  # reversed, interleaved-looking ids so a wrong table shows
        need = -(-n // block)
        tables.append(list(range(next_id, next_id + need))[::-1])
        next_id += need
    meta = AttentionMetadata.build(
        is_prefill=False, query_lens=[1] * len(lens), context_lens=lens, block_tables=tables,
        block_size=block,
    )
    q = torch.randn(len(lens), heads, dim) * q_scale
    k = torch.randn(len(lens), kv_heads, dim)
    v = torch.randn(len(lens), kv_heads, dim)
    expected = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, dim**-0.5)
    got = CpuPagedAttention().forward(q, k, v, k_cache, v_cache, meta, dim**-0.5)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=2e-6), (got - expected).abs().max()


def _prefill_step(
    heads: int, kv_heads: int, dim: int, block: int, query_lens: list[int], context_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q/k/v for a prefill step (strided views of one fused projection, as the model
    makes them), caches in the KV pool's strided layout with random cached prefixes, and its
    metadata (block ids reversed per sequence, so a wrong table shows)."""
    pool = torch.randn(200, 3, 2, block, kv_heads, dim)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    tables = reversed_tables(context_lens, block)
    meta = AttentionMetadata.build(
        is_prefill=True, query_lens=query_lens, context_lens=context_lens, block_tables=tables,
        block_size=block,
    )
    tokens = sum(query_lens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    return q, k, v, k_cache, v_cache, pool, meta


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block", "query_lens", "context_lens", "q_scale"),
    [
        (9, 3, 64, 16, [200], [200], 1.0),  # SmolLM2's shape: one prompt, nothing cached
        (9, 3, 64, 16, [37], [150], 1.0),  # a cached prefix (the prompt's tail of 37 rows)
        (4, 2, 16, 4, [5, 70, 33, 1], [5, 170, 33, 9], 1.0),  # several prompts + a decode row
        (6, 6, 32, 8, [17, 80], [17, 80], 1.0),  # multi-head attention
        (14, 2, 64, 16, [21, 3], [90, 3], 1.0),  # 7 query heads per KV head
        (4, 2, 128, 16, [65], [130], 1.0),  # head_dim 128 (Llama 3, Qwen); past a key tile
        (9, 3, 64, 16, [80, 9], [80, 40], 60.0),  # peaked scores: most weights exactly 0
    ],
)
def test_prefill_matches_torch_reference(
    heads: int, kv_heads: int, dim: int, block: int, query_lens: list[int],
    context_lens: list[int], q_scale: float,
) -> None:  # fmt: skip
    torch.manual_seed(sum(query_lens) + dim)
    q, k, v, k_cache, v_cache, pool, meta = _prefill_step(heads, kv_heads, dim, block, query_lens,
                                                          context_lens)  # fmt: skip
    q.mul_(q_scale)
    before = pool.clone()
    expected = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, dim**-0.5)
    stored = pool.clone()
    pool.copy_(before)
    calls = []
    kernel = cpu_paged_attention.cpu_paged_prefill_attention
    backend = CpuPagedAttention()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_paged_attention, "cpu_paged_prefill_attention",
                      lambda *a: calls.append(1) or kernel(*a))  # fmt: skip
        got = backend.forward(q, k, v, k_cache, v_cache, meta, dim**-0.5)
    assert calls  # the kernel ran, not the inherited reference
    assert got.shape == expected.shape
    # a score's rounding grows with its size (q_scale), and softmax passes it on: the generic
    # build (SSE2, a multiply and an add per term, no FMA) differed by 3.4e-5 at q_scale 60
    tolerance = 2e-6 * q_scale
    assert torch.allclose(got, expected, atol=tolerance), (got - expected).abs().max()
    assert torch.equal(pool, stored)  # the step's K/V stored in the same slots, nothing else


def test_prefill_rows_do_not_depend_on_the_other_prompts() -> None:
    """A prompt's rows come out bit for bit the same alone or next to other prompts (each
    kernel task reads one sequence), whatever the thread count."""
    torch.manual_seed(3)
    q, k, v, k_cache, v_cache, _, meta = _prefill_step(9, 3, 64, 16, [70, 130, 5], [90, 130, 5])
    backend = CpuPagedAttention()
    together = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            start = 0
            for b, rows in enumerate(meta.query_lens):
                alone = cpu_paged_attention.cpu_paged_prefill_attention(
                    q[start : start + rows], k_cache, v_cache, meta.block_tables[b : b + 1],
                    meta.context_lens[b : b + 1], [rows], 0.125,
                )
                assert torch.equal(alone, together[start : start + rows])
                start += rows
    finally:
        torch.set_num_threads(threads)


def test_prefill_kernel_rejects_what_it_does_not_take() -> None:
    q, _, _, k_cache, v_cache, _, meta = _prefill_step(4, 2, 16, 4, [6], [6])
    fn = cpu_paged_attention.cpu_paged_prefill_attention
    with pytest.raises(ValueError, match="cover"):
        fn(q, k_cache, v_cache, meta.block_tables, [6], [5], 1.0)
    with pytest.raises(ValueError, match="context"):
        fn(q, k_cache, v_cache, meta.block_tables, [5], [6], 1.0)
    odd = torch.randn(6, 4, 24)  # head_dim 24: the backend sends it to the reference instead
    with pytest.raises(ValueError, match="multiple of 16"):
        fn(odd, torch.randn(4, 4, 2, 24), torch.randn(4, 4, 2, 24), meta.block_tables, [6], [6], 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, None), (None, 30.0), (70, 50.0)])
def test_a_decode_row_has_the_prefill_rows_bits(
    isa: str, dtype: torch.dtype, window: int | None, softcap: float | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A position attends with the same bits as a decode row (a generated token, one query per
    sequence) and as a prompt row of the prefill kernel: a prompt's KV after a prefix-cache hit
    or a recomputation equals the cold one's, and a generated token's equals what a later
    prompt holding it computes. Every instruction-set build this CPU runs, every cache dtype,
    windows and soft-caps, contexts across key tiles and block boundaries, block tables out of
    order."""
    monkeypatch.setenv("TANDEM_CPU_ISA", isa)
    cpu_paged_attention.load_cpu_attention.cache_clear()
    try:
        assert cpu_paged_attention.load_cpu_attention() is not None
        gen = torch.Generator().manual_seed(3)
        for heads, kv_heads, dim, block, ctx, rows in [
            (4, 2, 64, 16, 200, 150), (9, 3, 64, 16, 37, 37), (8, 8, 128, 32, 130, 3),
            (4, 1, 256, 16, 70, 5), (6, 2, 96, 1, 65, 65), (2, 2, 16, 4, 5, 1),
        ]:  # fmt: skip
            blocks = -(-ctx // block)
            k_cache = torch.randn(blocks + 2, block, kv_heads, dim, generator=gen).to(dtype)
            v_cache = torch.randn(blocks + 2, block, kv_heads, dim, generator=gen).to(dtype)
            table = (torch.randperm(blocks + 1, generator=gen)[:blocks] + 1).view(1, -1)
            q = torch.randn(rows, heads, dim, generator=gen) * 3
            scale = dim**-0.5
            prefill = cpu_paged_attention.cpu_paged_prefill_attention(
                q, k_cache, v_cache, table, [ctx], [rows], scale, window, softcap
            )
            decode = cpu_paged_attention.cpu_paged_decode_attention(
                q, k_cache, v_cache, table.expand(rows, -1), torch.arange(ctx - rows + 1, ctx + 1),
                scale, window=window, softcap=softcap,
            )  # fmt: skip
            assert torch.equal(prefill, decode), (heads, kv_heads, dim, block, ctx, rows)
    finally:
        cpu_paged_attention.load_cpu_attention.cache_clear()


def test_bfloat16_uses_the_torch_path() -> None:
    torch.manual_seed(0)
    pool = torch.randn(8, 2, 4, 2, 16, dtype=torch.bfloat16)
    k_cache, v_cache = pool[:, 0], pool[:, 1]
    meta = AttentionMetadata.build(
        is_prefill=False, query_lens=[1], context_lens=[5], block_tables=[[3, 1]], block_size=4
    )
    q, k, v = torch.randn(1, 4, 16).bfloat16(), torch.randn(1, 2, 16).bfloat16(), torch.randn(1, 2, 16).bfloat16()
    expected = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 0.25)
    assert torch.equal(CpuPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 0.25), expected)


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_attention_backend("auto", "cpu"), CpuPagedAttention)
    assert isinstance(make_attention_backend("cpu", "cpu"), CpuPagedAttention)
    assert type(make_attention_backend("torch", "cpu")) is TorchPagedAttention
    with pytest.raises(InvalidArgumentError, match="runs on CPU"):
        make_attention_backend("cpu", "cuda")
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    cpu_paged_attention.load_cpu_attention.cache_clear()
    try:
        with pytest.raises(InvalidArgumentError, match="can't be built"):
            make_attention_backend("cpu", "cpu")
        fallback = make_attention_backend("auto", "cpu")  # runs the torch path without its kernel
        meta = AttentionMetadata.build(
            is_prefill=False, query_lens=[1], context_lens=[3], block_tables=[[1]], block_size=4
        )
        q, cache = torch.randn(1, 4, 16), torch.randn(4, 4, 2, 16)
        expected = TorchPagedAttention().decode(q, cache, cache, meta, 0.25)
        assert torch.equal(fallback.decode(q, cache, cache, meta, 0.25), expected)
    finally:
        cpu_paged_attention.load_cpu_attention.cache_clear()


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [None, 1, 7, 40])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block", "query_lens", "context_lens"),
    [
        (4, 2, 16, 4, [1, 1, 1, 1], [3, 7, 50, 41]),  # decode: contexts on both sides of a window
        (9, 3, 64, 16, [1, 1], [200, 12]),  # decode: SmolLM2's shape
        (8, 8, 24, 4, [1, 1], [30, 5]),  # decode: head_dim not whole vectors
        (9, 3, 64, 16, [150, 20], [150, 20]),  # prefill: prompts longer and shorter than windows
        (4, 2, 16, 4, [37, 1, 70], [150, 9, 170]),  # mixed: cached prefixes and a decode row
        (4, 2, 128, 16, [65], [130]),  # prefill: head_dim 128, past a key tile
    ],
)
def test_window_and_softcap_match_the_reference(
    heads: int, kv_heads: int, dim: int, block: int, query_lens: list[int],
    context_lens: list[int], window: int | None, softcap: float | None,
) -> None:  # fmt: skip
    """Sliding windows (a query at p sees keys p - window < k <= p) and soft-capped scores go
    through the kernels, never the per-sequence reference, and equal it."""
    if window is None and softcap is None:
        pytest.skip("the plain case: the tests above")
    torch.manual_seed(sum(context_lens) + dim)
    prefill = query_lens != [1] * len(query_lens)
    if prefill:
        q, k, v, k_cache, v_cache, pool, meta = _prefill_step(heads, kv_heads, dim, block, query_lens,
                                                              context_lens)  # fmt: skip
    else:
        pool = torch.randn(64, 3, 2, block, kv_heads, dim)
        k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
        tables, next_id = [], 1
        for n in context_lens:
            tables.append(list(range(next_id, next_id + -(-n // block)))[::-1])
            next_id += -(-n // block)
        meta = AttentionMetadata.build(is_prefill=False, query_lens=query_lens,
                                       context_lens=context_lens, block_tables=tables,
                                       block_size=block)  # fmt: skip
        q = torch.randn(len(query_lens), heads, dim) * 3  # larger scores: the cap bites
        k, v = torch.randn(len(query_lens), kv_heads, dim), torch.randn(len(query_lens), kv_heads, dim)
    before = pool.clone()
    expected = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, dim**-0.5, window,
                                             softcap)  # fmt: skip
    stored = pool.clone()
    pool.copy_(before)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_paged_attention, "_windowed_forward", None)  # the kernels, or a TypeError
        got = CpuPagedAttention().forward(q, k, v, k_cache, v_cache, meta, dim**-0.5, window, softcap)
    assert torch.allclose(got, expected, atol=2e-6), (got - expected).abs().max()
    assert torch.equal(pool, stored)


def test_a_window_the_kernel_does_not_take_runs_the_reference() -> None:
    """head_dim 24 is no prefill-kernel shape: the windowed prompt goes to the reference."""
    q, k, v, k_cache, v_cache, _, meta = _prefill_step(8, 8, 24, 4, [30], [30])
    expected = TorchPagedAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.2, 5)
    got = CpuPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 0.2, 5)
    assert torch.allclose(got, expected, atol=1e-6)
    with pytest.raises(ValueError, match="window"):
        cpu_paged_attention.cpu_paged_decode_attention(
            q[:1], k_cache, v_cache, meta.block_tables, torch.tensor([30]), 0.2, window=0
        )
