"""Tensor parallelism (issue 48) on quantized GGUF weights, embeddings and draft-model
speculation, over real processes and real Gloo (2 ranks of one core each).

* A small Llama GGUF holding every block type Tandem loads (``tests/quantized_gguf.py``: Q4_0,
  Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, each split both column-parallel by rows and
  row-parallel by input columns), kept as stored (``--dtype q4``) and with 8-bit activations
  (``q4_a8_decode``, what ``auto`` picks for 4-bit GGUFs): width 2 gives width 1's greedy tokens,
  and its logits within :data:`ATOL`.
* The real Gemma 3 270M Q4_K_M (``--dtype auto``), the same.
* Embeddings through the engine's :class:`Embedder` at width 2 equal width 1's (chunked passes
  included); greedy tokens with a draft model (whole, on rank 0) next to a split target equal
  width 1's without one, with drafts verified and accepted.

Why the logits are not bit-identical: split on block boundaries, every rank's blocks are bit for
bit the unsplit weight's. What changes is the order of float32 additions: a row-parallel layer's
output is two partial sums (one per rank's half of the input columns) added by the all-reduce,
where width 1 adds its blocks' products in one run (and the kernels tile a 512- and a 1024-wide
row differently). Each reordering moves a sum by a few float32 ulps of its magnitude; over 8
layers of norms and residual adds that stays around 1e-5 of the logits' scale. With float32
activations (``q4``) :data:`ATOL` is 1e-3 on logits of a few units: above the reordering, far
below any real error (a block read from the wrong place, a wrong scale or a missed all-reduce
moves logits by units). Over int8 activations those last-bit differences can flip a value's int8
rounding, a whole step: :func:`_a8_bound` measures that yardstick on width 1 itself.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as T

from services.common.errors import InvalidArgumentError
from services.engine.core.loaders import load_model
from services.engine.core.quant.quantized_weight import from_gguf_blocks
from tests import tp_driver
from tests.quantized_gguf import TYPES, random_blocks, write_quantized_llama
from tests.tp_tasks_driver import Task, embed, run_rank0

pytestmark = pytest.mark.slow

ATOL = 1e-3
PROMPTS = [[5, 17, 42, 99, 3, 8, 150, 7, 77, 31, 64, 12, 9], [9, 4, 200], [33]]
GEMMA_PROMPTS = [[2, 818, 5279, 529, 7001, 563, 496, 236764, 1758], [2, 9259, 236888]]
EMBED_INPUTS = [[5, 17, 42, 99, 3, 8, 150, 7, 77, 31, 64, 12, 9, 300, 41, 2, 18, 900, 6], [7, 8]]
MAX_TOKENS = 8


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_columns_on_block_boundaries_are_the_blocks_values(ggml_type: T) -> None:
    """A slice of input columns holds exactly the unsplit weight's values there; a slice that
    cuts a block is refused."""
    import numpy as np

    raw = random_blocks(np.random.default_rng(3), ggml_type, 6, 1024, 0.01)
    weight = from_gguf_blocks(raw, ggml_type, (6, 1024))
    assert weight is not None
    whole = weight.dequantize()
    block = weight.block
    assert block == (256 if ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K) else 32)
    for start, count in ((0, 512), (512, 512), (block, 2 * block)):
        part = weight.columns(start, count)
        assert part.shape == (6, count)
        assert torch.equal(part.dequantize(), whole[:, start : start + count])
    with pytest.raises(ValueError, match="blocks"):
        weight.columns(block // 2, block)


def test_a_width_that_cuts_blocks_is_refused() -> None:
    """A row-parallel weight whose per-rank inputs are not whole blocks is refused naming the
    weight and the flag (here Q4_K's 256-value blocks, 128 inputs a rank), as is a float matrix
    that the loader would quantize to Q8_0 in groups of 32 after the split."""
    import numpy as np

    from services.common.model_config import ModelConfig
    from services.engine.core.tp_group import TensorParallelGroup
    from services.engine.core.tp_shard import RankShard

    config = ModelConfig(architecture="llama", vocab_size=100, hidden_size=256,
                         intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=64, rms_norm_eps=1e-6, rope_theta=1e4,
                         max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    shard = RankShard(TensorParallelGroup(rank=1, world=2, device=torch.device("cpu")))
    shard.shard_config(config)
    raw = random_blocks(np.random.default_rng(0), T.Q4_K, 256, 256, 0.01)
    o_proj = from_gguf_blocks(raw, T.Q4_K, (256, 256))
    with pytest.raises(InvalidArgumentError, match=r"--tensor-parallel-size 2 does not split "
                       r"model\.layers\.0\.self_attn\.o_proj\.weight.*128 input columns.*"
                       r"256-value q4_k blocks"):  # fmt: skip
        shard.shard_weight("model.layers.0.self_attn.o_proj.weight", o_proj)
    q_proj = shard.shard_weight("model.layers.0.self_attn.q_proj.weight", o_proj)  # whole rows
    assert torch.equal(q_proj.dequantize(), o_proj.dequantize()[128:])
    down = torch.randn(256, 96)  # 48 columns a rank: not whole groups of 32
    with pytest.raises(InvalidArgumentError, match="48 input columns.*32-value q8_0 groups"):
        shard.shard_weight("model.layers.0.mlp.down_proj.weight", down, float_block=32)
    kept = shard.shard_weight("model.layers.0.mlp.down_proj.weight", down)  # stays float32
    assert torch.equal(kept, down[:, 48:])


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_quantized_llama(tmp_path_factory.mktemp("tpq") / "every-block-type.gguf")


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    from services.common.errors import ModelLoadError
    from services.common.model_source import gemma3_270m_path

    try:
        return gemma3_270m_path()
    except ModelLoadError:
        pytest.skip("Gemma 3 270M Q4_K_M is not installed (scripts/install.sh --test)")


def at_width2(tasks: list[Task]) -> list[Any]:
    """Every task's result at width 2: one real 2-rank group (rank 0 in a process of its own,
    its follower spawned by it)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    driver = context.Process(target=run_rank0, args=(tasks, 2, results))
    driver.start()
    found: list[Any] = []
    try:
        for _ in tasks:
            outcome = results.get(timeout=300)
            assert outcome[0] == "ok", f"task {outcome[1]}: {outcome[2]}"
            found.append(outcome[2])
    finally:
        driver.join(60)
        if driver.is_alive():
            driver.kill()
    assert driver.exitcode == 0
    return found


