"""A deployment's certificate authority: one CA and a certificate per service role.

Tandem's internal gRPC hops are mutual TLS (``internal_tls.py``): every process presents a
certificate signed by the deployment's CA, and its *role* is written in the certificate as a SAN
URI ``spiffe://<trust domain>/<role>``, the trust domain being the deployment's own
(``spiffe_id.py``; ``peer_roles.py`` reads it per RPC). This module makes those certificates with
the ``cryptography`` package (nothing hand-rolled):

- :func:`make_ca` creates a self-signed CA (ECDSA P-256, ``BasicConstraints(ca=True)``);
- :func:`issue` signs one role's certificate: SAN URI ``spiffe://<trust domain>/<role>``, DNS names
  ``<role>.<trust domain>.tandem.internal`` and ``<trust domain>.tandem.internal`` (the names
  clients of that deployment verify, whatever address they dial: ``peer_roles.server_name``;
  ``<role>.tandem.internal`` in the legacy domain ``tandem``), ``localhost`` and ``127.0.0.1``,
  plus any extra names; usable as both a TLS server and a TLS client;
- :func:`issue_identities` makes them in memory (benchmarks and tests that run servers
  in-process);
- :func:`write_deployment_certs` writes ``ca.pem`` (the CA certificate), ``trust-domain`` and
  ``<role>.pem`` / ``<role>-key.pem`` per role into a directory, keys with mode 0600 — or, for
  key custody (compose), each role's three files (``ca.pem``, its certificate, its key) into a
  directory of its own, so that a container mounting one role's directory holds no other key.
  The CA's private key is written only when asked (``tandem certs init`` keeps it so more
  certificates can be issued; ``tandem up``'s throwaway CA never writes it).

Why ECDSA P-256: key generation takes microseconds (``tandem up`` makes a CA and five
certificates at every start) and TLS 1.3 handshakes with it are cheap.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.errors import InvalidArgumentError
from services.common.internal_tls import InternalTls
from services.common.peer_roles import ROLES, dns_form, server_name
from services.common.spiffe_id import (
    DEFAULT_TRUST_DOMAIN,
    new_trust_domain,
    spiffe_id,
    validate_trust_domain,
)

DEFAULT_VALIDITY_DAYS = 365
CA_FILE = "ca.pem"
CA_KEY_FILE = "ca-key.pem"
TRUST_DOMAIN_FILE = "trust-domain"


@dataclass(frozen=True, slots=True)
class IssuedCert:
    """A PEM certificate and its PEM private key (PKCS#8, unencrypted)."""

    cert_pem: bytes
    key_pem: bytes


@dataclass(frozen=True, slots=True)
class CertAuthority:
    """A CA certificate and its key; :func:`issue` signs role certificates with it."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return _key_pem(self.key)


def make_ca(name: str = "Tandem deployment CA", days: int = DEFAULT_VALIDITY_DAYS) -> CertAuthority:
    """A new self-signed CA valid for ``days`` days."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tandem")])  # fmt: skip
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return CertAuthority(cert=cert, key=key)


def load_ca(cert_pem: bytes, key_pem: bytes) -> CertAuthority:
    """A CA from its PEM certificate and key (to issue more certificates later)."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("the CA key is not an EC private key")
    return CertAuthority(cert=x509.load_pem_x509_certificate(cert_pem), key=key)


def issue(
    ca: CertAuthority,
    role: str,
    *,
    extra_names: Iterable[str] = (),
    days: int = DEFAULT_VALIDITY_DAYS,
    trust_domain: str = DEFAULT_TRUST_DOMAIN,
) -> IssuedCert:
    """A certificate for ``role`` signed by ``ca`` (server and client use).

    Args:
        ca: the signing CA.
        role: one of :data:`services.common.peer_roles.ROLES`.
        extra_names: more DNS names or IP addresses for the SAN (e.g. a Kubernetes service name).
        days: validity.
        trust_domain: the deployment's SPIFFE trust domain (``spiffe_id.py``).

    Raises:
        ValueError: an unknown role.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    validate_trust_domain(trust_domain)
    if dns_form(trust_domain) is None:  # clients verify it as a DNS name (peer_roles.server_name)
        raise InvalidArgumentError(
            f"trust domain {trust_domain!r} cannot be part of a DNS name (servers are verified as "
            "<role>.<trust domain>.tandem.internal): use a-z, 0-9, '-' and '.' only",
            param="trust_domain")  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(spiffe_id(trust_domain, role)),
        x509.DNSName(server_name(role, trust_domain)),
        x509.DNSName(server_name(None, trust_domain)),
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    for extra in extra_names:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(extra)))
        except ValueError:
            names.append(x509.DNSName(extra))
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"tandem-{role}"),
                                 x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tandem"),
                                 x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                   ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
        .sign(ca.key, hashes.SHA256())
    )  # fmt: skip
    return IssuedCert(cert_pem=cert.public_bytes(serialization.Encoding.PEM), key_pem=_key_pem(key))


