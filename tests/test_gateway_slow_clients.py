"""Slow clients at the edge (issue 47, item 5): the real gateway on 127.0.0.1 over fake gRPC
workers (tests/gateway_fakes.py), attacked with raw sockets.

- 64 connections that trickle a request header that never ends, and 64 that announce a large
  body and trickle it, do not stop a normal client from being served promptly: the header
  deadline closes the first kind on time, and the per-client body share keeps the second kind
  from taking the whole body budget (another API key still gets its body read);
- the first-header deadline holds even for a connection that sends nothing at all, without
  relying on aiohttp's keep-alive timer; over HTTPS, a connection whose handshake ends after
  its deadline is closed as soon as it ends (the keep-alive timer alone: a whole timeout later);
- the share itself: one client past it gets 429 ``client_body_budget`` while another client is
  served, and its bytes come back when its requests end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import pytest

from services.gateway.body_budget import BodyBudget
from services.gateway.config import EdgeLimits
from services.gateway.edge_server import HEADER_DEADLINE_KEY
from services.gateway.rate_limit import RateLimitError
from services.gateway.state import STATE_KEY
from tests.gateway_fakes import (  # noqa: F401 - make_stack is a fixture
    MODEL,
    StackFactory,
    make_stack,
    post_raw,
)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ATTACKER = "sk-slow-attacker-000001"
NORMAL = "sk-normal-client-000002"
SLOW = 64


def _address(url: str) -> tuple[str, int]:
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    return host, int(port)


async def _open(url: str, first: bytes) -> socket.socket:
    """A raw, non-blocking connection to the gateway that has sent ``first``."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    await loop.sock_connect(sock, _address(url))
    await loop.sock_sendall(sock, first)
    return sock


async def _trickle(socks: list[socket.socket], every_s: float) -> None:
    """One byte on every still-open socket each ``every_s`` seconds (header or body bytes)."""
    while True:
        await asyncio.sleep(every_s)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.send(b"X")


