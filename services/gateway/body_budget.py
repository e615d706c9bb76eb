"""A global budget of request-body bytes in memory, so that many clients sending large bodies at
once cannot exhaust the gateway's memory before any of them is admitted.

Bodies are read before the admission slot is taken (a slow body must not hold a slot), so
admission alone does not bound them: ``max_in_flight`` × ``max_body_bytes`` could be a gigabyte.
The budget does:

1. before a body is read, :meth:`BodyBudget.reserve` counts its ``Content-Length`` (already
   checked against ``max_body_bytes``), or ``max_body_bytes`` for a chunked body whose size is
   unknown; when that does not fit, the request gets 429 ``server_overloaded`` (Retry-After: 1)
   without a byte of its body read;
2. the :class:`BodyLease` is released when the request ends (its parsed body lives that long).

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

    __slots__ = ("_budget", "size")

    def __init__(self, budget: BodyBudget, size: int) -> None:
        super().__init__()
        self._budget = budget
        self.size = size

    def _give_back(self) -> None:
        self._budget._give_back(self.size)


class BodyBudget:
    """At most ``total_bytes`` of request bodies counted at once."""

    RETRY_AFTER_S = 1.0

    def __init__(self, total_bytes: int, max_body_bytes: int) -> None:
        if total_bytes < max_body_bytes:
            raise InvalidArgumentError("the body memory budget must hold one largest body",
                                       param="max_body_memory")  # fmt: skip
        self.total_bytes = total_bytes
        self.max_body_bytes = max_body_bytes
        self._used = 0

    @property
    def used(self) -> int:
        return self._used

    def reserve(self, content_length: int | None) -> BodyLease:
        """Count one body of ``content_length`` bytes (None: unknown, counted at the largest
        allowed); raise RateLimitError (429) when the budget cannot hold it now."""
        size = self.max_body_bytes if content_length is None else max(0, content_length)
        size = min(size, self.max_body_bytes)  # a larger one is refused (413) while read
        if self._used + size > self.total_bytes:
            raise RateLimitError(
                "The server is holding too many request bodies in memory. Please retry shortly.",
                retry_after=self.RETRY_AFTER_S,
                code="server_overloaded",
            )
        self._used += size
        return BodyLease(self, size)

    def _give_back(self, size: int) -> None:
        self._used -= size