@pytest.fixture(scope="module")
def width2(small_gguf: Path) -> list[Any]:
    small = str(small_gguf)
    return at_width2([
        Task("logits", small, "q4", PROMPTS, MAX_TOKENS),
        Task("embed", small, "q4", EMBED_INPUTS),
        Task("draft", small, "q4", PROMPTS[:2], 12, draft=small),
        Task("logits", small, "q4_a8_decode", PROMPTS, MAX_TOKENS),
    ])  # fmt: skip


def test_every_block_type_split_matches_width1(small_gguf: Path, width2: list[Any]) -> None:
    """``--dtype q4`` (float32 activations): width 1's tokens, logits within :data:`ATOL`."""
    single = load_model(str(small_gguf), "q4")
    assert single.weight_format == "q4"
    logits, tokens = width2[0]
    for one, two in zip(tp_driver.prefill_logits(single, PROMPTS), logits, strict=True):
        assert one.abs().max() > 0.5  # real signal, not a vanishing model
        torch.testing.assert_close(two, one, atol=ATOL, rtol=0)
    assert tokens == tp_driver.greedy(single, PROMPTS, MAX_TOKENS)
    assert len({tuple(t) for t in tokens}) > 1  # not one token over and over for every prompt


def test_every_block_type_over_int8_activations_matches_width1(small_gguf: Path,
                                                               width2: list[Any]) -> None:  # fmt: skip
    """``q4_a8_decode``: width 1's tokens; logits within what width 1 itself moves by when its
    inputs move by a few float32 ulps (:func:`_a8_bound`)."""
    single = load_model(str(small_gguf), "q4_a8_decode")
    assert single.weight_format == "q4_a8_decode"
    logits, tokens = width2[3]
    _a8_bound(single, PROMPTS, logits)
    assert tokens == tp_driver.greedy(single, PROMPTS, MAX_TOKENS)


