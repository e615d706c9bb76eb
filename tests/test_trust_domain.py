"""Per-deployment trust domains and key custody (issue 47, item 3), with real gRPC servers on
127.0.0.1 and the real ``tandem certs init``:

- a certificate the same CA signed, for the right role but another deployment's trust domain
  (``spiffe://<other>/gateway``), passes the TLS handshake and gets PERMISSION_DENIED on every
  RPC: two deployments under one issuer no longer accept each other;
- only URI SANs count: a DNS SAN that reads ``spiffe://tandem/gateway`` grants nothing;
- ``tandem certs init --role-dir ROLE=DIR`` leaves each role's key alone in its directory and
  the CA key in the CA's only, with one generated trust domain per deployment (a new one per
  init, kept for roles issued later by ``--if-missing``).
"""

from __future__ import annotations

import argparse
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from services.certs_cli import add_arguments, run
from services.cli import main as tandem_main
from services.common.cert_authority import issue
from services.common.errors import InvalidArgumentError
from services.common.grpc_channel import open_channel
from services.common.grpc_server import GrpcServerHandle, start_grpc_server
from services.common.internal_tls import InternalTls
from services.common.peer_roles import server_name
from services.common.pb import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.spiffe_id import parse, roles_of, trust_domain_of, uri_sans
from tests.tls_identities import session_ca, tls_for

TOKENIZE = "/tandem.v1.Tokenizer/GetModelInfo"


class _Tokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    async def GetModelInfo(self, request: object, context: object) -> tokenizer_pb2.ModelInfo:
        return tokenizer_pb2.ModelInfo()


@pytest.fixture
async def tokenizer_server() -> AsyncIterator[GrpcServerHandle]:
    handle = await start_grpc_server(
        [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, _Tokenizer(), "tandem.v1.Tokenizer")],
        tls=tls_for("tokenizer"), host="127.0.0.1", port=0, grace=0.1,
    )  # fmt: skip
    yield handle
    await handle.stop(0)


def _identity(role: str, **kwargs: object) -> InternalTls:
    issued = issue(session_ca(), role, **kwargs)  # type: ignore[arg-type]
    return InternalTls.from_pem(issued.cert_pem, issued.key_pem, session_ca().cert_pem)


async def _code(address: str, tls: InternalTls, *, server_name: str | None = None
                ) -> grpc.StatusCode:  # fmt: skip
    """The status of one call from ``tls``'s identity: over ``open_channel`` (which verifies the
    server as a tokenizer of ``tls``'s own trust domain), or, given ``server_name``, over a raw
    channel that verifies that name instead (to reach the server's own check)."""
    if server_name is None:
        channel = open_channel(address, tls=tls, server_role="tokenizer")
    else:
        channel = grpc.aio.secure_channel(
            address, tls.channel_credentials(),
            options=[("grpc.ssl_target_name_override", server_name)])  # fmt: skip
    async with channel:
        call = channel.unary_unary(TOKENIZE, request_serializer=lambda _: b"",
                                   response_deserializer=lambda b: b)  # fmt: skip
        try:
            await call(b"", timeout=5)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


async def test_another_deployments_certificate_gets_no_role(
    tokenizer_server: GrpcServerHandle,
) -> None:
    address = tokenizer_server.address
    assert tls_for("tokenizer").trust_domain == "tandem"  # the test CA's fixed domain
    assert await _code(address, tls_for("gateway")) == grpc.StatusCode.OK
    foreign = _identity("gateway", trust_domain="tandem-other-deployment")
    assert foreign.trust_domain == "tandem-other-deployment"
    # past its own client's check (it would not even connect: the next test), the server refuses
    assert await _code(address, foreign, server_name="tokenizer.tandem.internal") == (
        grpc.StatusCode.PERMISSION_DENIED)
    assert await _code(address, foreign) == grpc.StatusCode.UNAVAILABLE


async def test_a_client_refuses_a_server_of_another_deployment() -> None:
    """The client side: a server whose certificate the same CA signed for the right role, but in
    another trust domain, fails the handshake (its DNS names carry its own domain), so a client
    never believes another deployment's answers."""
    mine, theirs = "tandem-0a1b2c3d4e5f", "tandem-9f8e7d6c5b4a"
    handle = await start_grpc_server(
        [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, _Tokenizer(), "tandem.v1.Tokenizer")],
        tls=_identity("tokenizer", trust_domain=theirs), host="127.0.0.1", port=0, grace=0.1,
    )  # fmt: skip
    try:
        assert await _code(handle.address, _identity("gateway", trust_domain=theirs)) == (
            grpc.StatusCode.OK)  # its own deployment's client
        assert await _code(handle.address, _identity("gateway", trust_domain=mine)) == (
            grpc.StatusCode.UNAVAILABLE)  # the handshake: not tokenizer.<mine>.tandem.internal
        assert await _code(handle.address, tls_for("gateway")) == (
            grpc.StatusCode.UNAVAILABLE)  # nor the legacy tokenizer.tandem.internal
    finally:
        await handle.stop(0)


