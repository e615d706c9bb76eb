"""The gateway as the edge (issue 32, part 3), against the real gateway on 127.0.0.1 over fake
gRPC workers (tests/gateway_fakes.py), with real clients: curl and the openai SDK over HTTPS,
raw sockets for clients that misbehave (slow headers, a body that never ends, a stream nobody
reads), aiohttp bound to another loopback address for a second anonymous client; and
Prometheus ``/metrics`` on a port of its own, never the API's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from services.gateway.edge_server import https_context, is_loopback, require_auth_beyond_loopback
from services.gateway.state import STATE_KEY
from tests import gateway_fakes
from tests.gateway_fakes import (  # noqa: F401 - make_stack is a fixture
    DEFAULT_REPLY,
    MODEL,
    StackFactory,
    make_stack,
    post_raw,
)
from tests.tls_identities import cert_dir

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
PROMPT_TOKENS = len("user: hi\nassistant:")


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    return host, int(port)


@contextlib.contextmanager
def _raw(url: str, *, rcvbuf: int | None = None) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect, so the advertised window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect(_host_port(url))
    try:
        yield sock
    finally:
        sock.close()


async def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closed ``sock`` (read returns EOF or a reset); fail after
    ``seconds``."""
    start = time.monotonic()
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    while time.monotonic() - start < seconds:
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 0.2)
        except TimeoutError:
            continue
        except ConnectionError:
            return time.monotonic() - start
        if not data:
            return time.monotonic() - start
    raise AssertionError(f"the server kept the connection open for {seconds}s")


async def _read_until_closed(sock: socket.socket, seconds: float) -> bytes:
    """Everything the server sends until it closes ``sock`` (without blocking the loop the
    server runs on)."""
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    data = b""
    async with asyncio.timeout(seconds):
        while chunk := await loop.sock_recv(sock, 65536):
            data += chunk
    return data


# ------------------------------------------------------------------------------ HTTPS


async def test_https_with_curl_and_the_openai_sdk(make_stack: StackFactory) -> None:
    d = cert_dir()
    stack = await make_stack(https_cert=str(d / "gateway.pem"), https_key=str(d / "gateway-key.pem"))
    assert stack.url.startswith("https://127.0.0.1:")
    body = json.dumps({**CHAT, "max_tokens": 5})
    curl = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--cacert", str(d / "ca.pem"), "-H", "Content-Type: application/json",
        "-d", body, stack.url + "/v1/chat/completions",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await curl.communicate()
    assert curl.returncode == 0, err
    assert json.loads(out)["choices"][0]["message"]["content"] == DEFAULT_REPLY[:5]
    # without the CA, curl refuses the certificate (exit 60: peer certificate not verified)
    curl = await asyncio.create_subprocess_exec(
        "curl", "-sS", "-o", "/dev/null", stack.url + "/health",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    await curl.communicate()
    assert curl.returncode == 60

    verify = ssl.create_default_context(cafile=str(d / "ca.pem"))
    async with openai.DefaultAsyncHttpxClient(verify=verify) as http:
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0,
                                    http_client=http)  # fmt: skip
        resp = await client.chat.completions.create(model=MODEL, messages=CHAT["messages"],
                                                    max_tokens=4)  # fmt: skip
        assert resp.choices[0].message.content == DEFAULT_REPLY[:4]
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=CHAT["messages"], max_tokens=6, stream=True)]  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == DEFAULT_REPLY[:6]
    # plain HTTP to the HTTPS port gets no answer
    with pytest.raises(aiohttp.ClientError):
        async with aiohttp.ClientSession() as s:
            await s.get(stack.url.replace("https://", "http://") + "/health")


def test_https_context_refuses_bad_files() -> None:
    from services.common.errors import InvalidArgumentError

    d = cert_dir()
    with pytest.raises(InvalidArgumentError) as info:
        https_context(str(d / "gateway.pem"), str(d / "prefill-key.pem"))  # not its key
    assert info.value.param == "https_cert"
    with pytest.raises(InvalidArgumentError):
        https_context("/nonexistent.pem", "/nonexistent-key.pem")


# ------------------------------------------------------------------------------ metrics


async def test_metrics_are_on_their_own_port_not_the_api_s(make_stack: StackFactory) -> None:
    stack = await make_stack()
    await stack.client().completions.create(model=MODEL, prompt="x", max_tokens=1)
    async with aiohttp.ClientSession() as s:
        async with s.get(stack.url + "/metrics") as r:
            assert r.status == 404  # the API's port: clients never see load and latency
        async with s.get(stack.metrics_url) as r:
            assert r.status == 200
            assert 'tandem:request_success_total{finished_reason="length"} 1.0' in await r.text()


