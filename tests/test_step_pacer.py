"""Step pacing (services/engine/core/step_pacer.py): a prompt chunk's multiply-adds from the model's
shape, the speed the pacer learns from timed steps, and the engine giving prompt chunks beside a
decoding stream only the tokens that fit the step time target — with the same greedy tokens as an
unpaced engine."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from services.common.errors import InvalidArgumentError
from services.common.model_config import ModelConfig
from services.common.sampling_params import SamplingParams
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import load_model
from services.engine.core.scheduler import ScheduledBatch
from services.engine.core.step_pacer import MIN_CHUNK, ChunkCost, StepPacer
from services.engine.runtime.worker_options import (
    DEFAULT_MAX_STEP_MS,
    add_worker_arguments,
    options_from_args,
)
from tests.tls_identities import tls_flags


@pytest.fixture(scope="module")
def tiny_config() -> ModelConfig:
    return load_model("dummy:tiny").config


def test_a_chunks_cost_is_its_projections_mlp_and_the_keys_each_token_sees(
    tiny_config: ModelConfig,
) -> None:
    cfg = tiny_config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    linear = cfg.num_layers * (cfg.hidden_size * (2 * q + 2 * kv)
                               + 3 * cfg.hidden_size * cfg.intermediate_size)  # fmt: skip
    cost = ChunkCost.of(cfg)
    assert cost.linear == linear and cost.attention == cfg.num_layers * 2 * q
    for tokens, context in [(1, 0), (7, 0), (5, 100), (64, 33)]:
        keys = sum(context + i for i in range(1, tokens + 1))
        assert cost.work(tokens, context) == pytest.approx(tokens * linear + cost.attention * keys)
    assert cost.work(0, 50) == 0
    # later in a prompt, the same work buys fewer tokens
    budget = cost.work(40, 0)
    assert cost.tokens_within(budget, 0, 1000) == 40
    assert cost.tokens_within(budget, 2000, 1000) < 40
    assert cost.tokens_within(budget, 0, 25) == 25  # never past the limit
    assert cost.tokens_within(0.5 * linear, 0, 1000) == 0


def test_sliding_layers_see_at_most_their_window(tiny_config: ModelConfig) -> None:
    cfg = dataclasses.replace(tiny_config, sliding_window=8, layer_types=("sliding_attention",
                                                                           "full_attention"))
    assert cfg.is_sliding(0) and not cfg.is_sliding(1)
    cost = ChunkCost.of(cfg)
    per_layer = 2 * cfg.num_heads * cfg.head_dim
    assert cost.attention == per_layer and cost.sliding_attention == per_layer
    for tokens, context in [(3, 0), (10, 0), (4, 6), (5, 20), (1, 7)]:
        full = sum(context + i for i in range(1, tokens + 1))
        window = sum(min(context + i, 8) for i in range(1, tokens + 1))
        want = tokens * cost.linear + per_layer * (full + window)
        assert cost.work(tokens, context) == pytest.approx(want)


def test_the_pacer_learns_the_speed_and_the_decode_part(tiny_config: ModelConfig) -> None:
    cost = ChunkCost.of(tiny_config)
    pacer = StepPacer(cost, target_seconds=0.1)
    room = pacer.room()
    assert room.take(500, 0) == MIN_CHUNK  # no speed known yet: the first chunk sets it
    assert room.exhausted and room.take(500, 0) == 0
    for _ in range(5):
        pacer.observe([], True, 0.010)
    pacer.observe([], True, 1.2)  # one step slowed by something else: the median holds
    pacer.observe([], False, 5.0)  # no decode rows, no prompt: not a decode step
    assert pacer.decode_seconds == pytest.approx(0.010)
    pacer.observe([(100, 0)], True, 0.110)  # 0.1 s of it the chunk's own
    rate = cost.work(100, 0) / 0.100
    assert pacer.rate == pytest.approx(rate)
    room = pacer.room()
    assert room.work == pytest.approx(0.090 * rate)
    first = room.take(1000, 0)
    assert first == cost.tokens_within(0.090 * rate, 0, 1000) and MIN_CHUNK < first < 100
    assert room.take(1000, 0) <= 1  # what is left after the first chunk
    pacer.observe([(50, 0)], False, cost.work(50, 0) / (2 * rate))  # twice as fast, no decode
    assert pacer.rate == pytest.approx(rate * 1.3)  # averaged in
    with pytest.raises(ValueError):
        StepPacer(cost, 0)


def test_the_speed_is_per_thread_so_a_step_with_fewer_threads_gets_less(
    tiny_config: ModelConfig,
) -> None:
    cost, threads = ChunkCost.of(tiny_config), [2]
    pacer = StepPacer(cost, target_seconds=0.1, threads=lambda: threads[0])
    pacer.observe([(100, 0)], False, 0.05)  # learnt with two threads (cores shared step by step)
    assert pacer.rate == pytest.approx(cost.work(100, 0) / 0.05 / 2)
    assert pacer.room().work == pytest.approx(2 * cost.work(100, 0))
    threads[0] = 1  # the next step runs one thread beside a busy peer: half the room
    assert pacer.room().work == pytest.approx(cost.work(100, 0))


def _chunks(engine: LLMEngine) -> list[list[tuple[str, int]]]:
    """Records every step's (request, tokens) as the engine's scheduler picks them."""
    record: list[list[tuple[str, int]]] = []
    schedule = engine.scheduler.schedule

    def recording() -> ScheduledBatch | None:
        batch = schedule()
        if batch is not None:
            record.append([(i.seq.request_id, i.num_new_tokens) for i in batch.items])
        return batch

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return record


def test_prompt_chunks_beside_a_stream_fit_the_step_target_and_give_the_same_tokens() -> None:
    loaded = load_model("dummy:tiny")
    stream = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    long_params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    long_prompt = [(7 * i) % 500 + 3 for i in range(300)]

    def run(max_step_ms: float | None) -> tuple[dict[str, list[int]], list, LLMEngine]:
        engine = LLMEngine(loaded, EngineConfig(num_blocks=64, max_num_batched_tokens=128,
                                                max_step_ms=max_step_ms))  # fmt: skip
        if engine.pacer is not None:  # a fixed speed: 0.1 s of work is 40 tokens from the start
            engine.pacer.rate = engine.pacer.cost.work(40, 0) / 0.1 / engine.pacer.threads()
            engine.pacer.observe = lambda *args: None  # type: ignore[method-assign]
        steps = _chunks(engine)
        tokens: dict[str, list[int]] = {"s": [], "long": []}
        engine.add_request("s", [5, 6, 7], stream)
        outs = engine.step()  # the stream's prompt, alone: unpaced
        engine.add_request("long", long_prompt, long_params)
        while engine.has_unfinished():
            outs += engine.step()
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
        assert engine.block_manager.num_blocks_in_use == 0
        return tokens, steps, engine

    unpaced, unpaced_steps, _ = run(None)
    paced, steps, engine = run(100.0)
    assert paced == unpaced and len(paced["s"]) == 40 and len(paced["long"]) == 3
    assert [n for rid, n in unpaced_steps[1] if rid == "long"] == [128 - 1]  # the token budget
    cost, done, seen = engine.pacer.cost, 0, 0
    for step in steps[1:]:
        long_tokens = sum(n for rid, n in step if rid == "long")
        if not long_tokens or done >= len(long_prompt):
            continue
        if any(rid == "s" for rid, _ in step):  # beside the stream: what fits 0.1 s
            limit = min(127, len(long_prompt) - done)
            assert long_tokens == max(cost.tokens_within(cost.work(40, 0), done, limit),
                                      min(limit, MIN_CHUNK))
            seen += 1
        done += long_tokens
    assert seen >= 5 and done == len(long_prompt)


def test_workers_pace_by_default_and_the_flag_sets_or_clears_it() -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, port=0, metrics_port=0)

    def config(*flags: str) -> EngineConfig:
        args = parser.parse_args(["--device", "cpu", *flags, *tls_flags("decode")])
        return options_from_args(args, "decode").engine_config()

    assert config().max_step_ms == DEFAULT_MAX_STEP_MS
    assert config("--max-step-ms", "80").max_step_ms == 80
    assert config("--max-step-ms", "0").max_step_ms is None  # the token budget alone
    for bad in ("-1", "nan"):
        with pytest.raises(InvalidArgumentError, match="max-step-ms"):
            config("--max-step-ms", bad)
    assert LLMEngine(load_model("dummy:tiny"), EngineConfig(num_blocks=8)).pacer is None
