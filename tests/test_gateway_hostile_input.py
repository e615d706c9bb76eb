"""Regression tests, on the fake stack, for what fuzzing the gateway turned up: inputs that used to
answer 500 (an integer too wide for its protobuf field, an integer literal too large for a float,
an escaped unpaired surrogate that no gRPC message can carry, JSON nested past the parser's
recursion limit), ``"tokens": null`` accepted by ``/detokenize``, and a client sending its body
slowly enough to hold a connection forever (now 408 at ``--body-read-timeout``)."""

from __future__ import annotations

import asyncio
import logging
import json
import time
from typing import Any

import pytest

from services.common.errors import InvalidArgumentError
from services.gateway.api_schema import MAX_INT32, MAX_UINT32
from services.gateway.config import GatewayConfig
from services.gateway.openai_fields import parse_int_list
from services.gateway.openai_requests import parse_completion_request
from tests.gateway_fakes import MODEL, StackFactory, post_raw
from tests.tls_identities import tls_flags

USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": USER, "max_tokens": 3}
COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 3}


def body_of(raw: bytes) -> dict[str, Any]:
    return json.loads(raw)["error"]  # type: ignore[no-any-return]


WIDE_INTEGERS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {**CHAT, "top_k": MAX_INT32 + 1}, "top_k"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2**33}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2**33}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [MAX_UINT32 + 1]}, "stop_token_ids"),
    ("/v1/completions", {**COMP, "max_tokens": 2**33}, "max_tokens"),
    ("/v1/completions", {**COMP, "top_k": 2**40}, "top_k"),
]


@pytest.mark.parametrize(("path", "body", "param"), WIDE_INTEGERS,
                         ids=[f"{c[0]}-{c[2]}" for c in WIDE_INTEGERS])  # fmt: skip
async def test_integers_wider_than_their_wire_field_are_400(
    make_stack: StackFactory, path: str, body: dict[str, Any], param: str
) -> None:
    stack = await make_stack()
    status, raw, _ = await post_raw(stack.url + path, body)
    assert status == 400, raw
    assert (body_of(raw)["param"], body_of(raw)["code"]) == (param, "integer_above_max_value")


async def test_an_integer_literal_too_large_for_a_float_is_400(make_stack: StackFactory) -> None:
    stack = await make_stack()
    raw_body = json.dumps(CHAT)[:-1] + ', "temperature": 1' + "0" * 400 + "}"
    status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", raw_body)
    assert status == 400 and body_of(raw)["param"] == "temperature", raw


def test_token_ids_beyond_uint32_are_refused_before_the_vocabulary_is_known() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        parse_completion_request({"model": MODEL, "prompt": [1, 2**40]}, served_models=[MODEL])
    assert info.value.param == "prompt"
    with pytest.raises(InvalidArgumentError) as info:
        parse_int_list({"tokens": [MAX_UINT32 + 1]}, "tokens", maximum=MAX_UINT32)
    assert info.value.code == "integer_above_max_value"
    assert parse_int_list({"tokens": [MAX_UINT32]}, "tokens", maximum=MAX_UINT32) == (MAX_UINT32,)


SURROGATES = [
    ("/v1/chat/completions",
     '{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800"}]}'),
    ("/v1/chat/completions",
     '{"model": "%s", "stop": ["\\udfff"], "messages": [{"role": "user", "content": "a"}]}'),
    ("/v1/completions", '{"model": "%s", "prompt": "\\uDBFF"}'),
    ("/tokenize", '{"model": "%s", "prompt": "x\\ud800y"}'),
]


@pytest.mark.parametrize(("path", "template"), SURROGATES)
async def test_escaped_unpaired_surrogates_are_400(
    make_stack: StackFactory, path: str, template: str
) -> None:
    stack = await make_stack()
    status, raw, _ = await post_raw(stack.url + path, template % MODEL)
    assert status == 400, raw
    assert body_of(raw)["code"] == "invalid_encoding"


async def test_paired_surrogates_and_escaped_backslashes_pass(make_stack: StackFactory) -> None:
    stack = await make_stack()
    for text in ('"\\ud83d\\ude00 ok"', '"a literal \\\\ud800"'):
        raw_body = json.dumps({"model": MODEL, "prompt": "P", "max_tokens": 3})
        raw_body = raw_body.replace('"P"', text)
        status, raw, _ = await post_raw(stack.url + "/v1/completions", raw_body)
        assert status == 200, raw