def test_the_metrics_port_flag() -> None:
    import argparse

    from services.common import ports
    from services.common.errors import InvalidArgumentError
    from services.gateway.main import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    insecure = ["--insecure-internal"]
    config = config_from_args(parser.parse_args(insecure))
    assert config.metrics_port == ports.GATEWAY_METRICS_PORT != config.port
    assert config.metrics_host is None  # the gateway's --host
    args = insecure + ["--metrics-port", "-1"]
    assert config_from_args(parser.parse_args(args)).metrics_port is None
    args = insecure + ["--metrics-port", "9999", "--metrics-host", "127.0.0.1"]
    config = config_from_args(parser.parse_args(args))
    assert (config.metrics_port, config.metrics_host) == (9999, "127.0.0.1")
    with pytest.raises(InvalidArgumentError, match="must differ from --port") as same:
        config_from_args(parser.parse_args(insecure + ["--port", "8100", "--metrics-port", "8100"]))
    assert same.value.param == "metrics_port"
    with pytest.raises(InvalidArgumentError, match="--metrics-port"):
        config_from_args(parser.parse_args(insecure + ["--metrics-port", "70000"]))


# ------------------------------------------------------------------------------ auth


def test_no_auth_is_refused_beyond_loopback() -> None:
    from services.common.errors import FailedPreconditionError

    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.5"):
        assert is_loopback(host)
        require_auth_beyond_loopback(host, auth_enabled=False, allow_no_auth=False)
    for host in ("0.0.0.0", "::", "", "10.1.2.3", "gateway.example"):
        assert not is_loopback(host)
        with pytest.raises(FailedPreconditionError) as info:
            require_auth_beyond_loopback(host, auth_enabled=False, allow_no_auth=False)
        assert "--allow-no-auth" in info.value.message
        require_auth_beyond_loopback(host, auth_enabled=True, allow_no_auth=False)
        require_auth_beyond_loopback(host, auth_enabled=False, allow_no_auth=True)


def test_gateway_process_refuses_to_start_open_without_keys() -> None:
    argv = [sys.executable, "-m", "services", "serve", "gateway", "--host", "0.0.0.0",
            "--port", "0", "--insecure-internal"]  # fmt: skip
    env = {k: v for k, v in os.environ.items()
           if k not in ("TANDEM_API_KEYS", "TANDEM_ALLOW_NO_AUTH")}  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env,
                         cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "--allow-no-auth" in out.stderr
    assert "Traceback" not in out.stderr


# ------------------------------------------------------------------------------ connections


async def test_slow_header_client_is_dropped_on_time(make_stack: StackFactory) -> None:
    from services.gateway.config import EdgeLimits

    stack = await make_stack(edge=EdgeLimits(header_read_timeout_s=1.0))
    with _raw(stack.url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")

        async def trickle() -> None:  # a byte every 0.2 s: never a whole header
            with contextlib.suppress(OSError):
                for _ in range(100):
                    await asyncio.sleep(0.2)
                    sock.send(b"X")

        task = asyncio.create_task(trickle())
        try:
            took = await _closed_within(sock, 5.0)
        finally:
            task.cancel()
        assert 0.8 <= took <= 3.0, took
    # a well-behaved client is served meanwhile and after
    status, _, _ = await post_raw(stack.url + "/v1/chat/completions", {**CHAT, "max_tokens": 2})
    assert status == 200


async def test_connections_past_the_cap_get_503(make_stack: StackFactory) -> None:
    from services.gateway.config import EdgeLimits

    stack = await make_stack(edge=EdgeLimits(max_connections=2, header_read_timeout_s=10.0))
    with _raw(stack.url) as a, _raw(stack.url) as b:
        await asyncio.sleep(0.1)
        with _raw(stack.url) as c:
            answer = await _read_until_closed(c, 5.0)
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503")
        assert json.loads(payload)["error"]["code"] == "server_overloaded"
        assert a.fileno() >= 0 and b.fileno() >= 0
    await asyncio.sleep(0.2)  # both closed: there is room again
    status, _, _ = await post_raw(stack.url + "/v1/chat/completions", {**CHAT, "max_tokens": 2})
    assert status == 200


async def test_a_streaming_client_that_stops_reading_is_dropped_and_its_kv_freed(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.gateway.config import EdgeLimits

    monkeypatch.setattr(gateway_fakes, "CONTEXT", 10**6)
    stack = await make_stack(edge=EdgeLimits(sse_write_timeout_s=1.0))
    decode = stack.decodes[0]
    decode.token_delay = 0
    decode.reply_text = "x" * 200_000
    state = stack.app[STATE_KEY]
    body = json.dumps({**CHAT, "stream": True, "max_tokens": 200_000, "logprobs": True,
                       "top_logprobs": 20}).encode()  # ~2 KB per event  # fmt: skip
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
               b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
    with _raw(stack.url, rcvbuf=4096) as sock:
        sock.sendall(request)
        sock.setblocking(False)
        head = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 16), 30)
        assert head.startswith(b"HTTP/1.1 200")  # streaming; now never read again
        deadline = time.monotonic() + 30
        while state.admission.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert state.admission.in_flight == 0, "the slot is still held"
        await stack.settled()  # its KV was freed on the worker
        assert decode.cancelled or decode.aborted
        # the stream ended long before the whole answer was generated
        assert decode.generate_ids and len(decode.reply_text) == 200_000
    # and the gateway serves others as before
    resp = await stack.client().chat.completions.create(model=MODEL, messages=CHAT["messages"],
                                                        max_tokens=3)  # fmt: skip
    assert resp.choices[0].message.content == "xxx"


