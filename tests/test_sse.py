"""SSE writer and error middleware on a real aiohttp server (127.0.0.1), read back by raw HTTP
and by the official ``openai`` SDK client."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from services.common.errors import UnavailableError
from services.gateway.http_errors import error_middleware, error_response, read_json_body
from services.gateway.openai_requests import parse_chat_request, parse_completion_request
from services.gateway.openai_responses import (
    ChatChoice,
    CompletionChoice,
    ModelCard,
    chat_completion_chunk,
    chat_completion_response,
    chat_usage_chunk,
    completion_chunk,
    completion_response,
    completion_usage_chunk,
    models_response,
    new_chat_completion_id,
    new_completion_id,
    usage_dict,
)
from services.gateway.rate_limit import RateLimitError
from services.gateway.sse import ClientDisconnected, SSEWriter

MODEL = "tiny"
PIECES = ["Hel", "lo", " wörld"]
EVENTS_KEY = web.AppKey("events", dict)


async def chat_handler(request: web.Request) -> web.StreamResponse:
    req = parse_chat_request(await read_json_body(request), served_models=[MODEL])
    rid, created = new_chat_completion_id(), 1700000000
    usage = usage_dict(7, len(PIECES), cached_tokens=4)
    if not req.stream:
        choices = [ChatChoice(i, "".join(PIECES), "stop") for i in range(req.sampling.n)]
        return web.json_response(
            chat_completion_response(
                request_id=rid, model=MODEL, created=created, choices=choices, usage=usage
            )
        )
    writer = SSEWriter()
    await writer.prepare(request)
    common: dict[str, Any] = {"request_id": rid, "model": MODEL, "created": created}
    await writer.send_json(chat_completion_chunk(**common, role="assistant", content=""))
    for piece in PIECES:
        await writer.send_json(chat_completion_chunk(**common, content=piece))
    await writer.send_json(chat_completion_chunk(**common, finish_reason="stop"))
    if req.include_usage:
        await writer.send_json(chat_usage_chunk(**common, usage=usage))
    await writer.send_done()
    return writer.response


async def completion_handler(request: web.Request) -> web.StreamResponse:
    req = parse_completion_request(await read_json_body(request), served_models=[MODEL])
    rid, created = new_completion_id(), 1700000000
    usage = usage_dict(3, len(PIECES))
    if not req.stream:
        choice = CompletionChoice(0, "".join(PIECES), "length")
        return web.json_response(
            completion_response(
                request_id=rid, model=MODEL, created=created, choices=[choice], usage=usage
            )
        )
    writer = SSEWriter()
    await writer.prepare(request)
    common: dict[str, Any] = {"request_id": rid, "model": MODEL, "created": created}
    for piece in PIECES:
        await writer.send_json(completion_chunk(**common, text=piece))
    await writer.send_json(completion_chunk(**common, finish_reason="length"))
    if req.include_usage:
        await writer.send_json(completion_usage_chunk(**common, usage=usage))
    await writer.send_done()
    return writer.response


async def models_handler(request: web.Request) -> web.StreamResponse:
    return web.json_response(models_response([ModelCard(MODEL, 1700000000)]))


async def raw_json_handler(request: web.Request) -> web.StreamResponse:
    """Uses aiohttp's own request.json(), so its raw errors reach the middleware."""
    return web.json_response({"got": await request.json()})


async def boom_handler(request: web.Request) -> web.StreamResponse:
    raise RuntimeError("secret internal detail")


async def limited_handler(request: web.Request) -> web.StreamResponse:
    raise RateLimitError("slow down", retry_after=2.2)


async def stream_then_fail_handler(request: web.Request) -> web.StreamResponse:
    writer = SSEWriter()
    await writer.prepare(request)
    await writer.send_json({"n": 1})
    raise UnavailableError("decode worker went away", code="backend_unavailable")


async def endless_handler(request: web.Request) -> web.StreamResponse:
    events = request.app[EVENTS_KEY]
    writer = SSEWriter()
    await writer.prepare(request)
    try:
        while True:
            await writer.send_json({"tick": True})
            await asyncio.sleep(0.01)
    except ClientDisconnected:
        events["send_disconnect"].set()
        raise


