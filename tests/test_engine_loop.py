"""The engine loop (``EngineLoop``): the asyncio face of one engine thread, that the KV hand-off
and every worker stream through — a cancelled consumer frees its blocks, the engine is built on
(and a failed or cancelled build reported from) the loop's own thread, concurrent requests share
one batch, and queued prompts prefill in one forward pass."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.common.errors import ModelLoadError, UnavailableError
from services.common.sampling_params import SamplingParams
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.runtime.engine_loop import EngineLoop
from tests.test_kv_transfer import GREEDY, prompt_of, wait_until


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("dummy:tiny")


async def test_engine_loop_cancelled_consumer_frees_blocks(tiny: LoadedModel) -> None:
    loop = EngineLoop(LLMEngine(tiny, EngineConfig(num_blocks=32)))
    loop.start()
    started = asyncio.Event()

    async def consume(params: SamplingParams, prefill_only: bool) -> None:
        async for _ in loop.generate("c", prompt_of(40), params, prefill_only=prefill_only):
            started.set()
            await asyncio.sleep(10)  # the consumer is slow and then cancelled

    try:
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        task = asyncio.create_task(consume(long, False))
        await asyncio.wait_for(started.wait(), 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_until(lambda: loop.stats.num_blocks_in_use == 0 and loop.stats.num_running == 0)
        # A prefill-only consumer that received its last output owns the held blocks ...
        started.clear()
        task = asyncio.create_task(consume(GREEDY, True))
        await asyncio.wait_for(started.wait(), 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_until(lambda: loop.stats.num_held_requests == 1)
        # ... until it releases them (exactly once).
        assert await loop.release("c") is True
        assert await loop.release("c") is False
        await wait_until(lambda: loop.stats.num_blocks_in_use == 0)
    finally:
        await loop.stop()


async def test_engine_loop_builds_its_engine_on_its_own_thread(tiny: LoadedModel) -> None:
    # One thread does all of a worker's torch work: a second OpenMP team (weights loaded on the
    # main thread, steps on another) made every served decode step ~3x slower.
    built_on: list[threading.Thread] = []

    def build() -> tuple[LLMEngine, None]:
        built_on.append(threading.current_thread())
        return LLMEngine(tiny, EngineConfig(num_blocks=32)), None

    loop = await EngineLoop.build_and_start(build, name="engine-test")
    try:
        assert built_on[0] is not threading.current_thread()
        assert await loop.call(lambda engine: threading.current_thread()) is built_on[0]
        outs = [out async for out in loop.generate("t", prompt_of(10), GREEDY)]
        assert sum(len(out.new_token_ids) for out in outs) == GREEDY.max_tokens
    finally:
        await loop.stop()
    assert not built_on[0].is_alive()


async def test_engine_loop_build_failure_reaches_the_caller() -> None:
    def build() -> tuple[LLMEngine, None]:
        raise ModelLoadError("no weights here")

    with pytest.raises(ModelLoadError, match="no weights here"):
        await EngineLoop.build_and_start(build)


async def test_engine_loop_cancelled_while_building_stops_once_built(tiny: LoadedModel) -> None:
    release = threading.Event()
    built_on: list[threading.Thread] = []

    def build() -> tuple[LLMEngine, None]:
        built_on.append(threading.current_thread())
        release.wait(10)
        return LLMEngine(tiny, EngineConfig(num_blocks=32)), None

    task = asyncio.create_task(EngineLoop.build_and_start(build))
    await wait_until(lambda: bool(built_on))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    await asyncio.to_thread(built_on[0].join, 10)
    assert not built_on[0].is_alive()


async def test_engine_loop_batches_concurrent_requests(tiny: LoadedModel) -> None:
    loop = EngineLoop(LLMEngine(tiny, EngineConfig(num_blocks=64)))
    loop.start()

    async def run(i: int) -> list[int]:
        tokens: list[int] = []
        async for out in loop.generate(f"b{i}", prompt_of(10, i), GREEDY):
            tokens += out.new_token_ids
        return tokens

    try:
        results = await asyncio.gather(*(run(i) for i in range(4)))
        assert all(len(tokens) == GREEDY.max_tokens for tokens in results)
        assert loop.stats.max_batch_size == 4
    finally:
        await loop.stop()
    with pytest.raises(UnavailableError):
        await loop.call(lambda engine: None)



async def test_queued_prompts_prefill_in_one_forward_pass(tiny: LoadedModel) -> None:
    loop = EngineLoop(LLMEngine(tiny, EngineConfig(num_blocks=64, max_num_batched_tokens=1024)))
    loop.start()

    async def prefill(i: int) -> list[int]:
        outs = [out async for out in loop.generate(f"p{i}", prompt_of(30, i), GREEDY,
                                                   prefill_only=True)]
        return outs[-1].block_ids

    try:
        # Hold the engine thread so that all four prompts are queued before the next step.
        blocker = asyncio.ensure_future(loop.call(lambda engine: time.sleep(0.3)))
        await asyncio.sleep(0.05)
        steps_before = loop.stats.num_steps
        tables = await asyncio.gather(*(prefill(i) for i in range(4)))
        await blocker
        assert loop.stats.num_steps - steps_before == 1
        assert loop.stats.max_batch_size == 4
        assert all(len(table) == 2 for table in tables)
        for i in range(4):
            assert await loop.release(f"p{i}")
        await wait_until(lambda: loop.stats.num_blocks_in_use == 0)
    finally:
        await loop.stop()