async def test_bodies_beyond_the_memory_budget_get_429_before_being_read(
    make_stack: StackFactory,
) -> None:
    from services.gateway.config import EdgeLimits

    # one client's share is the whole budget here: this is the global budget's test
    # (tests/test_gateway_slow_clients.py tests the shares)
    limits = EdgeLimits(max_body_memory_bytes=6000, max_body_memory_per_client_bytes=6000)
    stack = await make_stack(max_body_bytes=4096, edge=limits)
    with _raw(stack.url) as slow:  # announces 4000 bytes, sends 10: holds 4000 of the budget
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 4000\r\n\r\n{\"model\": ")  # fmt: skip
        await asyncio.sleep(0.2)
        assert stack.app[STATE_KEY].body_budget.used == 4000
        big = {**CHAT, "max_tokens": 2, "user": "u" * 2500}
        status, raw, headers = await post_raw(stack.url + "/v1/chat/completions", big)
        assert status == 429, raw
        assert json.loads(raw)["error"]["code"] == "server_overloaded"
        assert headers["Retry-After"] == "1"
        small = {**CHAT, "max_tokens": 2}  # fits beside it
        status, _, _ = await post_raw(stack.url + "/v1/chat/completions", small)
        assert status == 200
    await asyncio.sleep(0.3)  # the slow client left: its share is back
    assert stack.app[STATE_KEY].body_budget.used == 0
    status, _, _ = await post_raw(stack.url + "/v1/chat/completions", big)
    assert status == 200


# ------------------------------------------------------------------------------ rate limits


async def test_tokenize_and_detokenize_share_the_v1_rate_limit_and_admission(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(rate_limit_rpm=60, rate_limit_burst=2)
    status, _, _ = await post_raw(stack.url + "/tokenize", {"prompt": "hi"})
    assert status == 200
    status, _, _ = await post_raw(stack.url + "/v1/chat/completions", {**CHAT, "max_tokens": 2})
    assert status == 200
    status, raw, headers = await post_raw(stack.url + "/detokenize", {"tokens": [104, 105]})
    assert status == 429 and json.loads(raw)["error"]["code"] == "rate_limit_exceeded"
    assert int(headers["Retry-After"]) >= 1

    stack = await make_stack(max_in_flight=1)
    stack.decodes[0].token_delay = 0.2
    async with aiohttp.ClientSession() as s, s.post(
        stack.url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 50}
    ) as r:
        await r.content.readline()  # the one slot is taken
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [104]})):
            status, raw, _ = await post_raw(stack.url + path, body)
            assert status == 429, path
            assert json.loads(raw)["error"]["code"] == "server_overloaded"
    await stack.settled()
    status, raw, _ = await post_raw(stack.url + "/detokenize", {"tokens": [104, 105]})
    assert (status, json.loads(raw)) == (200, {"prompt": "hi"})


async def test_anonymous_clients_are_rate_limited_per_ip(make_stack: StackFactory) -> None:
    stack = await make_stack(rate_limit_rpm=60, rate_limit_burst=1)
    url = stack.url + "/v1/chat/completions"
    body = {**CHAT, "max_tokens": 2}
    assert (await post_raw(url, body))[0] == 200
    assert (await post_raw(url, body))[0] == 429  # 127.0.0.1's bucket is empty
    other = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
    async with aiohttp.ClientSession(connector=other) as s, s.post(url, json=body) as r:
        assert r.status == 200  # 127.0.0.2 has a bucket of its own


