"""Rank 0 of a real tensor-parallel group for the quantized, embedding and draft-model tests
(``tests/test_tensor_parallel_quantized.py``), run in a process of its own: it starts its
followers once, then runs each task on the model it names (every rank loads its shard) and sends
the result back over a queue. A module of its own (not the test file) so the spawned process
imports no pytest fixtures."""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from multiprocessing.queues import Queue
from typing import Any

import torch

from tests.tp_driver import greedy, prefill_logits


@dataclass(frozen=True, slots=True)
class Task:
    """One thing to compute at width ``world`` on ``model`` in ``dtype``: ``"logits"`` (the
    prompts' batched prefill logits and the engine's greedy tokens), ``"embed"`` (the pooled
    final hidden states of the prompts through :class:`Embedder`) or ``"draft"`` (the greedy
    tokens with ``--speculative draft``, the draft ``draft`` loaded whole in this process)."""

    what: str
    model: str
    dtype: str
    prompts: list[list[int]]
    max_tokens: int = 8
    draft: str | None = None


def embed(loaded: Any, inputs: list[list[int]], pooling: str) -> list[torch.Tensor]:
    """Each input's pooled final hidden state through the engine's embedder (one wave over a
    small token budget, so long inputs run chunked over several passes)."""
    from services.engine.core.embedder import Embedder
    from services.engine.core.engine import EngineConfig, LLMEngine

    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=64))
    embedder = Embedder(loaded.model, engine.kv, engine.block_manager, pooling=pooling,
                        max_num_batched_tokens=8)  # fmt: skip
    got: list[torch.Tensor] = []
    while len(got) < len(inputs):
        got.extend(embedder.run(inputs[len(got) :]))
    assert engine.block_manager.num_blocks_in_use == 0
    return got


def greedy_with_draft(loaded: Any, draft_model: str, dtype: str, prompts: list[list[int]],
                      max_tokens: int) -> tuple[list[list[int]], int, int]:  # fmt: skip
    """Greedy tokens with a draft model (loaded whole here) proposing 4 tokens a step; also the
    draft tokens scored and accepted (proof the drafts were verified by the split target)."""
    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model
    from services.engine.core.speculative import SpeculativeConfig

    draft = load_model(draft_model, dtype)
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=4, draft_model=draft_model)
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=128, speculative=spec),
                       draft=draft)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens = [out.new_token_ids for out in engine.generate(prompts, params)]
    stats = engine.spec.stats
    return tokens, stats.num_draft_tokens, stats.num_accepted_tokens


def run(task: Task, loaded: Any) -> Any:
    if task.what == "logits":
        logits = prefill_logits(loaded, task.prompts)
        return [t.clone() for t in logits], greedy(loaded, task.prompts, task.max_tokens)
    if task.what == "embed":
        return {pooling: embed(loaded, task.prompts, pooling) for pooling in ("last", "mean")}
    if task.what == "draft":
        assert task.draft is not None
        return greedy_with_draft(loaded, task.draft, task.dtype, task.prompts, task.max_tokens)
    raise ValueError(f"unknown task {task.what!r}")


def run_rank0(tasks: list[Task], world: int, results: Queue) -> None:
    """Start a ``world``-wide group; for each task put ``("ok", index, result)`` on
    ``results``, or ``("error", index, text)`` and stop. A task on the model and dtype of the
    one before it reuses its shards."""
    logging.basicConfig(level=logging.WARNING)
    from services.engine.core.tp_follower import ShardSource, load_sharded, start_group

    group = None
    index, loaded, source = -1, None, None
    try:
        group = start_group(world, timeout_s=60)
        for index, task in enumerate(tasks):
            if source != (task.model, task.dtype):
                loaded = None
                loaded = load_sharded(group, ShardSource(task.model, task.dtype))
                source = (task.model, task.dtype)
            results.put(("ok", index, run(task, loaded)))
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        results.put(("error", index, traceback.format_exc()))
    finally:
        if group is not None:
            group.close()