def test_server_names_carry_the_trust_domain() -> None:
    assert server_name("decode", "tandem-1a2b") == "decode.tandem-1a2b.tandem.internal"
    assert server_name(None, "prod.example") == "prod.example.tandem.internal"
    assert server_name("decode") == server_name("decode", "") == "decode.tandem.internal"
    assert server_name("decode", "a_b") == "decode.no-dns-form.invalid.tandem.internal"
    names = _identity("prefill", trust_domain="tandem-1a2b").cert_pem
    from cryptography import x509

    sans = x509.load_pem_x509_certificate(names).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)  # fmt: skip
    assert "prefill.tandem-1a2b.tandem.internal" in sans and "tandem-1a2b.tandem.internal" in sans
    assert "prefill.tandem.internal" not in sans  # not the legacy, shared name
    with pytest.raises(InvalidArgumentError, match="DNS name"):
        _identity("prefill", trust_domain="tandem_1a2b")  # a SPIFFE domain, not a DNS one


async def test_only_uri_sans_name_a_role(tokenizer_server: GrpcServerHandle) -> None:
    # an operator certificate whose *DNS* SAN reads like the gateway's SPIFFE ID
    sneaky = _identity("operator", extra_names=["spiffe://tandem/gateway"])
    assert "spiffe://tandem/gateway" not in uri_sans(sneaky.cert_pem)
    assert roles_of(sneaky.cert_pem, "tandem", frozenset({"gateway", "operator"})) == {"operator"}
    assert await _code(tokenizer_server.address, sneaky) == grpc.StatusCode.PERMISSION_DENIED


def test_spiffe_ids_parse_strictly() -> None:
    assert parse("spiffe://tandem-1a/decode") == ("tandem-1a", "decode")
    for bad in ("spiffe://tandem", "spiffe://tandem/", "spiffe://Tandem/decode",
                "spiffe://tandem/a/b", "https://tandem/decode", "spiffe:///decode",
                "spiffe://TRUST_DOMAIN/decode"):  # the Kubernetes example's placeholder  # fmt: skip
        assert parse(bad) is None, bad
    assert trust_domain_of(b"not a certificate") == ""


def _init(directory: Path, *extra: str) -> None:
    assert tandem_main(["certs", "init", str(directory), *extra]) == 0


def test_certs_init_keeps_each_key_in_its_own_directory(tmp_path: Path) -> None:
    ca_dir = tmp_path / "ca"
    roles = ("gateway", "tokenizer", "prefill", "decode")
    dirs = {role: tmp_path / f"certs-{role}" for role in roles}
    _init(ca_dir, "--if-missing", *(f"--role-dir={r}={d}" for r, d in dirs.items()))
    assert (ca_dir / "ca-key.pem").exists()
    domain = (ca_dir / "trust-domain").read_text().strip()
    assert domain.startswith("tandem-") and len(domain) == len("tandem-") + 12
    for role, directory in dirs.items():
        files = sorted(p.name for p in directory.iterdir())
        assert files == sorted(["ca.pem", f"{role}.pem", f"{role}-key.pem"]), (role, files)
        assert stat.S_IMODE((directory / f"{role}-key.pem").stat().st_mode) == 0o600
        cert = (directory / f"{role}.pem").read_bytes()
        assert uri_sans(cert) == (f"spiffe://{domain}/{role}",)
        assert not (ca_dir / f"{role}-key.pem").exists()  # not in the CA's directory either
    # a new volume for one role later: issued from the kept CA, in the same trust domain
    new_decode = tmp_path / "certs-decode-new"
    _init(ca_dir, "--if-missing", f"--role-dir=decode={new_decode}")
    assert trust_domain_of((new_decode / "decode.pem").read_bytes()) == domain
    assert (new_decode / "ca.pem").read_bytes() == (ca_dir / "ca.pem").read_bytes()
    # a certificate an older Tandem issued (no <role>.<domain>.tandem.internal) is issued again,
    # a current one is kept as it is
    from services.common.cert_authority import carries_server_name, load_ca

    ca = load_ca((ca_dir / "ca.pem").read_bytes(), (ca_dir / "ca-key.pem").read_bytes())
    old = issue(ca, "prefill", trust_domain="tandem")  # the legacy names only
    (dirs["prefill"] / "prefill.pem").write_bytes(old.cert_pem)
    kept = (dirs["gateway"] / "gateway.pem").read_bytes()
    _init(ca_dir, "--if-missing", *(f"--role-dir={r}={d}" for r, d in dirs.items()))
    renewed = (dirs["prefill"] / "prefill.pem").read_bytes()
    assert renewed != old.cert_pem and carries_server_name(renewed, "prefill", domain)
    assert trust_domain_of(renewed) == domain
    assert (dirs["gateway"] / "gateway.pem").read_bytes() == kept
    # another deployment: another trust domain; a chosen one is used as given
    _init(tmp_path / "other")
    assert (tmp_path / "other" / "trust-domain").read_text().strip() != domain
    _init(tmp_path / "named", "--trust-domain", "prod.example")
    assert trust_domain_of((tmp_path / "named" / "gateway.pem").read_bytes()) == "prod.example"


def test_certs_init_refuses_bad_role_dirs_and_domains(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for bad in (["--role-dir", "nobody=/x"], ["--role-dir", "decode"],
                ["--trust-domain", "Not Valid"]):  # fmt: skip
        with pytest.raises(InvalidArgumentError):
            run(parser.parse_args([str(tmp_path / "x"), *bad]))