async def test_token_rate_limit_charges_max_tokens_and_refunds_the_unused(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(rate_limit_tpm=60)
    url = stack.url + "/v1/chat/completions"
    cost = PROMPT_TOKENS + 10  # 29 each
    assert (await post_raw(url, {**CHAT, "max_tokens": 10}))[0] == 200
    assert (await post_raw(url, {**CHAT, "max_tokens": 10}))[0] == 200
    status, raw, headers = await post_raw(url, {**CHAT, "max_tokens": 10})
    assert 2 * cost + cost > 60 and status == 429
    assert "tokens per minute" in json.loads(raw)["error"]["message"]
    assert float(headers["Retry-After"]) >= 1
    # one request asking more than a minute's worth can never pass: said so, not "retry"
    stack = await make_stack(rate_limit_tpm=60)
    url = stack.url + "/v1/chat/completions"
    status, raw, _ = await post_raw(url, {**CHAT, "max_tokens": 100})
    assert status == 429 and json.loads(raw)["error"]["code"] == "request_too_large"
    # charged 19 + 40 = 59, generated 6 ("Hello " before the stop word): 34 come back
    status, raw, _ = await post_raw(url, {**CHAT, "max_tokens": 40, "stop": ["from"]})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 6
    assert (await post_raw(url, {**CHAT, "max_tokens": 10}))[0] == 200  # 35 left, 29 needed


# ------------------------------------------------------------------------------ max_tokens


async def test_max_tokens_default_context_and_limit(make_stack: StackFactory) -> None:
    stack = await make_stack(default_max_tokens=7)
    status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", CHAT)
    reply = json.loads(raw)
    assert status == 200 and reply["usage"]["completion_tokens"] == 7
    assert reply["choices"][0]["finish_reason"] == "length"

    stack = await make_stack(default_max_tokens=None)  # --default-max-tokens context
    await post_raw(stack.url + "/v1/chat/completions", CHAT)
    assert stack.prefills[0].requests[0].params.max_tokens == gateway_fakes.CONTEXT - PROMPT_TOKENS

    stack = await make_stack(default_max_tokens=5, max_tokens_limit=20)
    for field in ("max_tokens", "max_completion_tokens"):
        status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", {**CHAT, field: 21})
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == "max_tokens" and "at most 20" in err["message"]
    status, raw, _ = await post_raw(stack.url + "/v1/completions",
                                    {"model": MODEL, "prompt": "hi", "max_tokens": 21})  # fmt: skip
    assert status == 400
    status, _, _ = await post_raw(stack.url + "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert status == 200  # the completions default (16) is within the limit
    status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", {**CHAT, "max_tokens": 20})
    assert status == 200


def test_edge_flags_parse_as_documented() -> None:
    import argparse

    from services.common.errors import InvalidArgumentError
    from services.gateway.main import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--insecure-internal"]
    config = config_from_args(parser.parse_args(base))
    assert config.default_max_tokens == 1024 and config.max_tokens_limit is None
    assert config.edge.header_read_timeout_s == 15.0 and config.edge.max_connections == 1024
    assert config.https_cert is None
    config = config_from_args(parser.parse_args([
        *base, "--default-max-tokens", "context", "--max-tokens-limit", "4096",
        "--rate-limit-tpm", "100000", "--header-read-timeout", "5", "--max-connections", "10",
        "--sse-write-timeout", "3", "--max-body-memory", "8388608",
        "--https-cert", "c.pem", "--https-key", "k.pem",
    ]))  # fmt: skip
    assert (config.default_max_tokens, config.max_tokens_limit) == (None, 4096)
    assert config.rate_limit_tpm == 100000 and config.edge.sse_write_timeout_s == 3
    assert config.edge.max_body_memory_bytes == 8388608 and config.https_key == "k.pem"
    assert config.edge.max_body_memory_per_client_bytes is None  # an eighth, in BodyBudget
    for bad in (["--default-max-tokens", "0"], ["--https-cert", "c.pem"],
                ["--default-max-tokens", "100", "--max-tokens-limit", "50"],
                ["--max-body-memory", "1024"], ["--max-connections", "0"],
                ["--max-body-memory-per-client", "1024"],
                ["--max-body-memory", "8388608",
                 "--max-body-memory-per-client", "9000000"]):  # fmt: skip
        with pytest.raises(InvalidArgumentError):
            config_from_args(parser.parse_args([*base, *bad]))
