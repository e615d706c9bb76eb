"""API-key authentication for the gateway (``Authorization: Bearer <key>``, as OpenAI).

Keys come from a file (one per line, ``#`` comments and blank lines ignored) and/or a
comma-separated value such as the ``TANDEM_API_KEYS`` environment variable; the caller reads the
environment and passes the value in, so nothing is read at import time. With no keys configured,
authentication is disabled and every request is ``"anonymous"``.

Only SHA-256 digests of the keys are kept, and a presented key is compared against every digest
with :func:`hmac.compare_digest`, so neither timing nor a memory dump reveals a key. A key's id
(``key-`` plus 12 hex digits of its digest) names it in logs and rate limits without exposing it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from services.common.errors import FailedPreconditionError, TandemError

logger = logging.getLogger(__name__)

ANONYMOUS = "anonymous"

MISSING_KEY_MESSAGE = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


class AuthenticationError(TandemError):
    """A missing or wrong API key (HTTP 401, gRPC UNAUTHENTICATED), shaped like OpenAI's."""

    grpc_code = "UNAUTHENTICATED"
    http_status = 401
    error_type = "invalid_request_error"


class ApiKeyAuth:
    """Checks bearer tokens against the configured keys; disabled when there are none."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(sorted({_digest(k) for k in keys}))

    @classmethod
    def from_sources(
        cls, keys_file: str | os.PathLike[str] | None, env_value: str | None
    ) -> ApiKeyAuth:
        """Union of the keys in ``keys_file`` and the comma-separated ``env_value``.

        A keys file that cannot be read or holds no key is a configuration error (auth was
        clearly wanted), raised as FailedPreconditionError rather than silently disabling auth.
        """
        keys: set[str] = set()
        if keys_file is not None:
            try:
                text = Path(keys_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise FailedPreconditionError(
                    f"Cannot read API keys file {keys_file}: {exc}", param="api_keys_file"
                ) from exc
            from_file = {
                line.strip()
                for line in text.splitlines()
                if line.strip() and not line.strip().startswith("#")
            }
            if not from_file:
                raise FailedPreconditionError(
                    f"API keys file {keys_file} holds no keys", param="api_keys_file"
                )
            keys |= from_file
        if env_value:
            keys |= {k.strip() for k in env_value.split(",") if k.strip()}
        auth = cls(keys)
        if auth.enabled:
            logger.info("API key authentication enabled with %d keys", len(auth._digests))
        else:
            logger.info("API key authentication disabled (no keys configured)")
        return auth

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, header: str | None) -> str:
        """Authenticate an ``Authorization`` header value; return the key id.

        Returns ``"anonymous"`` when authentication is disabled; raises AuthenticationError
        (401) when the header is missing, not a bearer token, or names an unknown key.
        """
        if not self.enabled:
            return ANONYMOUS
        key = _bearer_token(header)
        if key is None:
            raise AuthenticationError(MISSING_KEY_MESSAGE, code=None)
        presented = _digest(key)
        found = False
        for digest in self._digests:  # no early exit: the time taken does not depend on which
            found |= hmac.compare_digest(presented, digest)
        if not found:
            # No part of the presented key in the message: it is logged (request log), and a
            # wrong key is often a near miss of a real one or another service's secret.
            raise AuthenticationError("Incorrect API key provided.", code="invalid_api_key")
        return key_id(key)


def key_id(key: str) -> str:
    """A stable, non-secret name for a key."""
    return "key-" + _digest(key).hex()[:12]


def _bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()