async def idle_handler(request: web.Request) -> web.StreamResponse:
    events = request.app[EVENTS_KEY]
    writer = SSEWriter()
    await writer.prepare(request)
    await writer.send_comment()
    await writer.wait_disconnected(poll_s=0.01)
    assert writer.is_disconnected()
    events["idle_disconnect"].set()
    with pytest.raises(ClientDisconnected):
        await writer.send_json({"late": True})
    return writer.response


def make_app() -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=4096)
    app[EVENTS_KEY] = {"send_disconnect": asyncio.Event(), "idle_disconnect": asyncio.Event()}
    app.router.add_post("/v1/chat/completions", chat_handler)
    app.router.add_post("/v1/completions", completion_handler)
    app.router.add_get("/v1/models", models_handler)
    app.router.add_post("/raw-json", raw_json_handler)
    app.router.add_get("/boom", boom_handler)
    app.router.add_get("/limited", limited_handler)
    app.router.add_get("/stream-then-fail", stream_then_fail_handler)
    app.router.add_get("/endless", endless_handler)
    app.router.add_get("/idle", idle_handler)
    return app


@dataclass(frozen=True, slots=True)
class Server:
    app: web.Application
    base_url: str


@pytest.fixture()
async def server() -> AsyncIterator[Server]:
    """The app behind a plain AppRunner on 127.0.0.1, as the gateway runs it (aiohttp's
    TestServer would turn on handler cancellation, which production does not use)."""
    app = make_app()
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield Server(app, f"http://127.0.0.1:{sock.getsockname()[1]}")
    finally:
        await runner.cleanup()


@pytest.fixture()
async def http(server: Server) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=server.base_url) as session:
        yield session


@pytest.fixture()
async def sdk(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="x",
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(trust_env=False),  # never via a proxy
    )
    async with client:
        yield client


# --------------------------------------------------------------------------- the openai SDK


async def test_sdk_chat_non_stream(sdk: openai.AsyncOpenAI) -> None:
    out = await sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, temperature=0
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert [c.message.content for c in out.choices] == ["Hello wörld"] * 2
    assert out.usage is not None and out.usage.prompt_tokens_details.cached_tokens == 4


async def test_sdk_chat_stream_with_usage(sdk: openai.AsyncOpenAI) -> None:
    stream = await sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello wörld"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 10
    assert len({c.id for c in chunks}) == 1


