"""Tandem's model vs Hugging Face transformers on the same tiny random Llama (float32).

Logits must match to ~1e-5 for a batched prefill of prompts of different lengths, for a prefill
on top of an already-cached prefix (chunked), and for step-by-step paged decode of the batch;
with each linear layout: dense ``F.linear``, the split ``bmm`` and the native CPU kernel.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.core.attention import AttentionMetadata
from services.engine.core.kv_cache import KVLayout, KVPool
from services.engine.core.linear import PackPlan, pack_linears
from services.engine.core.loaders import LoadedModel, load_model
from tests.conftest import native_kernel_or_skip

ATOL = 2e-5
BLOCK = 4


@pytest.fixture(scope="module", params=["dense", "split-bmm", "native-kernel"])
def models(
    tiny_llama_dir: Path, request: pytest.FixtureRequest
) -> tuple[LoadedModel, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    ours = load_model(str(tiny_llama_dir), torch.float32)
    if request.param == "split-bmm":
        pack_linears(ours.model, PackPlan(splits=2), free_dense=True)
    elif request.param == "native-kernel":
        pack_linears(ours.model, PackPlan(kernel=native_kernel_or_skip()), free_dense=True)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return ours, ref


def _pool(loaded: LoadedModel, blocks: int = 64) -> KVPool:
    c = loaded.config
    return KVPool(blocks, KVLayout(c.num_layers, BLOCK, c.num_kv_heads, c.head_dim, "float32"))


def _ref_logits(ref: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def _tables(lengths: list[int], extra: int) -> list[list[int]]:
    """Interleaved, non-contiguous block ids so a wrong table shows up in the logits."""
    tables, next_id = [], 1
    for n in lengths:
        need = (n + extra + BLOCK - 1) // BLOCK
        tables.append([next_id + len(lengths) * i for i in range(need)])
        next_id += 1
    return tables


def test_config_read_from_hf_folder(models: tuple[LoadedModel, torch.nn.Module]) -> None:
    ours, ref = models
    assert ours.config.num_kv_heads == 2 and ours.config.num_heads == 4
    assert ours.config.rope_scaling is not None and ours.config.rope_scaling.factor == 8.0
    assert not ours.config.tie_word_embeddings


@torch.no_grad()
def test_batched_prefill_and_paged_decode_match_transformers(
    models: tuple[LoadedModel, torch.nn.Module],
) -> None:
    ours, ref = models
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 13, 1, 9]
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]
    steps = 6
    tables = _tables(lengths, steps)
    kv = _pool(ours, blocks=max(max(t) for t in tables) + 1)

    meta = AttentionMetadata.build(
        is_prefill=True, query_lens=lengths, context_lens=lengths, block_tables=tables,
        block_size=BLOCK,
    )
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.tensor([i for n in lengths for i in range(n)])
    logits = ours.model.compute_logits(ours.model(ids, pos, kv, meta))
    start = 0
    for prompt in prompts:
        expected = _ref_logits(ref, prompt)
        got = logits[start : start + len(prompt)]
        assert torch.allclose(got, expected, atol=ATOL), (got - expected).abs().max()
        start += len(prompt)

    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        new = torch.randint(3, 256, (len(seqs),), generator=gen).tolist()
        for seq, tok in zip(seqs, new):
            seq.append(tok)
        ctx = [len(s) for s in seqs]
        meta = AttentionMetadata.build(
            is_prefill=False, query_lens=[1] * len(seqs), context_lens=ctx, block_tables=tables,
            block_size=BLOCK,
        )
        out = ours.model.compute_logits(
            ours.model(torch.tensor(new), torch.tensor([c - 1 for c in ctx]), kv, meta)
        )
        for row, seq in enumerate(seqs):
            expected = _ref_logits(ref, seq)[-1]
            assert torch.allclose(out[row], expected, atol=ATOL), (out[row] - expected).abs().max()


@torch.no_grad()
def test_prefill_on_cached_prefix_matches_transformers(
    models: tuple[LoadedModel, torch.nn.Module],
) -> None:
    """Chunked prefill: the second chunk attends to the first chunk's KV in the cache."""
    ours, ref = models
    prompt = torch.randint(3, 256, (22,), generator=torch.Generator().manual_seed(2)).tolist()
    table = [7, 2, 9, 4, 11, 5]
    kv = _pool(ours)
    expected = _ref_logits(ref, prompt)
    for lo, hi in [(0, 8), (8, 19), (19, 22)]:
        meta = AttentionMetadata.build(
            is_prefill=True, query_lens=[hi - lo], context_lens=[hi], block_tables=[table],
            block_size=BLOCK,
        )
        got = ours.model.compute_logits(
            ours.model(torch.tensor(prompt[lo:hi]), torch.arange(lo, hi), kv, meta)
        )
        assert torch.allclose(got, expected[lo:hi], atol=ATOL), (got - expected[lo:hi]).abs().max()


@torch.no_grad()
def test_bfloat16_close_to_float32(tiny_llama_dir: Path) -> None:
    f32 = load_model(str(tiny_llama_dir), torch.float32)
    bf16 = load_model(str(tiny_llama_dir), torch.bfloat16)  # on CPU: bfloat16 weights only
    head = bf16.model.lm_head.quant
    assert head is not None and head.qs.dtype == torch.bfloat16 and bf16.dtype == torch.float32
    prompt = list(range(3, 40))
    outs = []
    for loaded in (f32, bf16):
        c, dtype = loaded.config, str(loaded.dtype).removeprefix("torch.")
        kv = KVPool(16, KVLayout(c.num_layers, BLOCK, c.num_kv_heads, c.head_dim, dtype))
        meta = AttentionMetadata.build(
            is_prefill=True, query_lens=[len(prompt)], context_lens=[len(prompt)],
            block_tables=[list(range(10))], block_size=BLOCK,
        )
        h = loaded.model(torch.tensor(prompt), torch.arange(len(prompt)), kv, meta)
        outs.append(loaded.model.compute_logits(h))
    assert torch.allclose(outs[0], outs[1], atol=0.05, rtol=0.05)
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean() > 0.9
