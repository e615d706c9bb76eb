"""Who may call what: the service roles, the per-RPC access policy, and the interceptor that
enforces it.

Every Tandem process holds a certificate signed by the deployment's CA (``cert_authority.py``)
whose URI SAN carries its role as ``spiffe://<deployment trust domain>/<role>``
(``spiffe_id.py``). TLS (``internal_tls.py``) proves the peer holds a certificate the CA signed;
:class:`RoleInterceptor` then reads the peer's roles from its certificate's URI SANs in the
server's own trust domain (only URI SANs, only this deployment's domain) and checks, on every
RPC, that the peer's role may call the method. :data:`ACCESS_POLICY` lists every method by its
full name, with no wildcard, so an RPC added to a proto is refused to everyone until it is
listed here (a test enumerates every RPC of ``protos/`` and checks each has an entry):

==========================================  ===============================================
method                                      allowed roles
==========================================  ===============================================
``tandem.v1.Tokenizer/`` Tokenize,          gateway
Detokenize, GetModelInfo
``tandem.v1.Prefill/`` Prefill, Embed,      gateway
Abort, GetStats
``tandem.v1.Decode/`` Reserve, Generate,    gateway
Abort, GetStats
``tandem.v1.Decode/TransferKV``             prefill
``tandem.v1.Decode/KVStore``                prefill (the KV channel's rendezvous store)
``tandem.v1.PrefixCache/Watch``             gateway
``grpc.health.v1.Health/`` Check, Watch,    any role of the deployment
List
reflection's ``ServerReflectionInfo``       any role of the deployment
anything else                               nobody
==========================================  ===============================================

A refused call gets ``PERMISSION_DENIED`` naming the peer's role and the method, before the
handler runs. The ``operator`` role (``tandem up``'s readiness checks, ``grpcurl`` by hand,
container health checks) may only ask for health and reflection.

Roles are also the names a client verifies a server by: a channel to a decode worker expects a
certificate for ``decode.tandem.internal`` (:func:`server_name`), whatever address it dialled,
so a prefill worker's certificate cannot stand in for a decode worker's.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
import grpc.aio

from services.common.grpc_errors import rewrap_handler
from services.common.spiffe_id import DEFAULT_TRUST_DOMAIN, roles_of, spiffe_id

logger = logging.getLogger(__name__)

GATEWAY = "gateway"
TOKENIZER = "tokenizer"
PREFILL = "prefill"
DECODE = "decode"
OPERATOR = "operator"
ROLES = (GATEWAY, TOKENIZER, PREFILL, DECODE, OPERATOR)
ANY_ROLE = frozenset(ROLES)

SERVER_NAME_SUFFIX = "tandem.internal"

_GATEWAY_ONLY = frozenset({GATEWAY})
_PREFILL_ONLY = frozenset({PREFILL})

# (service, method) -> roles allowed: one entry per RPC, no wildcard (a method not listed is
# refused to every role, so a new RPC stays closed until someone decides who may call it).
ACCESS_POLICY: dict[tuple[str, str], frozenset[str]] = {
    ("tandem.v1.Tokenizer", "Tokenize"): _GATEWAY_ONLY,
    ("tandem.v1.Tokenizer", "Detokenize"): _GATEWAY_ONLY,
    ("tandem.v1.Tokenizer", "GetModelInfo"): _GATEWAY_ONLY,
    ("tandem.v1.Prefill", "Prefill"): _GATEWAY_ONLY,
    ("tandem.v1.Prefill", "Embed"): _GATEWAY_ONLY,
    ("tandem.v1.Prefill", "Abort"): _GATEWAY_ONLY,
    ("tandem.v1.Prefill", "GetStats"): _GATEWAY_ONLY,
    ("tandem.v1.Decode", "Reserve"): _GATEWAY_ONLY,
    ("tandem.v1.Decode", "Generate"): _GATEWAY_ONLY,
    ("tandem.v1.Decode", "Abort"): _GATEWAY_ONLY,
    ("tandem.v1.Decode", "GetStats"): _GATEWAY_ONLY,
    ("tandem.v1.Decode", "TransferKV"): _PREFILL_ONLY,
    ("tandem.v1.Decode", "KVStore"): _PREFILL_ONLY,
    ("tandem.v1.PrefixCache", "Watch"): _GATEWAY_ONLY,
    ("grpc.health.v1.Health", "Check"): ANY_ROLE,
    ("grpc.health.v1.Health", "Watch"): ANY_ROLE,
    ("grpc.health.v1.Health", "List"): ANY_ROLE,
    ("grpc.reflection.v1alpha.ServerReflection", "ServerReflectionInfo"): ANY_ROLE,
    ("grpc.reflection.v1.ServerReflection", "ServerReflectionInfo"): ANY_ROLE,
}


def role_uri(role: str, trust_domain: str = DEFAULT_TRUST_DOMAIN) -> str:
    """The SAN URI that names ``role`` in a certificate, e.g. ``spiffe://tandem-3f9a/decode``."""
    return spiffe_id(trust_domain, role)


_DNS_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
UNNAMEABLE_DOMAIN = "no-dns-form.invalid"
"""What a client checks when its own trust domain has no DNS form (``_`` in it): a name no
certificate of ours carries, so such a client connects to nobody (fail closed)."""


def dns_form(trust_domain: str) -> str | None:
    """``trust_domain`` as DNS labels (it is one already when every dot-separated part is a DNS
    label: what ``tandem certs init`` makes), or None when it cannot be (a ``_``, say)."""
    labels = trust_domain.split(".")
    if len(trust_domain) > 200 or not all(_DNS_LABEL.match(label) for label in labels):
        return None
    return trust_domain


