"""Structured-output compilation off the gateway's event loop (issue 47, item 5): the grammar
worker pool (real ``spawn`` processes running llguidance), its time and size budgets and its
cache, and the real gateway on 127.0.0.1 serving a plain request promptly while many distinct
large schemas compile at once.

The real ITL figure is a benchmark's (bench/grammar_flood.py); here the event loop's own lag is
measured, a plain request's latency and a concurrent stream's ITL p50 (loosely: fake workers
emitting a token every 10 ms), with generous bounds for a shared 2-core machine.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from typing import Any

import pytest

from services.common.errors import InvalidArgumentError
from services.common.grammar_cache import GrammarCache, grammar_key
from services.common.sampling_params import MAX_GRAMMAR_BYTES
from services.gateway.grammar_pool import GrammarPool
from services.gateway.state import STATE_KEY
from services.gateway.structured_outputs import (
    GrammarSource,
    compile_source,
    structured_output_source,
)
from tests.gateway_fakes import (  # noqa: F401 - make_stack is a fixture
    MODEL,
    StackFactory,
    make_stack,
    post_raw,
)


def big_schema(seed: int, fields: int) -> dict[str, Any]:
    """A distinct JSON schema of ``fields`` patterned string properties (~60 bytes each)."""
    return {"type": "object", "required": [f"s{seed}_0"], "properties": {
        f"s{seed}_{k}": {"type": "string", "pattern": f"^[a-z]{{{k % 7 + 1}}}[0-9]+{seed}$"}
        for k in range(fields)}}  # fmt: skip


def _source(schema: dict[str, Any]) -> GrammarSource:
    source = structured_output_source({"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})  # fmt: skip
    assert source is not None
    return source


def _slow_lark_source(tag: str) -> GrammarSource:
    """~250 KB of Lark (distinct per ``tag``, under the 256 KB limit): 0.7 s to compile on an idle
    Zen 3 core, 0.15-0.18 s on a Zen 4, more on a busy one."""
    lark = "start: " + " | ".join(f'"{tag}w{i}" {tag}x{i}' for i in range(7000)) + "\n" + (
        "\n".join(f'{tag}x{i}: "{tag}q{i}"+' for i in range(7000)))
    source = structured_output_source({"guided_grammar": lark})
    assert source is not None
    return source


async def test_the_pool_compiles_caches_and_refuses() -> None:
    pool = GrammarPool(workers=1, timeout_s=30.0)
    try:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        grammar = await pool.compile(_source(schema))
        assert grammar == compile_source(_source(schema))  # what the worker ran
        # key order does not matter: one cache entry, no second compilation
        same = {"properties": {"a": {"type": "integer"}}, "type": "object"}
        assert await pool.compile(_source(same)) == grammar and pool.compiled == 1
        bad = structured_output_source({"structured_outputs": {"regex": "a(b"}})
        assert bad is not None
        for _ in range(2):  # the 400 is cached too
            with pytest.raises(InvalidArgumentError) as err:
                await pool.compile(bad)
            assert err.value.param == "structured_outputs"
        assert pool.compiled == 2
    finally:
        await pool.close()


async def test_a_compilation_past_the_time_budget_is_400_and_others_still_compile() -> None:
    # the budget: well under the slow grammar's compile (0.7 s on a Zen 3 core, 0.15-0.18 s on a
    # Zen 4's), well over a small schema's (milliseconds)
    pool = GrammarPool(workers=1, timeout_s=0.05)
    slow = _slow_lark_source("a")
    try:
        await pool.compile(_source({"type": "integer"}))  # the worker is up
        small = _source({"type": "string"})
        results = await asyncio.gather(pool.compile(slow), pool.compile(small),
                                       return_exceptions=True)  # fmt: skip
        assert isinstance(results[0], InvalidArgumentError), type(results[0])
        assert results[0].code == "grammar_too_complex" and results[0].param == "guided_grammar"
        # queued behind the slow one, then handed to the new pool with a fresh clock
        assert isinstance(results[1], str), results[1]
        assert pool.restarts == 1
        started = time.monotonic()  # the refusal is cached: no second restart
        with pytest.raises(InvalidArgumentError):
            await pool.compile(slow)
        assert time.monotonic() - started < 0.1 and pool.restarts == 1
    finally:
        await pool.close()


async def test_a_queued_compilation_whose_clients_went_away_is_dropped() -> None:
    """Send a schema and hang up: before a worker takes it, the compilation (and the schema it
    holds, its body's lease already given back) is forgotten; a source another request still
    waits for stays."""
    pool = GrammarPool(workers=1, timeout_s=30.0)
    try:
        await pool.compile(_source({"type": "integer"}))  # the worker is up
        busy = asyncio.ensure_future(pool.compile(_slow_lark_source("b")))
        await asyncio.sleep(0.01)  # handed to the one worker
        gone = asyncio.ensure_future(pool.compile(_source(big_schema(6, 1500))))
        shared = _source({"type": "boolean"})
        kept = [asyncio.ensure_future(pool.compile(shared)) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert pool.pending == 3
        gone.cancel()
        kept[0].cancel()
        await asyncio.gather(gone, kept[0], return_exceptions=True)
        assert pool.pending == 2
        assert isinstance(await kept[1], str) and isinstance(await busy, str)
        assert pool.pending == 0 and pool.compiled == 3  # big_schema(6, ...) never compiled
    finally:
        await pool.close()


def test_the_size_budget_is_checked_before_compiling() -> None:
    too_big = {"enum": ["x" * 1000] * (MAX_GRAMMAR_BYTES // 1000 + 1)}
    for body in ({"guided_json": too_big}, {"guided_json": json.dumps(too_big)},
                 {"guided_regex": "a" * (MAX_GRAMMAR_BYTES + 1)},
                 {"guided_choice": ["c" * 1000] * (MAX_GRAMMAR_BYTES // 1000 + 1)}):  # fmt: skip
        with pytest.raises(InvalidArgumentError) as err:
            structured_output_source(body)
        assert "too large" in err.value.message


def test_the_shared_cache_is_bounded() -> None:
    cache: GrammarCache[str] = GrammarCache(2, max_bytes=10)
    cache.put("a", "x", 4)
    cache.put("b", "y", 4)
    assert cache.get("a") == "x"  # a is now the most recent
    cache.put("c", "z", 4)  # over 10 bytes: b (least recent) goes
    assert cache.get("b") is None and cache.get("a") == "x" and cache.get("c") == "z"
    cache.put("huge", "w", 11)  # larger than the cache: not kept
    assert cache.get("huge") is None and len(cache) == 2
    assert grammar_key("g") == grammar_key("g") != grammar_key("h")


async def test_distinct_large_schemas_do_not_block_the_event_loop(
    make_stack: StackFactory, request: pytest.FixtureRequest
) -> None:
    stack = await make_stack(grammar_workers=2, grammar_timeout_s=60.0)
    pool = stack.app[STATE_KEY].grammars
    await pool.compile(_source({"type": "integer"}))  # workers started (spawn takes a moment)
    lags: list[float] = []
    stop = asyncio.Event()

    async def watch_loop() -> None:  # how late a 10 ms sleep wakes: the event loop's lag
        while not stop.is_set():
            before = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - before - 0.01)

    url = stack.url + "/v1/chat/completions"
    flood = [
        post_raw(url, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {
                           "name": f"s{i}", "schema": big_schema(i, 1600)}}})  # ~100 KB each
        for i in range(48)  # 16 were all compiled within the first 0.3 s on a Zen 4
    ]  # fmt: skip
    stack.decodes[0].token_delay = 0.01  # a token every 10 ms: the stream's ITL floor
    client = stack.client()  # the SDK imports its parts on first use: not while measuring
    await client.chat.completions.create(model=MODEL, max_tokens=1,
                                         messages=[{"role": "user", "content": "hi"}])
    # The suite's own heap (a thousand tests' objects in this process) would make one of the
    # collector's full passes a stall of this loop that the gateway, alone in its process, never
    # has: the lag measured is the gateway's, so the test's older objects are left out of it.
    gc.collect()
    gc.freeze()
    request.addfinalizer(gc.unfreeze)
    flooding = asyncio.gather(*flood)
    await asyncio.sleep(0.3)  # the bodies are read and the compilations running
    watcher = asyncio.create_task(watch_loop())
    latencies = []
    for _ in range(3):
        started = time.monotonic()
        status, raw, _ = await post_raw(url, {"model": MODEL, "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "hi"}]})
        latencies.append(time.monotonic() - started)
        assert status == 200, raw
    arrivals = []  # a concurrent stream's chunks (one token each): its ITL, loosely
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
    busy = pool.pending  # compilations still running while the plain requests were served
    stop.set()
    await watcher
    results = await flooding
    assert all(status == 200 for status, _, _ in results), [r[1][:200] for r in results]
    gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:]))
    assert max(latencies) < 1.0, latencies
    # A compilation on the loop holds it 0.1-0.4 s (a ~100 KB schema; more on a busy core), and
    # `busy` of them were still pending: that is several late wakes. One alone is a stall of the
    # 2-vCPU VM under the whole suite (a fresh-clone run saw one of 154 ms, the test alone never
    # more than 5 ms), not a compilation, so one is allowed, and no wake may be later than 0.5 s.
    late = sorted(lag for lag in lags if lag > 0.05)
    assert len(late) <= 1 and max(lags) < 0.5, late
    assert gaps[len(gaps) // 2] < 0.05, gaps  # ITL p50 near the 10 ms floor (loose: 2 cores)
    assert busy > 0, "the flood finished before the plain requests: nothing was measured"
    assert pool.compiled >= 17


async def test_tool_call_grammars_compile_in_the_pool_too(make_stack: StackFactory) -> None:
    """``tool_choice`` required builds a Lark grammar from the tools' parameters: it too is
    compiled in the pool (and cached: the same tools again cost nothing)."""
    stack = await make_stack()
    pool = stack.app[STATE_KEY].grammars
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "time?"}], "max_tokens": 4,
            "tools": tools, "tool_choice": "required"}
    for _ in range(2):
        status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", body)
        assert status == 200, raw
    assert pool.compiled == 1 and pool.cache.hits >= 1