def issue_identities(ca: CertAuthority | None = None, roles: Sequence[str] = ROLES,
                     trust_domain: str | None = None) -> dict[str, InternalTls]:  # fmt: skip
    """In-memory identities of ``roles`` signed by ``ca`` (a new CA by default) in one trust
    domain (a new one by default), for processes that start servers and clients themselves
    (benchmarks, tests); nothing touches the disk."""
    authority = ca or make_ca()
    domain = trust_domain or new_trust_domain()
    out = {}
    for role in roles:
        issued = issue(authority, role, trust_domain=domain)
        out[role] = InternalTls.from_pem(issued.cert_pem, issued.key_pem, authority.cert_pem)
    return out


def write_deployment_certs(
    directory: Path,
    *,
    roles: Sequence[str] = ROLES,
    ca: CertAuthority | None = None,
    keep_ca_key: bool = False,
    extra_names: Iterable[str] = (),
    days: int = DEFAULT_VALIDITY_DAYS,
    trust_domain: str | None = None,
    role_dirs: Mapping[str, Path] | None = None,
) -> CertAuthority:
    """Write ``ca.pem``, ``trust-domain`` and ``<role>.pem`` / ``<role>-key.pem`` per role into
    ``directory``; a role in ``role_dirs`` gets its files (and a copy of ``ca.pem``) in its own
    directory instead, and ``directory`` then holds none of its key.

    Directories are created (mode 0700) if missing; keys are written with mode 0600. Returns
    the CA used (a new one unless ``ca`` is given); its key goes to ``ca-key.pem`` only with
    ``keep_ca_key``. ``trust_domain``: the deployment's (a new one by default).
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    authority = ca or make_ca(days=days)
    domain = validate_trust_domain(trust_domain or new_trust_domain())
    names = tuple(extra_names)
    _write(directory / CA_FILE, authority.cert_pem, 0o644)
    _write(directory / TRUST_DOMAIN_FILE, domain.encode() + b"\n", 0o644)
    if keep_ca_key:
        _write(directory / CA_KEY_FILE, authority.key_pem, 0o600)
    for role in roles:
        write_role_files(authority, role, (role_dirs or {}).get(role, directory),
                         trust_domain=domain, extra_names=names, days=days)  # fmt: skip
    return authority


def write_role_files(ca: CertAuthority, role: str, directory: Path, *, trust_domain: str,
                     extra_names: Iterable[str] = (),
                     days: int = DEFAULT_VALIDITY_DAYS) -> None:  # fmt: skip
    """Issue ``role``'s certificate and write it, its key and ``ca.pem`` into ``directory``."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    issued = issue(ca, role, extra_names=extra_names, days=days, trust_domain=trust_domain)
    _write(directory / CA_FILE, ca.cert_pem, 0o644)
    _write(directory / f"{role}.pem", issued.cert_pem, 0o644)
    _write(directory / f"{role}-key.pem", issued.key_pem, 0o600)


def carries_server_name(cert_pem: bytes, role: str, trust_domain: str) -> bool:
    """Whether ``cert_pem`` names ``role``'s server in ``trust_domain`` as clients verify it
    (``peer_roles.server_name``): False for one an older Tandem issued, before the trust domain
    was in that name, so ``tandem certs init --if-missing`` issues it again."""
    try:
        sans = x509.load_pem_x509_certificate(cert_pem).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)  # fmt: skip
    except (ValueError, x509.ExtensionNotFound):
        return False
    return server_name(role, trust_domain) in sans


def role_files(directory: Path, role: str) -> tuple[Path, Path, Path]:
    """``(cert, key, ca)`` paths of ``role`` in a directory :func:`write_deployment_certs` wrote."""
    return directory / f"{role}.pem", directory / f"{role}-key.pem", directory / CA_FILE


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` created with ``mode`` (never briefly world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)