def server_name(role: str | None, trust_domain: str = DEFAULT_TRUST_DOMAIN) -> str:
    """The DNS name a client checks a server's certificate against, bound to the client's own
    trust domain: ``<role>.<trust domain>.tandem.internal``, or ``<trust domain>.tandem.internal``
    (any member of the deployment) when the role is not known.

    Why the trust domain is in a DNS name: gRPC's Python API lets a client check nothing of a
    server's certificate but its chain and the host name set by ``grpc.ssl_target_name_override``
    (docs/security.md, "Roles and certificates"). With the domain in that name, a server of
    another deployment whose certificate the same CA signed fails the handshake. The legacy
    domain ``tandem`` (and none: a certificate without a SPIFFE ID) keeps the names of before,
    ``<role>.tandem.internal``."""
    if trust_domain in ("", DEFAULT_TRUST_DOMAIN):
        suffix = SERVER_NAME_SUFFIX
    else:
        suffix = f"{dns_form(trust_domain) or UNNAMEABLE_DOMAIN}.{SERVER_NAME_SUFFIX}"
    return f"{role}.{suffix}" if role else suffix


def allowed_roles(method: str) -> frozenset[str]:
    """The roles that may call ``/package.Service/Method``: its own entry in
    :data:`ACCESS_POLICY`, or nobody (no wildcard, no default)."""
    service, _, name = method.lstrip("/").partition("/")
    return ACCESS_POLICY.get((service, name), frozenset())


def peer_identity(peer: str, auth_context: dict[str, Iterable[bytes]]) -> str:
    """Which peer process is calling, for what is advertised to one peer (a KV channel's pair
    group, ``channel_store.py``): the peer's host (gRPC's ``context.peer()``,
    ``ipv4:10.0.0.5:41234`` → ``ipv4:10.0.0.5``) and a digest of its verified certificate, so
    that two prefill pods sharing one certificate, or two processes on one host with their own
    certificates, are distinct peers (plaintext: the host alone). Quotas count per
    :func:`caller_identity` instead."""
    host = peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer
    pem = b"".join(auth_context.get("x509_pem_cert", ()))
    if not pem:
        return host
    return f"{host}/{hashlib.sha256(pem).hexdigest()[:16]}"


def caller_identity(peer: str, auth_context: dict[str, Iterable[bytes]]) -> str:
    """Who is calling, for per-caller quotas (``reservation_quota.py``): the identity its
    verified certificate proves — the certificate's URI SANs (its role, ``spiffe://…/<role>``)
    and a digest of the certificate itself — never the address it calls from. A caller cannot
    become many by opening connections from many addresses or ports, and one certificate is one
    caller wherever it calls from; two certificates (two issued identities) are two callers.
    Without TLS (``--insecure-internal``) there is no identity to read, and the peer's host
    stands in."""
    pem = b"".join(auth_context.get("x509_pem_cert", ()))
    if not pem:
        host = peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer
        return f"address:{host}"
    uris = sorted(_text(value) for value in auth_context.get("peer_spiffe_id", ()))
    if not uris:
        uris = sorted(text for value in auth_context.get("x509_subject_alternative_name", ())
                      if "://" in (text := _text(value)))  # fmt: skip
    return f"{','.join(uris) or 'no-uri'}#{hashlib.sha256(pem).hexdigest()[:16]}"


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def roles_in(auth_context: dict[str, Iterable[bytes]],
             trust_domain: str = DEFAULT_TRUST_DOMAIN) -> frozenset[str]:  # fmt: skip
    """The roles a verified peer certificate names in ``trust_domain``: its
    ``spiffe://<trust_domain>/<role>`` URI SANs, read from the certificate itself
    (``x509_pem_cert``; gRPC's SAN list mixes DNS names and URIs, so it is not used)."""
    pem = b"".join(auth_context.get("x509_pem_cert", ()))
    return roles_of(pem, trust_domain, ANY_ROLE) if pem else frozenset()


def _guard(behavior: Callable[..., Any], method: str, allowed: frozenset[str],
           streaming_response: bool, trust_domain: str) -> Callable[..., Any]:  # fmt: skip
    """Wrap one handler so that it first checks the peer's role."""

    async def check(context: grpc.aio.ServicerContext) -> None:
        roles = roles_in(context.auth_context(), trust_domain)
        if not roles & allowed:
            who = ", ".join(sorted(roles)) or "no Tandem role"
            logger.warning("refused %s to a peer with %s (%s)", method, who, context.peer())
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} is not allowed for a peer with {who}",
            )

    if streaming_response and (inspect.isasyncgenfunction(behavior)
                               or not inspect.iscoroutinefunction(behavior)):

        async def stream_wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            result = behavior(request, context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            else:
                for item in result:
                    yield item

        return stream_wrapper

    # unary responses, and streaming handlers that write with ``context.write`` (coroutines)
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await check(context)
        result = behavior(request, context)
        if hasattr(result, "__await__"):
            result = await result
        return result

    return wrapper


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with ``PERMISSION_DENIED``, every RPC whose peer's role may not call it
    (:data:`ACCESS_POLICY`); roles count only in ``trust_domain`` (the server's own, from its
    certificate). Installed only on mutual-TLS servers."""

    def __init__(self, trust_domain: str = DEFAULT_TRUST_DOMAIN) -> None:
        self.trust_domain = trust_domain

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        allowed = allowed_roles(method)
        return rewrap_handler(
            handler,
            lambda behavior, streaming: _guard(behavior, method, allowed, streaming,
                                               self.trust_domain),
        )
