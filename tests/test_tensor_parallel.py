"""Tensor parallelism (issue 48) over real processes and real Gloo: every dense family Tandem runs
(and Qwen3-MoE, whose experts run replicated) split over 2 ranks of one core each, against
Hugging Face transformers on the same random weights in float32, and against Tandem at width 1.

Per family, rank 0 runs in a process of its own (``tests/tp_driver.py``) and spawns its follower
as a worker does (``tp_follower.start_tensor_parallel``, ranks pinned to disjoint cores):

* a batched prefill of prompts of different lengths (some longer than Gemma's sliding window)
  through the paged caches gives each prompt's logits within 1e-4 of transformers' and of
  width 1's;
* the engine's greedy tokens (prefill, then paged decode steps) equal transformers' ``generate``
  and width 1's.

The families cover what the split must get right: GQA heads split evenly (2 KV heads over 2 ranks),
a single KV head replicated on both ranks with an odd vocabulary (its last shard padded), a q/k/v
bias (Qwen2), q/k norms (Qwen3, Gemma 3), Phi-3's fused ``qkv_proj`` and ``gate_up_proj``, Gemma's
soft-caps, sliding windows and tied embeddings, and routed experts.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.errors import InvalidArgumentError
from services.common.model_config import ModelConfig
from services.engine.core.loaders import load_model
from services.engine.core.tp_follower import rank_cores
from services.engine.core.tp_shard import ShardSizes
from tests import tp_driver
from tests.test_model_families import FAMILIES as OTHER_FAMILIES
from tests.test_model_families import _tiny

pytestmark = pytest.mark.slow

ATOL = 1e-4
MAX_TOKENS = 8
PROMPTS = [[5, 17, 42, 99, 3, 8, 150, 7, 77, 31, 64, 12, 9], [9, 4, 200], [33]]
GEN_PROMPTS = [[5, 17, 42, 99, 3, 8, 150, 7, 77, 31, 64], [9, 4, 200]]


def _llama_mqa(t: Any, head_dim: int) -> Any:
    """One KV head (replicated on both ranks) and an odd vocabulary (the last shard padded)."""
    kw = _tiny(head_dim)
    kw.update(num_key_value_heads=1, vocab_size=251)
    return t.LlamaForCausalLM(t.LlamaConfig(**kw, tie_word_embeddings=False))


def _qwen2(t: Any, head_dim: int) -> Any:
    """Q/K/V biases, split with their rows; tied embeddings."""
    kw = _tiny(head_dim)
    kw.pop("head_dim")
    return t.Qwen2ForCausalLM(t.Qwen2Config(**kw, tie_word_embeddings=True))


FAMILIES: dict[str, Callable[[Any, int], Any]] = {
    "llama": _llama_mqa,
    "qwen2": _qwen2,
    **{name: build for name, (build, _, _) in OTHER_FAMILIES.items()},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each family's tiny random checkpoint, saved by transformers, and the reference model."""
    import transformers

    made = {}
    for name, build in FAMILIES.items():
        torch.manual_seed(7)
        ref = build(transformers, 16).eval()
        folder = tmp_path_factory.mktemp(f"tp-{name}")
        ref.save_pretrained(folder, safe_serialization=True)
        made[name] = (folder, ref)
    return made


HALF = ("qwen3", "bfloat16")  # CPU's weight-only 16-bit format, split before it is packed


@pytest.fixture(scope="module")
def width2(checkpoints: dict[str, tuple[Path, Any]]) -> dict[tuple[str, str], Any]:
    """Every family's logits and greedy tokens at width 2 in float32 (and one in bfloat16): one
    real 2-rank group (rank 0 in a process of its own, its follower spawned by it) loads the
    models one after another."""
    runs = [(name, "float32") for name in checkpoints] + [HALF]
    jobs = [(str(checkpoints[name][0]), dtype) for name, dtype in runs]
    context = mp.get_context("spawn")
    results = context.Queue()
    driver = context.Process(target=tp_driver.run_rank0,
                             args=(jobs, 2, PROMPTS, GEN_PROMPTS, MAX_TOKENS, results))  # fmt: skip
    driver.start()
    found = {}
    try:
        for _ in jobs:
            outcome = results.get(timeout=120)
            assert outcome[0] == "ok", f"{outcome[1]}: {outcome[2]}"
            found[tuple(outcome[1])] = (outcome[2], outcome[3])
    finally:
        driver.join(30)
        if driver.is_alive():
            driver.kill()
    assert driver.exitcode == 0
    return {run: found[job] for run, job in zip(runs, jobs, strict=True)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, checkpoints: dict[str, tuple[Path, Any]],
           width2: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """A family's transformers, width-1 and width-2 logits and greedy tokens."""
    name = request.param
    folder, ref = checkpoints[name]
    with torch.no_grad():
        expected_logits = [ref(torch.tensor([p])).logits[0] for p in PROMPTS]
        expected_tokens = [
            ref.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(p) :].tolist()
            for p in GEN_PROMPTS
        ]  # fmt: skip
    single = load_model(str(folder), torch.float32)
    width1 = (tp_driver.prefill_logits(single, PROMPTS),
              tp_driver.greedy(single, GEN_PROMPTS, MAX_TOKENS))  # fmt: skip
    return dict(name=name, expected=(expected_logits, expected_tokens), width1=width1,
                width2=width2[(name, "float32")])


