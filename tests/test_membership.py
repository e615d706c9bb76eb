"""Worker pools that follow DNS (services/gateway/membership.py): a name entry is every address
it resolves to, re-resolved; IP entries are fixed; a failed resolution keeps the last answer."""

from __future__ import annotations

import socket

from services.gateway.backend import Backend
from services.gateway.config import GatewayConfig
from services.gateway.membership import Membership, is_name, resolve
from services.gateway.router import Router
from tests.tls_identities import tls_for


class FakeDns:
    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.fail = False

    async def __call__(self, host: str, port: int) -> list[str]:
        if self.fail:
            raise socket.gaierror("temporary failure in name resolution")
        return [f"{ip}:{port}" for ip in self.records.get(host, [])]


def _parts(decode: tuple[str, ...]) -> tuple[Backend, Router]:
    config = GatewayConfig(tokenizer_address="127.0.0.1:1", prefill_addresses=("127.0.0.1:2",),
                           decode_addresses=decode, tls=tls_for("gateway"))  # fmt: skip
    backend = Backend(config)
    return backend, Router(backend.prefill, backend.decode)


def _addresses(router: Router, role: str) -> list[str]:
    return [w.address for w in router.workers(role)]  # type: ignore[arg-type]


def test_names_and_literals() -> None:
    assert is_name("decode:50071") and is_name("localhost:1")
    assert not is_name("127.0.0.1:50071") and not is_name("[::1]:50071")


async def test_a_name_becomes_every_address_it_has_and_follows_changes() -> None:
    backend, router = _parts(("decode:50071", "127.0.0.1:9"))
    dns = FakeDns()
    dns.records["decode"] = ["10.0.0.2", "10.0.0.1"]
    membership = Membership(backend, router, {"decode": ["decode:50071", "127.0.0.1:9"]},
                            resolver=dns)  # fmt: skip
    try:
        assert membership.dynamic
        await membership.refresh()  # (the new workers are polled at once: unreachable here)
        assert _addresses(router, "decode") == ["10.0.0.2:50071", "10.0.0.1:50071", "127.0.0.1:9"]
        kept = router.workers("decode")[0]
        kept.in_flight = 1  # a request running on it
        dns.records["decode"] = ["10.0.0.2", "10.0.0.3"]  # scaled: one replica replaced
        await membership.refresh()
        assert _addresses(router, "decode") == ["10.0.0.2:50071", "10.0.0.3:50071", "127.0.0.1:9"]
        assert router.workers("decode")[0] is kept and kept.in_flight == 1  # state kept
        dns.fail = True  # a DNS hiccup keeps the last answer
        await membership.refresh()
        assert _addresses(router, "decode") == ["10.0.0.2:50071", "10.0.0.3:50071", "127.0.0.1:9"]
        assert backend.worker("decode", "10.0.0.3:50071") is router.workers("decode")[1].client
    finally:
        await backend.close()


async def test_literal_entries_never_change_and_start_nothing() -> None:
    backend, router = _parts(("127.0.0.1:5",))
    membership = Membership(backend, router, {"decode": ["127.0.0.1:5"]})
    try:
        assert not membership.dynamic
        await membership.start()
        assert _addresses(router, "decode") == ["127.0.0.1:5"]
        await membership.stop()
    finally:
        await backend.close()


async def test_the_real_resolver_prefers_ipv4() -> None:
    assert await resolve("localhost", 50071) == ["127.0.0.1:50071"]