def _is_closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset); reads and drops what is pending."""
    try:
        while sock.recv(65536):
            pass
        return True  # EOF
    except BlockingIOError:
        return False
    except OSError:
        return True


async def test_64_slow_header_and_64_slow_body_clients_do_not_stop_a_normal_one(
    make_stack: StackFactory,
) -> None:
    limits = EdgeLimits(header_read_timeout_s=2.0, max_body_memory_bytes=16 * 2**20,
                        max_body_memory_per_client_bytes=4 * 2**20)  # fmt: skip
    stack = await make_stack(keys=(ATTACKER, NORMAL), max_body_bytes=2**20, edge=limits)
    budget = stack.app[STATE_KEY].body_budget
    headers = [await _open(stack.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
               for _ in range(SLOW)]  # fmt: skip
    body_head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nAuthorization: Bearer " + ATTACKER.encode()
                 + b"\r\nContent-Length: " + str(2**20).encode() + b"\r\n\r\n{\"model\": ")
    bodies = [await _open(stack.url, body_head) for _ in range(SLOW)]  # fmt: skip
    trickle = asyncio.create_task(_trickle(headers + bodies, 0.2))
    try:
        await asyncio.sleep(0.5)
        # the attacker holds its share and no more; the rest of its bodies were refused unread
        assert budget.used_by(f"key-{_key_digest(ATTACKER)}") == 4 * 2**20
        assert budget.used == 4 * 2**20
        # a normal client, with a body big enough that a global-only budget would refuse it
        # had the attacker used 16 connections, is served promptly while all 128 still hang
        big = {**CHAT, "user": "u" * 200_000}
        auth = {"Authorization": f"Bearer {NORMAL}"}
        started = time.monotonic()
        for _ in range(3):
            status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", big, auth)
            assert status == 200, raw
        assert time.monotonic() - started < 2.0
        # the slow headers are closed at the deadline (2 s from accept), not kept for ever
        deadline = time.monotonic() + 4.0
        while not all(_is_closed(s) for s in headers) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert all(_is_closed(s) for s in headers), "a slow-header connection is still open"
        assert stack.app[HEADER_DEADLINE_KEY].closed >= SLOW
        status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", CHAT, auth)
        assert status == 200, raw
    finally:
        trickle.cancel()
        for sock in headers + bodies:
            sock.close()


def _key_digest(key: str) -> str:
    from services.gateway.auth import key_id

    return key_id(key).removeprefix("key-")


async def test_a_silent_connection_is_closed_at_the_header_deadline(
    make_stack: StackFactory,
) -> None:
    """Connects and sends nothing: the first-header deadline, counted from the accept, closes
    it whether or not this aiohttp version arms its keep-alive timer before a first request."""
    stack = await make_stack(edge=EdgeLimits(header_read_timeout_s=1.0))
    sock = await _open(stack.url, b"")
    started = time.monotonic()
    try:
        while not _is_closed(sock):
            assert time.monotonic() - started < 4.0, "the silent connection is still open"
            await asyncio.sleep(0.05)
        assert 0.8 <= time.monotonic() - started <= 3.0
    finally:
        sock.close()
    # a connection that sends its header in time is served and kept alive past the deadline
    status, _, _ = await post_raw(stack.url + "/v1/chat/completions", CHAT)
    assert status == 200


async def test_one_client_past_its_body_share_gets_429_while_another_is_served(
    make_stack: StackFactory,
) -> None:
    limits = EdgeLimits(max_body_memory_bytes=40_000, max_body_memory_per_client_bytes=10_000)
    stack = await make_stack(keys=(ATTACKER, NORMAL), max_body_bytes=8192, edge=limits)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nAuthorization: Bearer " + ATTACKER.encode() + b"\r\nContent-Length: 8000"
            b"\r\n\r\n{")  # fmt: skip
    slow = await _open(stack.url, head)
    try:
        await asyncio.sleep(0.3)
        mine = {"Authorization": f"Bearer {ATTACKER}"}
        status, raw, headers = await post_raw(stack.url + "/v1/chat/completions",
                                              {**CHAT, "user": "u" * 3000}, mine)  # fmt: skip
        assert status == 429 and headers["Retry-After"] == "1", raw
        assert json.loads(raw)["error"]["code"] == "client_body_budget"
        status, raw, _ = await post_raw(stack.url + "/v1/chat/completions",
                                        {**CHAT, "user": "u" * 3000},
                                        {"Authorization": f"Bearer {NORMAL}"})  # fmt: skip
        assert status == 200, raw
    finally:
        slow.close()
    await asyncio.sleep(0.3)  # the slow client left: its share is back
    assert stack.app[STATE_KEY].body_budget.used == 0


def test_body_budget_shares() -> None:
    budget = BodyBudget(100, 40, per_client_bytes=50)
    a1 = budget.reserve(40, "a")
    with pytest.raises(RateLimitError) as err:
        budget.reserve(20, "a")
    assert err.value.code == "client_body_budget"
    b1 = budget.reserve(40, "b")
    with pytest.raises(RateLimitError) as err:
        budget.reserve(30, "c")  # within c's share, past the whole budget
    assert err.value.code == "server_overloaded"
    with pytest.raises(RateLimitError) as err:
        budget.reserve(40, "a")  # past both: the server's answer
    assert err.value.code == "server_overloaded"
    a1.release()
    assert budget.used_by("a") == 0 and budget.used == 40
    b1.release()
    assert budget.used == 0
    assert BodyBudget(128 * 2**20, 4 * 2**20).per_client_bytes == 16 * 2**20
    assert BodyBudget(6000, 4096).per_client_bytes == 4096


async def test_a_tls_handshake_past_the_deadline_is_closed_once_it_completes(
    make_stack: StackFactory,
) -> None:
    """Over HTTPS the deadline passes while the client has not even said hello; once its
    handshake completes (the connection has a transport), it is closed at once."""
    import ssl

    from tests.tls_identities import cert_dir

    d = cert_dir()
    stack = await make_stack(https_cert=str(d / "gateway.pem"),
                             https_key=str(d / "gateway-key.pem"),
                             edge=EdgeLimits(header_read_timeout_s=1.0))  # fmt: skip
    context = ssl.create_default_context(cafile=str(d / "ca.pem"))
    context.check_hostname = False

    def handshake_late_then_wait() -> float:  # on a thread: the server's loop keeps running
        raw = socket.create_connection(_address(stack.url), timeout=10)
        time.sleep(1.5)  # past the deadline, before the ClientHello
        with context.wrap_socket(raw) as tls:
            started = time.monotonic()
            try:
                while tls.recv(1024):
                    pass
            except (ssl.SSLError, OSError):
                pass
            return time.monotonic() - started

    assert await asyncio.to_thread(handshake_late_then_wait) < 0.8  # keep-alive alone: 1 s