async def test_json_nested_too_deeply_is_400(make_stack: StackFactory) -> None:
    stack = await make_stack()
    for path in ("/v1/chat/completions", "/tokenize"):
        status, raw, _ = await post_raw(stack.url + path, "[" * 50_000 + "]" * 50_000)
        assert status == 400 and body_of(raw)["code"] == "invalid_json", raw


async def test_detokenize_null_tokens_is_missing(make_stack: StackFactory) -> None:
    stack = await make_stack()
    status, raw, _ = await post_raw(stack.url + "/detokenize", {"tokens": None})
    assert status == 400
    assert (body_of(raw)["param"], body_of(raw)["code"]) == ("tokens", "missing_required_parameter")


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 response with a Content-Length body, raw."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))  # fmt: skip
    return head + await reader.readexactly(length)


async def _slow_post(url: str, path: str, body: bytes, pause_s: float) -> tuple[bytes, float]:
    """POST ``body`` one byte per ``pause_s``; the raw answer and how long it took."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode())  # fmt: skip
    started = time.monotonic()

    async def dribble() -> None:
        for byte in body:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(pause_s)

    sender = asyncio.create_task(dribble())
    try:
        answer = await asyncio.wait_for(read_response(reader), 10)
        return answer, time.monotonic() - started
    finally:
        sender.cancel()
        writer.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_a_body_arriving_too_slowly_is_408_and_the_connection_closed(
    make_stack: StackFactory, path: str
) -> None:
    stack = await make_stack(body_read_timeout_s=0.3)
    body = json.dumps({"model": MODEL, "messages": USER}).encode()
    answer, elapsed = await _slow_post(stack.url, path, body, 0.05)  # ~3 s for the whole body
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"close" in head.lower(), answer
    assert body_of(payload)["code"] == "request_timeout"
    assert 0.3 <= elapsed < 2.0  # answered at the deadline, not once the body is in
    assert not any(d.generate_ids for d in stack.decodes)  # no worker was involved


async def test_a_slow_body_within_the_timeout_is_served(make_stack: StackFactory) -> None:
    stack = await make_stack(body_read_timeout_s=5.0)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    answer, _ = await _slow_post(stack.url, "/v1/completions", body, 0.002)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_body_read_timeout_is_validated() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(InvalidArgumentError):
            GatewayConfig("t:1", (), ("d:1",), body_read_timeout_s=bad).validate()
    from services.cli import build_parser
    from services.gateway.main import config_from_args

    argv = ["serve", "gateway", "--body-read-timeout", "7.5", *tls_flags("gateway")]
    assert config_from_args(build_parser(argv).parse_args(argv)).body_read_timeout_s == 7.5


async def _raw_exchange(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


async def test_requests_that_are_not_http_log_one_quiet_line(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await make_stack()
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    bad = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\nContent-Length: 2\r\n\r\n{}"
    for _ in range(5):
        answer = await _raw_exchange(stack.url, bad)
        assert answer.split(b" ", 2)[1] == b"400", answer
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(records) == 1, [r.getMessage() for r in records]  # folded: no flood
    assert records[0].levelno == logging.WARNING and records[0].exc_info is None
    assert "malformed HTTP request from 127.0.0.1 answered 400" in records[0].getMessage()
    status, body, _ = await post_raw(stack.url + "/v1/completions", b'{"model": 1}')
    assert status == 400 and json.loads(body)["error"]["param"] == "model"  # still serving


LONG_STOPS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [0] * 1_000_000}, "stop_token_ids"),
    ("/v1/completions", {**COMP, "stop_token_ids": [7] * 1025}, "stop_token_ids"),
    ("/v1/chat/completions", {**CHAT, "stop": ["x" * 1025]}, "stop"),
    ("/v1/completions", {**COMP, "stop": "y" * 100_000}, "stop"),
]


@pytest.mark.parametrize(("path", "body", "param"), LONG_STOPS,
                         ids=["1M-stop-ids", "1025-stop-ids", "long-stop", "100k-stop"])  # fmt: skip
async def test_stop_lists_and_strings_are_bounded(
    make_stack: StackFactory, path: str, body: dict[str, Any], param: str
) -> None:
    """Every stop token id is checked against each sampled token and every stop string searched
    in each new piece of text, on the engine thread: a million of them was accepted once."""
    stack = await make_stack()
    status, raw, _ = await post_raw(stack.url + path, body)
    assert status == 400, raw
    assert body_of(raw)["param"] == param
