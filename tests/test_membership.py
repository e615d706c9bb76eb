"""Pools that follow DNS (services/gateway/membership.py): a name entry is every address it
resolves to, re-resolved; IP entries are fixed; a failed resolution keeps the last answer. The
same for the tokenizer pool (services/gateway/tokenizer_pool.py), down to real tokenizer servers
on two loopback addresses behind one name, one of which dies."""

from __future__ import annotations

import socket

from services.common.grpc_server import GrpcServerHandle, start_grpc_server
from services.common.pb import tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.backend import Backend
from services.gateway.config import GatewayConfig
from services.gateway.membership import Membership, is_name, resolve
from services.gateway.router import Router
from services.gateway.tokenizer_pool import TokenizerPool
from tests.gateway_fakes import FakeTokenizer
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
    config = GatewayConfig(tokenizer_addresses=("127.0.0.1:1",), prefill_addresses=("127.0.0.1:2",),
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


async def test_a_tokenizer_name_becomes_every_replica_and_a_dead_one_is_skipped() -> None:
    """``--tokenizer tokenizer:PORT`` where the name has two addresses (two loopback addresses,
    one port, as two pods behind a headless Service): both replicas serve, and when one dies
    the pool still answers every call and the next resolution drops it."""
    fakes = [FakeTokenizer(), FakeTokenizer()]
    servers: list[GrpcServerHandle] = []
    port = 0
    for host, fake in zip(("127.0.0.2", "127.0.0.1"), fakes):  # the second takes the first's port
        servers.append(await start_grpc_server(
            [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, fake, "tandem.v1.Tokenizer")],
            tls=tls_for("tokenizer"), host=host, port=port, grace=0.1))  # fmt: skip
        port = servers[-1].port
    config = GatewayConfig(tokenizer_addresses=(f"tokenizer:{port}",), prefill_addresses=(),
                           decode_addresses=("127.0.0.1:9",), tls=tls_for("gateway"))  # fmt: skip
    backend = Backend(config)
    pool = TokenizerPool(backend.tokenizers)
    dns = FakeDns()
    dns.records["tokenizer"] = ["127.0.0.1", "127.0.0.2"]
    membership = Membership(backend, Router(backend.prefill, backend.decode),
                            {"tokenizer": config.tokenizer_addresses}, tokenizers=pool,
                            resolver=dns)  # fmt: skip
    request = tokenizer_pb2.TokenizeRequest(text="hi", add_special_tokens=True)
    try:
        assert membership.dynamic and pool.addresses == [f"tokenizer:{port}"]
        await membership.refresh()  # resolved, and every new replica's health checked at once
        assert pool.addresses == [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]
        assert pool.healthy_count() == 2
        for _ in range(4):
            assert list((await pool.tokenize(request)).token_ids) == [ord("h"), ord("i")]
        assert [len(f.requests) for f in fakes] == [2, 2]  # round-robin
        await servers[0].stop(0)  # 127.0.0.2 dies; DNS still lists it for a while
        for _ in range(4):
            assert (await pool.tokenize(request)).prompt_text == "hi"
        assert [len(f.requests) for f in fakes] == [2, 6]
        assert [r.healthy for r in pool.replicas()] == [True, False]
        dns.records["tokenizer"] = ["127.0.0.1"]  # the replica left the Service
        await membership.refresh()
        assert pool.addresses == [f"127.0.0.1:{port}"] and pool.healthy_count() == 1
    finally:
        await backend.close()
        for server in servers:
            await server.stop(0)
