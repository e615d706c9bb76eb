"""Internal mutual TLS (docs/security.md): real gRPC servers on 127.0.0.1, real clients.

Every RPC of every Tandem service (the tokenizer, prefill and decode services, the prefix-cache
feed, health and reflection) is called by clients that must be refused: one with no TLS at all,
one with TLS but no certificate, one whose certificate another CA signed (at the handshake), and
one whose certificate is valid but of a role that may not call the method (PERMISSION_DENIED,
before the handler runs). The role that may call it gets through to the handler. Plus the
plaintext health-only port, the client's check of the server's role, ``tandem certs init``, the
flags, and ``tandem up``'s throwaway CA (private while it runs, gone when it stops).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli import main as tandem_main
from services.common.cert_authority import issue, make_ca
from services.common.errors import InvalidArgumentError
from services.common.grpc_channel import open_channel
from services.common.grpc_server import GrpcServerHandle, start_grpc_server
from services.common.internal_tls import (
    INSECURE_WARNING,
    InternalTls,
    add_tls_arguments,
    tls_from_args,
)
from services.common.pb import (
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    prefix_cache_pb2,
    prefix_cache_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.common.peer_roles import ACCESS_POLICY, ROLES, allowed_roles, server_name
from tests.tls_identities import session_ca, tls_flags, tls_for
from tests.up_process import REPO, StartUp, port_flags

# (server role, add function, servicer base class, proto module) per service
SERVICES = [
    ("tokenizer", tokenizer_pb2_grpc.add_TokenizerServicer_to_server,
     tokenizer_pb2_grpc.TokenizerServicer, tokenizer_pb2),
    ("prefill", prefill_pb2_grpc.add_PrefillServicer_to_server,
     prefill_pb2_grpc.PrefillServicer, prefill_pb2),
    ("decode", decode_pb2_grpc.add_DecodeServicer_to_server,
     decode_pb2_grpc.DecodeServicer, decode_pb2),
    ("decode", prefix_cache_pb2_grpc.add_PrefixCacheServicer_to_server,
     prefix_cache_pb2_grpc.PrefixCacheServicer, prefix_cache_pb2),
]  # fmt: skip


def _methods() -> list[tuple[str, str, bool, bool]]:
    """Every (server role, /Service/Method, client streaming, server streaming) of Tandem."""
    out = []
    for role, _, _, module in SERVICES:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                out.append((role, f"/{service.full_name}/{method.name}",
                            method.client_streaming, method.server_streaming))  # fmt: skip
    out.append(("decode", "/grpc.health.v1.Health/Check", False, False))
    out.append(("decode", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                True, True))  # fmt: skip
    return out


METHODS = _methods()


@pytest.fixture
async def servers() -> AsyncIterator[dict[str, GrpcServerHandle]]:
    """One real server per role (the generated base servicers: every method is registered and
    answers UNIMPLEMENTED, so a call that gets past TLS and the role check says so)."""
    handles: dict[str, GrpcServerHandle] = {}
    try:
        for role in ("tokenizer", "prefill", "decode"):
            specs = [(add, base(), module.DESCRIPTOR.services_by_name[name].full_name)
                     for r, add, base, module in SERVICES if r == role
                     for name in module.DESCRIPTOR.services_by_name]  # fmt: skip
            handles[role] = await start_grpc_server(specs, tls=tls_for(role), host="127.0.0.1",
                                                    port=0, grace=0.1, health_port=0)
        yield handles
    finally:
        for handle in handles.values():
            await handle.stop(0)


async def _call(channel: grpc.aio.Channel, method: str, client_streaming: bool,
                server_streaming: bool) -> grpc.StatusCode:  # fmt: skip
    """Call ``method`` with an empty message; the status it ends with (OK when it succeeds)."""
    raw = {"request_serializer": lambda _: b"", "response_deserializer": lambda b: b}
    try:
        if client_streaming and server_streaming:
            call = channel.stream_stream(method, **raw)(iter([b""]), timeout=5)
            async for _ in call:
                pass
        elif client_streaming:
            await channel.stream_unary(method, **raw)(iter([b""]), timeout=5)
        elif server_streaming:
            async for _ in channel.unary_stream(method, **raw)(b"", timeout=5):
                pass
        else:
            await channel.unary_unary(method, **raw)(b"", timeout=5)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _other_ca_tls(role: str) -> InternalTls:
    other = make_ca(name="someone else's CA")
    issued = issue(other, role)
    return InternalTls.from_pem(issued.cert_pem, issued.key_pem, session_ca().cert_pem)


def _channel_without_certificate(address: str) -> grpc.aio.Channel:
    """TLS that trusts the deployment CA but presents no certificate of its own."""
    credentials = grpc.ssl_channel_credentials(root_certificates=session_ca().cert_pem)
    options = [("grpc.ssl_target_name_override", server_name(None))]
    return grpc.aio.secure_channel(address, credentials, options=options)


@pytest.mark.parametrize(("role", "method", "client_streaming", "server_streaming"), METHODS,
                         ids=[m[1] for m in METHODS])  # fmt: skip
async def test_every_rpc_refuses_strangers_and_wrong_roles(
    servers: dict[str, GrpcServerHandle], role: str, method: str, client_streaming: bool,
    server_streaming: bool,
) -> None:  # fmt: skip
    address = servers[role].address
    shape = (method, client_streaming, server_streaming)
    strangers = {
        "plaintext": grpc.aio.insecure_channel(address),
        "TLS without a certificate": _channel_without_certificate(address),
        "a certificate of another CA": open_channel(address, tls=_other_ca_tls("gateway"),
                                                    server_role=role),
    }  # fmt: skip
    for who, channel in strangers.items():
        async with channel:
            assert await _call(channel, *shape) == grpc.StatusCode.UNAVAILABLE, who
    allowed = allowed_roles(method)
    assert allowed, f"{method} has no access rule"
    for client in ROLES:
        async with open_channel(address, tls=tls_for(client), server_role=role) as channel:
            code = await _call(channel, *shape)
        if client in allowed:
            assert code != grpc.StatusCode.PERMISSION_DENIED, (client, method)
        else:
            assert code == grpc.StatusCode.PERMISSION_DENIED, (client, method)


def _rpcs_in_the_protos() -> set[tuple[str, str]]:
    """Every (package.Service, Method) declared in ``protos/``, read from the .proto text (not
    the generated stubs, which could be stale)."""
    found = set()
    for path in sorted((REPO / "protos").rglob("*.proto")):
        text = re.sub(r"//[^\n]*", "", path.read_text(encoding="utf-8"))
        package = re.search(r"^\s*package\s+([\w.]+)\s*;", text, re.M)
        assert package, path
        for service, body in re.findall(r"\bservice\s+(\w+)\s*\{(.*?)\n\}", text, re.S):
            for method in re.findall(r"\brpc\s+(\w+)\s*\(", body):
                found.add((f"{package.group(1)}.{service}", method))
    return found


def test_every_rpc_has_an_explicit_decision_and_no_rule_is_a_wildcard() -> None:
    rpcs = _rpcs_in_the_protos()
    assert ("tandem.v1.Decode", "TransferKV") in rpcs and len(rpcs) >= 14  # the reader works
    assert all(method != "*" and "*" not in service for service, method in ACCESS_POLICY)
    missing = sorted(rpc for rpc in rpcs if rpc not in ACCESS_POLICY)
    assert not missing, f"RPCs with no access decision in peer_roles.ACCESS_POLICY: {missing}"
    # the infrastructure services every server adds are listed method by method too
    for module, name in ((health_pb2, "Health"),):
        service = module.DESCRIPTOR.services_by_name[name]
        for method in service.methods:
            assert (service.full_name, method.name) in ACCESS_POLICY, method.full_name
    # and nothing is listed that no proto declares (a stale entry would hide a rename)
    infrastructure = {service for service, _ in ACCESS_POLICY if service.startswith("grpc.")}
    stale = sorted(key for key in ACCESS_POLICY if key[0] not in infrastructure
                   and key not in rpcs)  # fmt: skip
    assert not stale, stale
    for service, method in rpcs:
        assert allowed_roles(f"/{service}/{method}"), (service, method)
    # a method no one listed is nobody's, even on a service whose other methods are open
    assert allowed_roles("/tandem.v1.Decode/SomethingNew") == frozenset()
    assert allowed_roles("/grpc.health.v1.Health/SomethingNew") == frozenset()


async def test_an_unlisted_method_is_refused_to_every_role() -> None:
    """A handler registered on the decode service without an access entry (a new RPC someone
    forgot to list) is refused before it runs, to the gateway too (formerly ``Decode/*``)."""
    ran: list[bytes] = []

    async def unlisted(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        ran.append(request)
        return b"ran"

    def add(servicer: object, server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(unlisted)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("tandem.v1.Decode", {"Unlisted": handler}),))

    handle = await start_grpc_server([(add, None, "tandem.v1.Decode")], tls=tls_for("decode"),
                                     host="127.0.0.1", port=0, grace=0.1)  # fmt: skip
    try:
        for client in ROLES:
            async with open_channel(handle.address, tls=tls_for(client),
                                    server_role="decode") as channel:  # fmt: skip
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await channel.unary_unary("/tandem.v1.Decode/Unlisted")(b"x", timeout=5)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, client
            assert "/tandem.v1.Decode/Unlisted is not allowed" in (err.value.details() or "")
        assert ran == []
    finally:
        await handle.stop(0)


def test_the_access_policy_is_the_issue_s() -> None:
    gateway_only = ["/tandem.v1.Decode/Generate", "/tandem.v1.Decode/Reserve",
                    "/tandem.v1.Decode/Abort", "/tandem.v1.Prefill/Prefill",
                    "/tandem.v1.PrefixCache/Watch", "/tandem.v1.Tokenizer/Tokenize",
                    "/tandem.v1.Tokenizer/Detokenize", "/tandem.v1.Tokenizer/GetModelInfo"]  # fmt: skip
    for method in gateway_only:
        assert allowed_roles(method) == {"gateway"}, method
    assert allowed_roles("/tandem.v1.Decode/TransferKV") == {"prefill"}
    assert allowed_roles("/tandem.v1.Decode/KVStore") == {"prefill"}
    assert allowed_roles("/tandem.v1.Nope/Nothing") == frozenset()
    assert allowed_roles("/grpc.health.v1.Health/Check") == set(ROLES)
    for method in ("/tandem.v1.Decode/GetStats", "/tandem.v1.Prefill/GetStats",
                   "/tandem.v1.Prefill/Abort", "/tandem.v1.Prefill/Embed"):  # fmt: skip
        assert allowed_roles(method) == {"gateway"}, method


async def test_a_client_refuses_a_server_of_the_wrong_role(
    servers: dict[str, GrpcServerHandle],
) -> None:
    # a prefill worker's certificate cannot stand in for a decode worker's
    async with open_channel(servers["prefill"].address, tls=tls_for("gateway"),
                            server_role="decode") as channel:  # fmt: skip
        code = await _call(channel, "/tandem.v1.Decode/Generate", False, True)
    assert code == grpc.StatusCode.UNAVAILABLE


async def test_the_health_port_is_plaintext_and_serves_health_only(
    servers: dict[str, GrpcServerHandle],
) -> None:
    handle = servers["decode"]
    assert handle.health_port and handle.health_port != handle.port
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.health_port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tandem.v1.Decode"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for method, cs, ss in (("/tandem.v1.Decode/Generate", False, True),
                               ("/tandem.v1.Decode/TransferKV", True, False),
                               ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                True, True)):  # fmt: skip
            assert await _call(channel, method, cs, ss) == grpc.StatusCode.UNIMPLEMENTED
    await handle.stop(0)  # the health port closes with the server


async def test_a_server_without_an_identity_does_not_start() -> None:
    spec = (decode_pb2_grpc.add_DecodeServicer_to_server, decode_pb2_grpc.DecodeServicer(),
            "tandem.v1.Decode")  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="internal TLS identity"):
        await start_grpc_server([spec], tls=InternalTls(), host="127.0.0.1", port=0)


# --- flags ---------------------------------------------------------------------------------------


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_tls_arguments(parser)
    return parser.parse_args(argv)


def test_tls_is_required_unless_insecure_is_asked_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    for name in ("TANDEM_TLS_CERT", "TANDEM_TLS_KEY", "TANDEM_TLS_CA", "TANDEM_INSECURE_INTERNAL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidArgumentError, match="--tls-cert, --tls-key, --tls-ca is not set"):
        tls_from_args(_parse())
    assert tls_from_args(_parse(*tls_flags("decode"))) == tls_for("decode")
    missing = [*tls_flags("decode")[:-1], str(tmp_path / "nope.pem")]
    with pytest.raises(InvalidArgumentError, match="--tls-ca .*nope.pem: No such file"):
        tls_from_args(_parse(*missing))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(InvalidArgumentError, match="not PEM"):
        tls_from_args(_parse(*tls_flags("decode")[:-1], str(tmp_path / "junk.pem")))
    with caplog.at_level(logging.WARNING):
        assert tls_from_args(_parse("--insecure-internal")).insecure
    assert INSECURE_WARNING in caplog.text
    monkeypatch.setenv("TANDEM_TLS_CERT", "/x/cert.pem")
    assert _parse().tls_cert == "/x/cert.pem"  # the environment is read when the parser is built
    assert _parse().health_port == -1
    assert "BEGIN" not in repr(tls_for("decode"))


def test_certs_init_writes_a_ca_and_every_role(tmp_path: Path) -> None:
    target = tmp_path / "certs"
    assert tandem_main(["certs", "init", str(target)]) == 0
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    for role in ROLES:
        assert stat.S_IMODE((target / f"{role}-key.pem").stat().st_mode) == 0o600
        InternalTls.from_files(target / f"{role}.pem", target / f"{role}-key.pem",
                               target / "ca.pem")  # fmt: skip
    assert (target / "ca-key.pem").exists()
    before = (target / "ca.pem").read_bytes()
    assert tandem_main(["certs", "init", str(target)]) == 2  # never replaces a CA silently
    assert tandem_main(["certs", "init", str(target), "--if-missing"]) == 0
    assert (target / "ca.pem").read_bytes() == before
    assert tandem_main(["certs", "init", str(target), "--force"]) == 0
    assert (target / "ca.pem").read_bytes() != before


# --- tandem up -----------------------------------------------------------------------------------


def test_tandem_up_makes_a_private_throwaway_ca_and_removes_it(start_up: StartUp) -> None:
    flags = port_flags(0, 0)
    up = start_up("--prefill", "0", "--decode", "0", *flags, own_certs=True)
    up.wait_ready()
    up.log.seek(0)
    found = re.search(r"throwaway CA and certificates in (\S+)", up.log.read())
    assert found, "the launcher names its certificate directory"
    directory = Path(found.group(1))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert not (directory / "ca-key.pem").exists()  # the throwaway CA's key is never written
    address = f"127.0.0.1:{flags[flags.index('--tokenizer-port') + 1]}"

    async def probe() -> tuple[grpc.StatusCode, grpc.StatusCode]:
        async with grpc.aio.insecure_channel(address) as channel:
            plain = await _call(channel, "/tandem.v1.Tokenizer/GetModelInfo", False, False)
        # the session CA's gateway certificate is not this deployment's
        async with open_channel(address, tls=tls_for("gateway"), server_role="tokenizer") as ch:
            foreign = await _call(ch, "/tandem.v1.Tokenizer/GetModelInfo", False, False)
        return plain, foreign

    import asyncio

    assert asyncio.run(probe()) == (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(timeout=60) == 0
    assert not directory.exists()


def test_serve_refuses_to_start_without_certificates() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    result = subprocess.run(
        [sys.executable, "-m", "services", "serve", "tokenizer", "--port", "0",
         "--metrics-port", "0"],  # fmt: skip
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "tandem: error: internal gRPC is mutual TLS" in result.stderr
    assert "Traceback" not in result.stderr