async def test_sdk_completions(sdk: openai.AsyncOpenAI) -> None:
    out = await sdk.completions.create(model=MODEL, prompt="Once")
    assert out.choices[0].text == "Hello wörld" and out.choices[0].finish_reason == "length"
    stream = await sdk.completions.create(
        model=MODEL, prompt=[1, 2, 3], stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello wörld"
    assert chunks[-1].usage.total_tokens == 6


async def test_sdk_models(sdk: openai.AsyncOpenAI) -> None:
    models = [m async for m in sdk.models.list()]
    assert [m.id for m in models] == [MODEL]


async def test_sdk_sees_typed_errors(sdk: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await sdk.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    assert bad.value.param == "temperature" and bad.value.type == "invalid_request_error"


# --------------------------------------------------------------------------- SSE wire format


async def test_sse_wire_format(http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert resp.headers["Cache-Control"] == "no-cache"
    assert resp.headers["X-Accel-Buffering"] == "no"
    raw = (await resp.read()).decode("utf-8")
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = events[:-2]
    assert len(payloads) == 1 + len(PIECES) + 1  # role, pieces, finish (no usage requested)
    for event in payloads:
        assert event.startswith("data: {") and "\n" not in event
        data = event[len("data: ") :]
        assert data == json.dumps(json.loads(data), separators=(",", ":"), ensure_ascii=False)
    assert "wörld" in raw  # UTF-8, not \u escapes


async def test_error_after_stream_started_becomes_error_event(http: aiohttp.ClientSession) -> None:
    resp = await http.get("/stream-then-fail")
    assert resp.status == 200
    raw = (await resp.read()).decode("utf-8")
    events = [e for e in raw.split("\n\n") if e]
    assert events[0] == 'data: {"n":1}'
    error = json.loads(events[1][len("data: ") :])
    assert error == {
        "error": {
            "message": "decode worker went away",
            "type": "service_unavailable",
            "param": None,
            "code": "backend_unavailable",
        }
    }
    assert events[2] == "data: [DONE]" and len(events) == 3


async def test_send_error_shape() -> None:
    err = UnavailableError("gone", code="x")
    assert err.to_openai()["error"]["type"] == "service_unavailable"
    with pytest.raises(RuntimeError):  # not prepared yet: a programming error
        await SSEWriter().send_error(err)


# --------------------------------------------------------------------------- disconnects


async def test_disconnect_raises_client_disconnected(server: Server) -> None:
    events = server.app[EVENTS_KEY]
    async with aiohttp.ClientSession(base_url=server.base_url) as session:
        resp = await session.get("/endless")
        first = await resp.content.readuntil(b"\n\n")
        assert first == b'data: {"tick":true}\n\n'
        resp.close()  # drop the connection mid-stream
    await asyncio.wait_for(events["send_disconnect"].wait(), timeout=5)


async def test_wait_disconnected_notices_idle_client(server: Server) -> None:
    events = server.app[EVENTS_KEY]
    async with aiohttp.ClientSession(base_url=server.base_url) as session:
        resp = await session.get("/idle")
        assert await resp.content.readuntil(b"\n\n") == b": keep-alive\n\n"
        resp.close()
    await asyncio.wait_for(events["idle_disconnect"].wait(), timeout=5)


# --------------------------------------------------------------------------- error middleware


async def test_malformed_json_is_400(http: aiohttp.ClientSession) -> None:
    for payload in (b"{not json", b'{"model": NaN}', b""):
        resp = await http.post(
            "/v1/chat/completions", data=payload, headers={"Content-Type": "application/json"}
        )
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
        assert err["message"].startswith("We could not parse the JSON body")


async def test_invalid_utf8_is_400(http: aiohttp.ClientSession) -> None:
    resp = await http.post("/v1/chat/completions", data=b'{"model": "\xff\xfe"}')
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "invalid_encoding"


async def test_body_not_object_and_bad_fields(http: aiohttp.ClientSession) -> None:
    resp = await http.post("/v1/chat/completions", json=[1])
    assert resp.status == 400 and (await resp.json())["error"]["param"] is None
    resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"


async def test_raw_decoding_errors_reach_the_middleware(http: aiohttp.ClientSession) -> None:
    resp = await http.post("/raw-json", data=b"{oops")
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_json"
    resp = await http.post(
        "/raw-json", data=b'"\xff"', headers={"Content-Type": "application/json; charset=utf-8"}
    )
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_encoding"
    resp = await http.post("/raw-json", data=b"[" + b"1," * 5000 + b"1]")
    assert resp.status == 413 and (await resp.json())["error"]["code"] == "request_too_large"
    resp = await http.post("/raw-json", json={"ok": 1})
    assert (await resp.json()) == {"got": {"ok": 1}}


async def test_huge_body_is_413(http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 10_000}]}
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status == 413
    err = (await resp.json())["error"]
    assert err == {
        "message": "The request body is too large: the limit is 4096 bytes.",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
    assert (await http.get("/v1/models")).status == 200  # the server stays up


async def test_unknown_route_and_method(http: aiohttp.ClientSession) -> None:
    resp = await http.get("/v1/nope")
    assert resp.status == 404
    assert (await resp.json()) == {
        "error": {
            "message": "Invalid URL (GET /v1/nope)",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    resp = await http.get("/v1/chat/completions")
    assert resp.status == 405 and "POST" in resp.headers["Allow"]
    assert (await resp.json())["error"]["code"] == "method_not_allowed"


async def test_unexpected_exception_is_500_without_details(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    resp = await http.get("/boom")
    assert resp.status == 500
    text = await resp.text()
    assert "secret" not in text and "Traceback" not in text
    assert json.loads(text)["error"]["message"].startswith("The server had an error")
    assert any("secret internal detail" in r.getMessage() or r.exc_info for r in caplog.records)


async def test_rate_limit_has_retry_after(http: aiohttp.ClientSession) -> None:
    resp = await http.get("/limited")
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "3"
    err = (await resp.json())["error"]
    assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")


def test_error_response_direct() -> None:
    resp = error_response(RateLimitError("x", retry_after=0.2))
    assert resp.status == 429 and resp.headers["Retry-After"] == "1"
    resp = error_response(UnavailableError("down"))
    assert resp.status == 503 and "Retry-After" not in resp.headers
    assert json.loads(resp.text)["error"]["message"] == "down"