def test_tp2_logits_match_transformers_and_width1(family: dict[str, Any]) -> None:
    expected, _ = family["expected"]
    width1, _ = family["width1"]
    width2, _ = family["width2"]
    for want, one, two in zip(expected, width1, width2, strict=True):
        assert two.abs().max() > 0.05  # real signal, not a vanishing model
        assert two.shape == want.shape
        torch.testing.assert_close(two, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(two, one, atol=ATOL, rtol=0)


def test_tp2_greedy_tokens_match_transformers_and_width1(family: dict[str, Any]) -> None:
    _, expected = family["expected"]
    _, width1 = family["width1"]
    _, width2 = family["width2"]
    assert width2 == expected
    assert width2 == width1


def test_tp2_16bit_weights_match_width1(checkpoints: dict[str, tuple[Path, Any]],
                                        width2: dict[tuple[str, str], Any]) -> None:  # fmt: skip
    """bfloat16 weights (CPU: weight-only, float32 activations) are split before they are
    packed: width 2 gives width 1's logits (to summation order) and tokens."""
    name, dtype = HALF
    single = load_model(str(checkpoints[name][0]), dtype)
    logits, tokens = width2[HALF]
    for one, two in zip(tp_driver.prefill_logits(single, PROMPTS), logits, strict=True):
        torch.testing.assert_close(two, one, atol=ATOL, rtol=0)
    assert tokens == tp_driver.greedy(single, GEN_PROMPTS, MAX_TOKENS)


def _config(**changes: Any) -> ModelConfig:
    base = ModelConfig(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, rms_norm_eps=1e-6,
                       rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    return ModelConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **changes})


def test_shard_sizes_split_replicate_and_refuse() -> None:
    """Heads and MLP columns split evenly, KV heads replicated where the width exceeds them, the
    vocabulary padded; a model that does not split is refused naming the flag."""
    even = [ShardSizes.of(_config(), r, 2) for r in range(2)]
    assert [(s.heads, s.kv_heads, s.kv_start, s.intermediate, s.vocab) for s in even] == [
        (4, 2, 0, 64, 50), (4, 2, 2, 64, 50)]  # fmt: skip
    wide = [ShardSizes.of(_config(num_kv_heads=2, vocab_size=101), r, 8) for r in range(8)]
    assert [s.kv_start for s in wide] == [0, 0, 0, 0, 1, 1, 1, 1]  # each KV head on 4 ranks
    assert {s.vocab for s in wide} == {13}  # ceil(101 / 8), the last run padded
    for bad, why in (({"num_heads": 6}, "attention heads"), ({"num_kv_heads": 3}, "KV heads"),
                     ({"intermediate_size": 102}, "MLP")):  # fmt: skip
        with pytest.raises(InvalidArgumentError, match=f"--tensor-parallel-size 4.*{why}"):
            ShardSizes.of(_config(**bad), 0, 4)


def test_rank_cores_are_disjoint() -> None:
    assert rank_cores(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert rank_cores(3, [4, 5]) == [[4], [5], [4]]  # fewer cores than ranks: shared round-robin


def test_tandem_up_passes_the_width_to_colocated_decode_workers() -> None:
    """``tandem up --mode colocated --tensor-parallel-size 2`` gives every decode worker the flag
    (disaggregated widths: tests/test_tensor_parallel_deploy.py)."""
    from services.launch_plan import LaunchConfig, plan

    specs = plan(LaunchConfig(mode="colocated", num_prefill=0, num_decode=2, gateway=False,
                              tensor_parallel_size=2))  # fmt: skip
    decode = [s.argv for s in specs if s.service == "decode"]
    assert len(decode) == 2
    assert all(a[a.index("--tensor-parallel-size") + 1] == "2" for a in decode)
    plain = plan(LaunchConfig(mode="colocated", num_prefill=0, num_decode=1, gateway=False))
    assert all("--tensor-parallel-size" not in s.argv for s in plain)
