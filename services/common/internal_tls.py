"""Mutual TLS between Tandem's services: one process's identity (certificate, key, the CA it
trusts) and the gRPC credentials made from it.

Every internal gRPC hop (gateway → tokenizer / prefill / decode, prefill → decode's
``TransferKV``, the prefix-cache feed, reflection, health checks) is mutual TLS by default:

- a server (``grpc_server``) binds with ``ssl_server_credentials(require_client_auth=True)``, so
  a peer without a certificate signed by the deployment's CA is refused at the handshake, and
  it checks the peer's *role* on every RPC (``peer_roles.RoleInterceptor``);
- a channel (``grpc_channel``) presents this process's certificate and verifies the server's
  against the same CA and against the role it expects (``decode.tandem.internal``; the address it
  dials does not matter, so pod IPs and DNS names of replicas all work).

Every service takes ``--tls-cert``, ``--tls-key`` and ``--tls-ca`` (env ``TANDEM_TLS_CERT``,
``TANDEM_TLS_KEY``, ``TANDEM_TLS_CA``, read when the parser is built, never at import).
``tandem up`` makes a throwaway CA and passes these to every child; ``tandem certs init DIR``
writes them for compose and Kubernetes. ``--insecure-internal`` turns all of it off (plaintext,
no roles); it logs a warning at start and is never a default.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.errors import InvalidArgumentError
from services.common.spiffe_id import trust_domain_of

logger = logging.getLogger(__name__)

CERT_ENV = "TANDEM_TLS_CERT"
KEY_ENV = "TANDEM_TLS_KEY"
CA_ENV = "TANDEM_TLS_CA"
INSECURE_ENV = "TANDEM_INSECURE_INTERNAL"

INSECURE_WARNING = (
    "--insecure-internal: internal gRPC is PLAINTEXT and UNAUTHENTICATED; anyone who reaches a "
    "worker's port can generate tokens past the gateway's keys, limits and filters, forge KV "
    "transfers and read the prefix cache. Use it only on a network you trust completely."
)


@dataclass(frozen=True, slots=True)
class InternalTls:
    """One process's internal-TLS identity, or plaintext when ``insecure``.

    Attributes:
        cert_pem / key_pem: this process's certificate and private key (PEM).
        ca_pem: the deployment's CA certificate; peers must be signed by it.
        insecure: plaintext, unauthenticated gRPC (``--insecure-internal``); the PEM fields are
            then empty.
    """

    cert_pem: bytes = b""
    key_pem: bytes = b""
    ca_pem: bytes = b""
    insecure: bool = False

    def __repr__(self) -> str:  # never print a key
        return "InternalTls(insecure)" if self.insecure else "InternalTls(mtls)"

    @classmethod
    def plaintext(cls) -> InternalTls:
        """No TLS at all (``--insecure-internal``)."""
        return cls(insecure=True)

    @classmethod
    def from_pem(cls, cert_pem: bytes, key_pem: bytes, ca_pem: bytes) -> InternalTls:
        """An identity from PEM bytes; InvalidArgumentError when one is empty or not PEM."""
        for name, data in (("certificate", cert_pem), ("key", key_pem), ("CA", ca_pem)):
            if b"-----BEGIN " not in data:
                raise InvalidArgumentError(f"the internal TLS {name} is not PEM", param="tls")
        return cls(cert_pem=cert_pem, key_pem=key_pem, ca_pem=ca_pem)

    @classmethod
    def from_files(cls, cert: str | Path, key: str | Path, ca: str | Path) -> InternalTls:
        """An identity read from three PEM files (read once, at start)."""
        data = []
        for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
            try:
                data.append(Path(path).read_bytes())
            except OSError as err:
                raise InvalidArgumentError(
                    f"{flag} {path}: {os.strerror(err.errno) if err.errno else err}",
                    param=flag.lstrip("-").replace("-", "_"),
                ) from err
        return cls.from_pem(*data)

    @property
    def trust_domain(self) -> str:
        """The SPIFFE trust domain of this process's certificate (``spiffe_id.py``): the only
        domain whose roles its server grants; ``""`` (no peer gets a role) when it has none."""
        if self.insecure or not self.cert_pem:
            return ""
        return trust_domain_of(self.cert_pem)

    @property
    def prefix_salt(self) -> bytes:
        """The deployment's prefix-cache salt (``prefix_hash.prefix_root``): a digest of the CA
        certificate, the one thing every process of a deployment holds alike and another
        deployment does not; empty in plaintext."""
        if self.insecure or not self.ca_pem:
            return b""
        return hashlib.sha256(b"tandem-prefix-salt\0" + self.ca_pem).digest()

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for a server that requires and verifies a client certificate."""
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)],
            root_certificates=self.ca_pem,
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for a channel that presents this identity and verifies the server's."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem,
            private_key=self.key_pem,
            certificate_chain=self.cert_pem,
        )


def add_tls_arguments(parser: argparse.ArgumentParser, *, health_port: bool = True) -> None:
    """Add ``--tls-cert/--tls-key/--tls-ca``, ``--insecure-internal`` and (for gRPC servers)
    ``--health-port``; environment defaults are read here, when the parser is built."""
    env = os.environ.get
    group = parser.add_argument_group("internal mutual TLS (docs/security.md)")
    group.add_argument("--tls-cert", default=env(CERT_ENV), metavar="PEM",
                       help=f"this service's certificate, signed by the deployment CA "
                            f"(env {CERT_ENV}; `tandem certs init DIR` writes them)")
    group.add_argument("--tls-key", default=env(KEY_ENV), metavar="PEM",
                       help=f"this service's private key (env {KEY_ENV})")
    group.add_argument("--tls-ca", default=env(CA_ENV), metavar="PEM",
                       help=f"the deployment CA certificate peers must be signed by (env {CA_ENV})")
    group.add_argument("--insecure-internal", action="store_true",
                       default=env(INSECURE_ENV, "") not in ("", "0", "false"),
                       help="plaintext, unauthenticated internal gRPC: NOT for any shared "
                            f"network (env {INSECURE_ENV}=1)")
    if health_port:
        group.add_argument("--health-port", type=int, default=int(env("TANDEM_HEALTH_PORT", "-1")),
                           metavar="PORT",
                           help="also serve grpc.health.v1, and nothing else, in plaintext on this "
                                "port, for probes that present no certificate (kubelet's gRPC "
                                "probes); default -1: none (env TANDEM_HEALTH_PORT)")


def tls_from_args(args: argparse.Namespace) -> InternalTls:
    """The identity the flags of :func:`add_tls_arguments` name.

    Raises:
        InvalidArgumentError: TLS is on and a file is missing, unreadable or not PEM.
    """
    if getattr(args, "insecure_internal", False):
        logger.warning(INSECURE_WARNING)
        return InternalTls.plaintext()
    missing = [flag for flag, value in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                                        ("--tls-ca", args.tls_ca)) if not value]  # fmt: skip
    if missing:
        raise InvalidArgumentError(
            f"internal gRPC is mutual TLS and {', '.join(missing)} is not set: pass "
            "--tls-cert, --tls-key and --tls-ca (`tandem certs init DIR` writes a CA and a "
            "certificate per role; `tandem up` makes its own), or --insecure-internal on a "
            "network you trust completely",
            param="tls",
        )
    return InternalTls.from_files(args.tls_cert, args.tls_key, args.tls_ca)
