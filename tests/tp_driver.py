"""Rank 0 of a real tensor-parallel group, run in a process of its own by the tests: it starts
its followers (``tp_follower.start_group``), then for each model folder (``load_sharded``) computes a
batched prefill's logits through the paged cache and the engine's greedy tokens, and sends them
back over a queue. A module of its own (not the test file) so the spawned process imports no
pytest fixtures."""

from __future__ import annotations

import logging
import traceback
from multiprocessing.queues import Queue
from typing import Any

import torch

BLOCK = 4


def prefill_logits(loaded: Any, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All prompts in one batched prefill through the paged cache (as ``ModelRunner.execute``
    runs a step: rank 0 hands the plan to its followers first); each prompt's logits."""
    from services.engine.core.attention import AttentionMetadata
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.tp_group import STEP

    engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK, num_blocks=64))  # sends the pool
    runner = engine.runner
    lengths = [len(p) for p in prompts]
    tables, next_id = [], 1
    for n in lengths:  # interleaved block ids: a wrong table shows in the logits
        tables.append([next_id + len(lengths) * i for i in range(-(-n // BLOCK))])
        next_id += 1
    ids = [t for p in prompts for t in p]
    positions = [i for n in lengths for i in range(n)]
    if runner.tp is not None:
        runner.tp.send(STEP, True, ids, positions, lengths, lengths, tables, None)
    meta = AttentionMetadata.build(is_prefill=True, query_lens=lengths, context_lens=lengths,
                                   block_tables=tables, block_size=BLOCK)  # fmt: skip
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.tensor(positions), runner.kv, meta)
        logits = loaded.model.compute_logits(hidden)
    return list(logits.split(lengths))


def greedy(loaded: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The engine's greedy tokens (prefill, then paged decode steps)."""
    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine

    engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK, num_blocks=128))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [out.new_token_ids for out in engine.generate(prompts, params)]


def run_rank0(jobs: list[tuple[str, str]], world: int, prompts: list[list[int]],
              gen_prompts: list[list[int]], max_tokens: int, results: Queue) -> None:  # fmt: skip
    """Start a ``world``-wide group; for each ``(model folder, dtype)`` (loaded one after another
    by every rank) put ``("ok", job, logits, tokens)`` on ``results``, or ``("error", job,
    text)`` and stop."""
    logging.basicConfig(level=logging.WARNING)
    from services.engine.core.tp_follower import ShardSource, load_sharded, start_group

    group = None
    job = ("", "")
    try:
        group = start_group(world, timeout_s=30)
        for job in jobs:
            loaded = load_sharded(group, ShardSource(*job))
            logits = prefill_logits(loaded, prompts)
            tokens = greedy(loaded, gen_prompts, max_tokens)
            results.put(("ok", job, [t.clone() for t in logits], tokens))
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        results.put(("error", job, traceback.format_exc()))
    finally:
        if group is not None:
            group.close()


def run_kv_roundtrip(folder: str, world: int, results: Queue) -> None:
    """Rank 0 of a ``world``-wide group over ``folder``: write a random whole-width payload into
    three blocks through the hand-off's view of every rank's pool (in chunks that cut blocks, and
    whole), read it back (the same two ways), and put ``("ok", payload, read_whole, read_cut,
    rank 0's pool blocks, rank 0's KV head run)`` (or ``("error", text)``) on ``results``."""
    logging.basicConfig(level=logging.WARNING)
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.tp_follower import ShardSource, start_tensor_parallel
    from services.engine.core.tp_kv import FullWidthKV
    from services.engine.kv_transfer.payload import handoff_pool, read_payload, write_payload

    loaded = None
    try:
        loaded = start_tensor_parallel(ShardSource(folder), world, timeout_s=30)
        engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK, num_blocks=16))
        view = handoff_pool(engine)
        assert isinstance(view, FullWidthKV)
        blocks, size = [3, 9, 5], view.layout.block_bytes
        payload = torch.randint(0, 256, (3 * size,), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(1)).numpy().tobytes()
        cut = [0, size // 3, size + 5, 2 * size + 1, 3 * size]  # chunks that cut blocks
        for start, end in zip(cut, cut[1:]):
            write_payload(view, blocks, start, payload[start:end])
        whole = read_payload(view, blocks, 0, 3 * size)
        parts = b"".join(read_payload(view, blocks, a, b - a) for a, b in zip(cut, cut[1:]))
        write_payload(view, blocks, 0, payload)  # whole blocks: the same bytes again
        again = read_payload(view, blocks, 0, 3 * size)
        assert again == whole
        mine = engine.kv.read_blocks(blocks).clone()
        results.put(("ok", payload, whole, parts, mine, view.runs[0]))
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        results.put(("error", traceback.format_exc()))
    finally:
        if loaded is not None and loaded.sharding is not None:
            loaded.sharding.group.close()
