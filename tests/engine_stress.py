"""A stress run of the real serving path, shared by ``tests/test_engine_stress.py`` (CI size) and
``bench/engine_stress.py`` (longer, repeated): many constrained (JSON schema) and unconstrained
streams at once through the real gateway onto two real decode workers (a tiny random Llama with
SmolLM2's vocabulary, so llguidance builds real matchers), with random client disconnects (the
gateway aborts them on the workers) and, optionally, one decode worker's engine step failing
mid-run, which must migrate its streams to the other worker rather than fail them.

Why it exists: issue 43, an ``Already borrowed`` race between the grammar-mask helper thread and
the engine thread that failed whole steps under load. The grammar masks are forced onto the
helper thread here (``overlap``), so the hand-over of every matcher is exercised on every step.

The verdict (:class:`StressResult`): every stream that was not disconnected on purpose must
complete (``stop`` or ``length``, a ``stop`` of a constrained stream being valid JSON), and
every KV block must be free at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

logger = logging.getLogger(__name__)

API_KEY = "stress-key"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 130},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                            "maxItems": 2}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}  # fmt: skip
PROMPTS = ["Describe a person.", "Who is Alice?", "Tell me about a pilot in Paris.",
           "Write a record.", "Make up a character who likes cats."]  # fmt: skip


@dataclass
class StressStack:
    """The running stack: the gateway's URL and the decode workers' handles."""

    url: str
    decodes: list[Any]
    headers: dict[str, str]


@contextlib.asynccontextmanager
async def stress_stack(model_dir: Path) -> AsyncIterator[StressStack]:
    """Tokenizer service, one prefill and two decode workers (threads=1 each) and the gateway,
    all in this process on 127.0.0.1."""
    from services.common.metrics import TandemMetrics
    from services.decode.server import start_decode_worker
    from services.engine.runtime.worker_options import WorkerOptions
    from services.gateway.config import GatewayConfig
    from services.gateway.prefill_policy import PrefillPolicy
    from services.prefill.server import start_prefill_worker
    from tests.tiny_stack import start_test_gateway, start_tiny_model_and_tokenizer
    from tests.tls_identities import tls_for

    tokenizer, loaded, tok_server = await start_tiny_model_and_tokenizer(model_dir)
    common: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "model": str(model_dir),
                              "threads": 1}  # fmt: skip
    started: list[Any] = []
    runner: web.AppRunner | None = None
    autotune = os.environ.get("TANDEM_AUTOTUNE")
    os.environ["TANDEM_AUTOTUNE"] = "fixed"  # no kernel timing at start: the same bits everywhere
    try:
        for i in range(2):
            started.append(await start_decode_worker(
                WorkerOptions(tls=tls_for("decode"), **common, num_blocks=320,
                              worker_id=f"decode-{i}"),
                loaded=loaded, tokenizer=tokenizer, metrics=TandemMetrics(process_metrics=False),
            ))  # fmt: skip
        decodes = list(started)
        _restore("TANDEM_AUTOTUNE", autotune)
        for handle in decodes:  # the masks on the helper thread: every step hands matchers over
            await handle.engine_loop.call(
                lambda engine: setattr(engine.sampler.grammar_masks, "overlap", True))
        started.append(await start_prefill_worker(
            WorkerOptions(tls=tls_for("prefill"), **common, num_blocks=64, worker_id="prefill"),
            loaded=loaded, metrics=TandemMetrics(process_metrics=False),
        ))  # fmt: skip
        config = GatewayConfig(
            tokenizer_addresses=(tok_server.address,), prefill_addresses=(started[-1].address,),
            decode_addresses=tuple(h.address for h in decodes), host="127.0.0.1", port=0,
            stats_interval_s=0.2, prefill_policy=PrefillPolicy(remote_min_tokens=40),
            tls=tls_for("gateway"),
        )  # fmt: skip
        _, runner, base_url = await start_test_gateway(config, API_KEY)
        stack = StressStack(base_url, decodes, {"Authorization": f"Bearer {API_KEY}"})
        deadline = time.monotonic() + 30
        while True:
            async with aiohttp.ClientSession() as s, s.get(stack.url + "/ready") as r:
                if r.status == 200:
                    break
                body = await r.text()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stress stack never got ready: {body}")
            await asyncio.sleep(0.1)
        await asyncio.sleep(3 * config.stats_interval_s)  # both decode workers polled healthy
        yield stack
    finally:
        _restore("TANDEM_AUTOTUNE", autotune)
        if runner is not None:
            await runner.cleanup()
        for handle in reversed(started):
            await handle.stop(0.5)
        await tok_server.stop(0)


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@dataclass
class StressResult:
    """What one run saw: outcome per stream (``stop``, ``length``, ``disconnected``, or
    ``failed: ...``)."""

    outcomes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    migrated: bool = False

    @property
    def failures(self) -> list[str]:
        return [o for o in self.outcomes if o.startswith("failed")]

    @property
    def ok(self) -> bool:
        return not self.failures


async def run_stress(
    stack: StressStack, *, streams: int, seed: int, disconnect_p: float = 0.2,
    fail_a_step: bool = True, timeout_s: float = 120.0,
) -> StressResult:
    """``streams`` concurrent streams (half constrained), some disconnected at random; with
    ``fail_a_step``, decode worker 0's engine step raises once mid-run (its streams migrate)."""
    rng = random.Random(seed)
    result = StressResult()
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        jobs = [_one_stream(session, stack, rng.random() < 0.5, rng, disconnect_p, i)
                for i in range(streams)]  # fmt: skip
        tasks = [asyncio.ensure_future(job) for job in jobs]
        if fail_a_step:
            await asyncio.sleep(0.15 + 0.2 * rng.random())
            result.migrated = await _fail_one_step(stack.decodes[0])
        result.outcomes = list(await asyncio.gather(*tasks))
    result.seconds = time.monotonic() - start
    return result


async def _one_stream(
    session: aiohttp.ClientSession, stack: StressStack, constrained: bool, rng: random.Random,
    disconnect_p: float, index: int,
) -> str:
    await asyncio.sleep(rng.random() * 0.3)
    body: dict[str, Any] = {
        "model": "tiny", "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": rng.randint(8, 48), "stream": True,
        "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 1000),
    }  # fmt: skip
    if constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "p", "schema": SCHEMA}}  # fmt: skip
    cut_after = rng.randint(1, 6) if rng.random() < disconnect_p else None
    text, chunks = "", 0
    async with session.post(stack.url + "/v1/chat/completions", json=body,
                            headers=stack.headers) as response:  # fmt: skip
        if response.status != 200:
            return f"failed: HTTP {response.status} {await response.text()}"
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                return f"failed: stream {index}: {event['error']}"
            for choice in event.get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
                reason = choice.get("finish_reason")
                if reason is not None:
                    if constrained and reason == "stop":
                        try:
                            json.loads(text)
                        except ValueError:
                            return f"failed: stream {index}: invalid JSON {text!r}"
                    return reason
            chunks += 1
            if cut_after is not None and chunks >= cut_after:
                response.close()  # the client goes away mid-stream
                return "disconnected"
    return f"failed: stream {index} ended without a finish reason"


async def _fail_one_step(handle: Any) -> bool:
    """Make the next engine step of ``handle``'s worker raise (a forward pass failing) once."""

    def arm(engine: Any) -> None:
        runner = engine.runner
        real: Callable[..., Any] = runner.execute

        def broken(batch: Any) -> Any:
            runner.execute = real
            raise RuntimeError("injected: the forward pass failed")

        runner.execute = broken

    await handle.engine_loop.call(arm)
    return True
