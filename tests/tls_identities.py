"""Test identities for internal mutual TLS: one CA per test session and a certificate per role.

Tests that start gRPC servers or open channels directly pass ``tls=tls_for("decode")`` (the
server's own role) or ``tls=tls_for("gateway")`` (a client calling as the gateway). The CA and
certificates are made once (ECDSA keys: milliseconds) and cached for the session;
:func:`cert_dir` writes them to a temporary directory for tests that start processes (removed
when the session ends).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from services.common.cert_authority import CertAuthority, issue, make_ca
from services.common.internal_tls import InternalTls
from services.common.peer_roles import ROLES, server_name


@functools.cache
def session_ca() -> CertAuthority:
    """The test session's CA."""
    return make_ca(name="Tandem test CA")


@functools.cache
def tls_for(role: str) -> InternalTls:
    """An identity of ``role`` signed by the session CA."""
    issued = issue(session_ca(), role)
    return InternalTls.from_pem(issued.cert_pem, issued.key_pem, session_ca().cert_pem)


@functools.cache
def cert_dir() -> Path:
    """A directory with the session CA's ``ca.pem`` and ``<role>.pem`` / ``<role>-key.pem``."""
    directory = Path(tempfile.mkdtemp(prefix="tandem-test-certs-"))
    atexit.register(shutil.rmtree, directory, True)  # keys never outlive the test session
    (directory / "ca.pem").write_bytes(session_ca().cert_pem)
    for role in ROLES:  # the very identities of tls_for
        (directory / f"{role}.pem").write_bytes(tls_for(role).cert_pem)
        key = directory / f"{role}-key.pem"
        key.write_bytes(tls_for(role).key_pem)
        key.chmod(0o600)
    return directory


def tls_flags(role: str) -> list[str]:
    """``--tls-cert/--tls-key/--tls-ca`` for a process of ``role`` (files in :func:`cert_dir`)."""
    directory = cert_dir()
    return ["--tls-cert", str(directory / f"{role}.pem"), "--tls-key",
            str(directory / f"{role}-key.pem"), "--tls-ca", str(directory / "ca.pem")]


@functools.cache
def fake_server_tls() -> InternalTls:
    """A server identity that passes as any role's server (its SAN names every
    ``<role>.tandem.internal``), for fakes that serve several services on one port."""
    issued = issue(session_ca(), "decode", extra_names=[server_name(r) for r in ROLES])
    return InternalTls.from_pem(issued.cert_pem, issued.key_pem, session_ca().cert_pem)
