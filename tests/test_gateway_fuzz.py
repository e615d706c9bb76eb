"""Fuzzing the gateway against a real stack: the tokenizer service (SmolLM2's tokenizer), a prefill
and a decode worker on a tiny random model with the same vocabulary, and the gateway, all in this
process (tests/tiny_stack.py).

1. :func:`test_schemathesis_finds_nothing` runs ``schemathesis run`` on ``GET /openapi.json``: its
   coverage phase (every declared bound, type and enum, just inside and just outside, missing
   required fields, undocumented methods, requests without the API key) and its fuzzing phase
   (random valid and invalid bodies, half of the valid completions streamed: tests/fuzz_hooks.py),
   with a fixed seed, well over 1,000 cases and a time bound. Every response must be documented
   and valid against the document (stream events one by one; streams are read up to 64 events,
   so longer ones end with the client leaving), no 5xx, every error OpenAI's shape with the type,
   code and headers its status implies, every schema-invalid body refused with a 4xx; then the
   gateway is ready and both workers hold no KV block.
2. Hostile requests, each answered by a 4xx or served: a body over the size limit, invalid
   UTF-8, deeply nested JSON, 10,000 messages, max_tokens far past the context, n=128, unknown
   fields, and a slow-loris client that sends its body a byte a second (408 and disconnected at
   ``--body-read-timeout``, holding no admission slot and no worker while it dawdles).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from services.gateway.state import STATE_KEY
from tests.test_gateway_hostile_input import read_response
from tests.tiny_stack import CONTEXT, TinyStack, tiny_stack

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

REPO = Path(__file__).resolve().parents[1]
SEED = 20260613
MAX_EXAMPLES = 50  # per operation and phase
MIN_CASES = 1000
FUZZ_TIMEOUT_S = 240.0  # the run takes about a minute on 2 cores
BODY_READ_TIMEOUT_S = 2.0
CHAT = "/v1/chat/completions"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TinyStack]:
    folder = tmp_path_factory.mktemp("tiny-smollm2-vocab")
    async with tiny_stack(folder, body_read_timeout_s=BODY_READ_TIMEOUT_S) as started:
        yield started


async def post(stack: TinyStack, path: str, data: bytes | str | Any,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:  # fmt: skip
    raw = data if isinstance(data, (bytes, str)) else json.dumps(data)
    hdrs = {"Content-Type": "application/json", **stack.headers, **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(stack.url + path, data=raw, headers=hdrs) as r:
        body = await r.read()
        return r.status, (json.loads(body) if r.content_type == "application/json" else body)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assert_error(status: int, body: Any, expected: int, *, code: str | None = None,
                 param: str | None = None) -> None:  # fmt: skip
    assert status == expected, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body


# --------------------------------------------------------------------------- the fuzzer


async def test_schemathesis_finds_nothing(stack: TinyStack, tmp_path: Path) -> None:
    config = tmp_path / "schemathesis.toml"
    config.write_text("max-stream-events = 64\n")
    har = tmp_path / "fuzz.har"
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
        stack.url + "/openapi.json", "--header", f"Authorization: {stack.headers['Authorization']}",
        "--phases", "coverage,fuzzing", "--mode", "all", "--max-examples", str(MAX_EXAMPLES),
        "--seed", str(SEED), "--no-shrink", "--workers", "1", "--generation-database", "none",
        "--checks", "all",
        # Valid bodies may still be refused: rules across fields and the context window.
        "--exclude-checks", "positive_data_acceptance",
        "--request-timeout", "60", "--output-sanitize", "false", "--report", "har",
        "--report-har-path", str(har), "--no-color",
    ]  # fmt: skip
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.fuzz_hooks", "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *command, cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE,  # its caches land there
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), FUZZ_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"schemathesis ran past {FUZZ_TIMEOUT_S} s") from None
    output = out.decode(errors="replace")
    assert proc.returncode == 0, output[-20000:]

    entries = json.loads(har.read_text())["log"]["entries"]
    seen: collections.Counter[tuple[str, int, bool]] = collections.Counter()
    for entry in entries:
        path = "/" + entry["request"]["url"].split("/", 3)[3].split("?")[0]
        path = "/v1/models/{model}" if path.startswith("/v1/models/") else path
        sse = "event-stream" in entry["response"]["content"].get("mimeType", "")
        seen[(path, entry["response"]["status"], sse)] += 1
    print(f"schemathesis: {len(entries)} cases in {time.monotonic() - started:.0f} s")
    for key, count in sorted(seen.items()):
        print("  ", key, count)
    assert len(entries) >= MIN_CASES
    assert not [key for key in seen if key[1] >= 500]
    paths = {key[0] for key in seen}
    assert paths >= {CHAT, "/v1/completions", "/v1/models", "/v1/models/{model}", "/tokenize",
                     "/detokenize", "/version", "/health", "/ready", "/"}
    for path in (CHAT, "/v1/completions"):
        assert seen[(path, 200, True)] >= 10, f"too few streamed answers on {path}"
        assert seen[(path, 200, False)] >= 10, f"too few JSON answers on {path}"
    await stack.wait_idle()
    await stack.ready()


# --------------------------------------------------------------------------- hostile requests


async def test_a_body_over_the_limit_is_413(stack: TinyStack) -> None:
    limit = stack.app[STATE_KEY].config.max_body_bytes
    body = json.dumps({"model": "tiny", "messages": [user("x" * (limit + 1024))]})
    status, answer = await post(stack, CHAT, body)
    assert_error(status, answer, 413, code="request_too_large")


async def test_invalid_utf8_and_deep_nesting_are_400(stack: TinyStack) -> None:
    status, body = await post(stack, CHAT, b'{"model": "tiny", "messages": [{"role": "user", '
                                           b'"content": "caf\xe9"}]}')  # fmt: skip
    assert_error(status, body, 400, code="invalid_encoding")
    status, body = await post(stack, CHAT, "[" * 100_000 + "]" * 100_000)
    assert_error(status, body, 400, code="invalid_json")
    nested: Any = "deep"
    for _ in range(200):  # deep but parseable, in a field the gateway ignores
        nested = {"n": [nested]}
    status, body = await post(stack, CHAT, {"model": "tiny", "messages": [user("hi")],
                                            "max_tokens": 2, "extra": nested})  # fmt: skip
    assert status == 200, body
    for path in ("/tokenize", "/v1/completions"):
        status, body = await post(stack, path, b'{"prompt": "\\ud800"}')
        assert_error(status, body, 400, code="invalid_encoding")


async def test_ten_thousand_messages(stack: TinyStack) -> None:
    messages = [user(f"turn {i}") if i % 2 == 0 else {"role": "assistant", "content": f"ok {i}"}
                for i in range(10_000)]  # fmt: skip
    messages[-1] = user("and now?")
    started = time.monotonic()
    status, body = await post(stack, CHAT, {"model": "tiny", "messages": messages, "max_tokens": 4})
    assert status == 200, body  # the oldest turns are dropped to fit the context
    assert body["usage"]["prompt_tokens"] + 4 <= CONTEXT
    status, body = await post(stack, "/tokenize", {"messages": messages})
    assert status == 200 and body["count"] > 10_000 and body["max_model_len"] == CONTEXT, body
    assert time.monotonic() - started < 60


async def test_limits_are_400_naming_the_field(stack: TinyStack) -> None:
    status, body = await post(stack, "/v1/completions",
                              {"model": "tiny", "prompt": "hi", "max_tokens": 100_000})
    assert_error(status, body, 400, param="max_tokens")  # from the tokenizer service
    status, body = await post(stack, "/v1/completions",
                              {"model": "tiny", "prompt": [5, 6], "max_tokens": 100_000})
    assert_error(status, body, 400, param="prompt", code="context_length_exceeded")
    status, body = await post(stack, CHAT, {"model": "tiny", "messages": [user("hi")],
                                            "max_tokens": 100_000})  # fmt: skip
    assert_error(status, body, 400, param="max_tokens")
    status, body = await post(stack, CHAT, {"model": "tiny", "messages": [user("hi")],
                                            "max_tokens": 2**40})  # fmt: skip
    assert_error(status, body, 400, param="max_tokens", code="integer_above_max_value")
    status, body = await post(stack, CHAT, {"model": "tiny", "messages": [user("hi")], "n": 128})
    assert_error(status, body, 400, param="n")


async def test_unknown_fields_are_ignored_on_v1_and_refused_on_tokenize(stack: TinyStack) -> None:
    extras = {"tool_choice": "none", "parallel_tool_calls": False, "metadata": {"a": "b"},
              "store": True, "x-custom": [1, 2]}  # fmt: skip
    status, body = await post(stack, CHAT, {"model": "tiny", "messages": [user("hi")],
                                            "max_tokens": 3, **extras})  # fmt: skip
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body
    status, body = await post(stack, "/v1/completions",
                              {"model": "tiny", "prompt": "hi", "max_tokens": 3, **extras})
    assert status == 200, body
    status, body = await post(stack, "/tokenize", {"prompt": "hi", "store": True})
    assert_error(status, body, 400, code="unknown_parameter", param="store")


async def test_a_slow_loris_is_dropped_without_holding_a_worker(stack: TinyStack) -> None:
    host, port = stack.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "messages": [user("hi")], "max_tokens": 2}).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write((f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Authorization: {stack.headers['Authorization']}\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n").encode())  # fmt: skip
    await writer.drain()
    started = time.monotonic()

    async def dribble() -> None:
        for byte in body:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(1.0)

    sender = asyncio.create_task(dribble())
    try:
        await asyncio.sleep(BODY_READ_TIMEOUT_S / 2)
        ready = await stack.ready()
        assert ready["in_flight"] == 0  # no admission slot while the body trickles in
        assert (await stack.kv_in_use())[2] == 0  # and nothing on the decode worker
        status, answer = await post(stack, CHAT, {"model": "tiny", "messages": [user("hi")],
                                                  "max_tokens": 2})  # fmt: skip
        assert status == 200, answer  # others are served meanwhile
        response = await asyncio.wait_for(read_response(reader), BODY_READ_TIMEOUT_S + 5)
        elapsed = time.monotonic() - started
    finally:
        sender.cancel()
        writer.close()
    head, _, payload = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), response
    assert b"connection: close" in head.lower()  # and dropped once aiohttp's lingering ends
    error = json.loads(payload)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    assert BODY_READ_TIMEOUT_S <= elapsed < BODY_READ_TIMEOUT_S + 5, elapsed


async def test_the_stack_is_healthy_and_idle_after_all_of_it(stack: TinyStack) -> None:
    await stack.wait_idle()
    ready = await stack.ready()
    assert ready["status"] == "ready" and ready["in_flight"] == 0
    async with aiohttp.ClientSession() as s, s.get(stack.url + "/health") as r:
        assert r.status == 200
