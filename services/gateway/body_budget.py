"""A budget of request-body bytes in memory, global and per client, so that many clients sending
large bodies at once cannot exhaust the gateway's memory before any of them is admitted, and one
client's slow uploads cannot take the whole budget from everyone else.

Bodies are read before the admission slot is taken (a slow body must not hold a slot), so
admission alone does not bound them: ``max_in_flight`` × ``max_body_bytes`` could be a gigabyte.
The budget does:

1. before a body is read, :meth:`BodyBudget.reserve` counts its ``Content-Length`` (already
   checked against ``max_body_bytes``), or ``max_body_bytes`` for a chunked body whose size is
   unknown; when that does not fit in the global budget the request gets 429
   ``server_overloaded``, and when it does not fit in *its client's share* (an API key's id, or
   ``ip:<address>`` without auth: ``client_limits.client_id``) 429 ``client_body_budget``; both
   with Retry-After: 1 and without a byte of the body read;
2. the :class:`BodyLease` is released when the request ends (its parsed body lives that long).

Why a share: with only the global budget (128 MiB), 32 connections that each announce a 4 MiB
body and then trickle it in refuse every other client until they time out. With a share (a
client holds at most ``per_client_bytes``, by default an eighth of the budget but never less
than one largest body), one client's uploads leave the rest to others; it takes eight clients
(keys or addresses) to fill the budget.

Everything runs on the gateway's event loop: no locks.
"""

from __future__ import annotations

import logging

from services.common.errors import InvalidArgumentError
from services.gateway.rate_limit import RateLimitError
from services.gateway.release_once import ReleaseOnce

logger = logging.getLogger(__name__)


class BodyLease(ReleaseOnce):
    """``size`` bytes of the budget; ``release()`` is idempotent. Also a context manager."""

    __slots__ = ("_budget", "size", "client")

    def __init__(self, budget: BodyBudget, size: int, client: str) -> None:
        super().__init__()
        self._budget = budget
        self.size = size
        self.client = client

    def _give_back(self) -> None:
        self._budget._give_back(self.size, self.client)


def default_per_client_bytes(total_bytes: int, max_body_bytes: int) -> int:
    """A client's share when none is configured: an eighth of the budget, at least one body."""
    return max(max_body_bytes, total_bytes // 8)


class BodyBudget:
    """At most ``total_bytes`` of request bodies counted at once, of which at most
    ``per_client_bytes`` for one client (None: :func:`default_per_client_bytes`)."""

    RETRY_AFTER_S = 1.0

    def __init__(self, total_bytes: int, max_body_bytes: int,
                 per_client_bytes: int | None = None) -> None:  # fmt: skip
        if total_bytes < max_body_bytes:
            raise InvalidArgumentError("the body memory budget must hold one largest body",
                                       param="max_body_memory")  # fmt: skip
        share = per_client_bytes
        if share is None:
            share = default_per_client_bytes(total_bytes, max_body_bytes)
        if not max_body_bytes <= share <= total_bytes:
            raise InvalidArgumentError(
                "the per-client body memory share must hold one largest body and fit in the "
                "whole budget", param="max_body_memory_per_client")  # fmt: skip
        self.total_bytes = total_bytes
        self.max_body_bytes = max_body_bytes
        self.per_client_bytes = share
        self._used = 0
        self._by_client: dict[str, int] = {}

    @property
    def used(self) -> int:
        return self._used

    def used_by(self, client: str) -> int:
        """Bytes ``client`` holds now."""
        return self._by_client.get(client, 0)

    def reserve(self, content_length: int | None, client: str = "") -> BodyLease:
        """Count one body of ``content_length`` bytes (None: unknown, counted at the largest
        allowed) for ``client``; raise RateLimitError (429) when the budget, or the client's
        share of it, cannot hold it now."""
        size = self.max_body_bytes if content_length is None else max(0, content_length)
        size = min(size, self.max_body_bytes)  # a larger one is refused (413) while read
        held = self._by_client.get(client, 0)
        if self._used + size > self.total_bytes:
            raise RateLimitError(
                "The server is holding too many request bodies in memory. Please retry shortly.",
                retry_after=self.RETRY_AFTER_S,
                code="server_overloaded",
            )
        if held + size > self.per_client_bytes:
            raise RateLimitError(
                "You are sending too many request bodies at once. Please retry shortly.",
                retry_after=self.RETRY_AFTER_S,
                code="client_body_budget",
            )
        self._used += size
        self._by_client[client] = held + size
        return BodyLease(self, size, client)

    def _give_back(self, size: int, client: str) -> None:
        self._used -= size
        left = self._by_client.get(client, 0) - size
        if left > 0:
            self._by_client[client] = left
        else:  # no entry per client that ever sent a body: the map stays as small as the load
            self._by_client.pop(client, None)