NUDGE = 2.0**-20  # 8 float32 ulps of relative change


def _a8_bound(single: Any, prompts: list[list[int]], width2: list[torch.Tensor]) -> None:
    """Width 2 over int8 activations against width 1. The int8 rows are rounded per group of 32
    inputs, the same groups at either width; but a row's inputs are sums whose last float32 bits
    differ between the widths (after the first all-reduce), and a value on a rounding boundary of
    its group's int8 grid then goes one step the other way: a whole activation step, not an ulp,
    which the later layers carry to the logits. So ATOL cannot hold here, at any width change,
    and the yardstick is width 1 against itself: its logits when the embeddings are scaled by
    ``1 + NUDGE`` (measured on the small GGUF: 0.034 and 0.058 for 1 and 8 ulps, of logits a few
    units large, where width 2 moves them 0.039). Width 2 must stay within twice that (plus
    ATOL); a misplaced block or a missed all-reduce moves logits by units."""
    one = tp_driver.prefill_logits(single, prompts)
    embed = single.model.embed_tokens
    forward = embed.forward
    embed.forward = lambda ids: forward(ids) * (1 + NUDGE)
    try:
        nudged = tp_driver.prefill_logits(single, prompts)
    finally:
        del embed.forward
    yardstick = max((a - b).abs().max().item() for a, b in zip(one, nudged, strict=True))
    drift = max((a - b).abs().max().item() for a, b in zip(one, width2, strict=True))
    assert max(t.abs().max().item() for t in one) > 0.5  # real signal
    assert drift <= 2 * yardstick + ATOL, (drift, yardstick)


def test_gemma3_270m_q4_k_m_split_matches_width1(gemma_gguf: Path) -> None:
    """The real model, as ``--dtype auto`` serves it (its 4-bit blocks over int8 activations
    where the kernels build): 4 query heads over 2 ranks, its one KV head on both."""
    (logits, tokens), = at_width2([Task("logits", str(gemma_gguf), "auto", GEMMA_PROMPTS)])
    single = load_model(str(gemma_gguf), "auto")
    one_logits = tp_driver.prefill_logits(single, GEMMA_PROMPTS)
    assert tokens == tp_driver.greedy(single, GEMMA_PROMPTS, MAX_TOKENS)
    if single.int8_activations:
        _a8_bound(single, GEMMA_PROMPTS, logits)
    else:
        for one, two in zip(one_logits, logits, strict=True):
            torch.testing.assert_close(two, one, atol=ATOL, rtol=0)


def test_embeddings_at_width2_match_width1(small_gguf: Path, width2: list[Any]) -> None:
    single = load_model(str(small_gguf), "q4")
    for pooling, vectors in width2[1].items():
        for one, two in zip(embed(single, EMBED_INPUTS, pooling), vectors, strict=True):
            assert one.shape == two.shape == (512,)
            torch.testing.assert_close(two, one, atol=ATOL, rtol=0)


def test_a_whole_draft_next_to_a_split_target_keeps_greedy_tokens(small_gguf: Path,
                                                                  width2: list[Any]) -> None:  # fmt: skip
    """The draft (the same GGUF: a self-draft, so its guesses are mostly right) runs whole on rank
    0; verification runs on the split target: the tokens are width 1's without speculation."""
    tokens, scored, accepted = width2[2]
    single = load_model(str(small_gguf), "q4")
    assert tokens == tp_driver.greedy(single, PROMPTS[:2], 12)
    assert scored > 0 and accepted > 0
