"""SPIFFE IDs of Tandem's internal certificates: ``spiffe://<trust domain>/<role>``.

Every certificate a deployment's CA issues (``cert_authority.py``) names its role in one URI SAN
whose *trust domain* is that deployment's: ``tandem certs init`` makes up a new one per
deployment (``tandem-`` and 12 random hex digits; ``--trust-domain`` to choose it) and ``tandem
up`` one per start. A server takes its trust domain from its own certificate and grants a peer
only the roles its certificate names *in that trust domain* (``peer_roles.roles_in``).

Why: CA trust alone says "signed by this CA". Two deployments whose certificates one issuer signs
(one cert-manager ``ClusterIssuer`` for several namespaces, a company CA) would otherwise accept
each other's gateways and prefill workers. With per-deployment trust domains a certificate from
the other deployment passes the TLS handshake but carries no role here, so every RPC is refused.

Only URI SANs count. gRPC's auth context lists every SAN of the peer (DNS names, e-mail
addresses, IPs and URIs) as plain strings under one key, so a DNS name or an e-mail address that
happens to read ``spiffe://...`` would look like a role there; this module reads the verified
peer certificate itself (``x509_pem_cert``) with ``cryptography`` and takes its
``UniformResourceIdentifier`` entries only. Parsed certificates are cached by their PEM (a
connection's certificate is the same on every RPC).
"""

from __future__ import annotations

import functools
import re
import secrets

from cryptography import x509

from services.common.errors import InvalidArgumentError

SCHEME = "spiffe://"
DEFAULT_TRUST_DOMAIN = "tandem"
"""The trust domain of certificates issued without one (tests' fixed CAs; Kubernetes manifests
written before trust domains were per deployment)."""

_TRUST_DOMAIN = re.compile(r"^[a-z0-9._-]{1,255}$")  # the SPIFFE spec's trust-domain characters


def new_trust_domain() -> str:
    """A fresh deployment trust domain, e.g. ``tandem-3f9a0c21b7d4``."""
    return f"tandem-{secrets.token_hex(6)}"


def validate_trust_domain(name: str) -> str:
    """``name`` if it is a valid SPIFFE trust domain (lowercase letters, digits, ``.-_``);
    InvalidArgumentError otherwise."""
    if not _TRUST_DOMAIN.match(name):
        raise InvalidArgumentError(
            f"{name!r} is not a SPIFFE trust domain: 1 to 255 of a-z, 0-9, '.', '-', '_'",
            param="trust_domain")  # fmt: skip
    return name


def spiffe_id(trust_domain: str, role: str) -> str:
    """``spiffe://<trust_domain>/<role>``."""
    return f"{SCHEME}{trust_domain}/{role}"


def parse(uri: str) -> tuple[str, str] | None:
    """``(trust domain, path)`` of a SPIFFE ID with a one-segment path, else None."""
    if not uri.startswith(SCHEME):
        return None
    domain, sep, path = uri[len(SCHEME):].partition("/")
    if not sep or not path or "/" in path or not _TRUST_DOMAIN.match(domain):
        return None
    return domain, path


@functools.lru_cache(maxsize=1024)
def uri_sans(cert_pem: bytes) -> tuple[str, ...]:
    """The URI SANs of the first certificate in ``cert_pem`` (none for an unreadable one)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return ()
    return tuple(names.get_values_for_type(x509.UniformResourceIdentifier))


def trust_domain_of(cert_pem: bytes) -> str:
    """The trust domain of the certificate's SPIFFE ID; ``""`` when it has none or several
    (a certificate of no domain: a server holding it grants no peer any role)."""
    domains = {parsed[0] for uri in uri_sans(cert_pem) if (parsed := parse(uri))}
    return domains.pop() if len(domains) == 1 else ""


def roles_of(cert_pem: bytes, trust_domain: str, known: frozenset[str]) -> frozenset[str]:
    """The roles among ``known`` that the certificate's URI SANs name in ``trust_domain``."""
    if not trust_domain:
        return frozenset()
    roles = set()
    for uri in uri_sans(cert_pem):
        parsed = parse(uri)
        if parsed is not None and parsed[0] == trust_domain and parsed[1] in known:
            roles.add(parsed[1])
    return frozenset(roles)
