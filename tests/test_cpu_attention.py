"""The C paged decode-attention kernel equals the torch reference, and ``auto`` picks it on CPU."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgumentError
from services.engine.core.attention import AttentionMetadata, TorchPagedAttention
from services.engine.core.attention_backends import make_attention_backend
from services.engine.core.kernels import cpu_paged_attention
from services.engine.core.kernels.cpu_paged_attention import CpuPagedAttention
from tests.conftest import native_kernel_or_skip


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


def test_prefill_and_bfloat16_use_the_torch_path() -> None:
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
