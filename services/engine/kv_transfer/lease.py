"""Leases on a prefill worker's KV blocks while they are shipped to a decode worker (docs/kv-handoff.md).

After prefill, a request's blocks stay allocated (held by the engine loop) so they can be read
and sent. A lease bounds how long: it ends when decode acknowledges, when the transfer fails or
is aborted, or when it expires — whichever comes first, exactly once, because every way out pops
the lease from this table first:

  1. ``grant(request_id, on_expire)`` when the transfer starts; the lease expires ``ttl`` seconds
     later, and ``renew(request_id)`` moves that to ``ttl`` seconds from now each time the
     transfer makes progress (the receiver took another chunk), so the lease bounds a stall, not
     how long a large payload takes to a busy decode worker.
  2. ``release(request_id)`` on ack, failure or abort: pops the lease and frees the blocks.
  3. The reaper task, every ``interval`` seconds, pops each expired lease, counts it in
     ``tandem:kv_transfer_leases_expired_total``, calls its ``on_expire`` (the sender cancels the
     transfer) and frees the blocks.
  4. ``close()`` stops the reaper and frees whatever is still leased.

Freeing goes through ``EngineLoop.release_nowait`` (the engine thread pops the held blocks, so a
second free is a no-op even if two paths raced).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import FailedPreconditionError, InvalidArgumentError
from services.common.metrics import TandemMetrics
from services.engine.runtime.engine_loop import EngineLoop

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Lease:
    """One request's lease: when it was granted and when it expires (``time.monotonic``)."""

    request_id: str
    granted: float
    expires: float
    on_expire: Callable[[], None]


class LeaseTable:
    """Leases by request id, with a background reaper (see the module lifecycle)."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        ttl: float = 30.0,
        *,
        interval: float | None = None,
        metrics: TandemMetrics | None = None,
    ) -> None:
        if ttl <= 0:
            raise InvalidArgumentError("the lease TTL must be positive", param="lease_seconds")
        self.engine_loop = engine_loop
        self.ttl = ttl
        self.interval = interval if interval is not None else min(1.0, ttl / 4)
        self.metrics = metrics
        self._leases: dict[str, Lease] = {}
        self._reaper: asyncio.Task[None] | None = None
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def start(self) -> None:
        """Start the reaper on the running event loop (once)."""
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever(), name="kv-lease-reaper")

    async def close(self) -> None:
        """Stop the reaper and free every block still leased."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        for request_id in list(self._leases):
            self.release(request_id)

    def grant(self, request_id: str, on_expire: Callable[[], None]) -> Lease:
        """Lease ``request_id``'s held blocks for ``ttl`` seconds."""
        if request_id in self._leases:
            raise FailedPreconditionError(f"request {request_id!r} already holds a KV lease")
        now = time.monotonic()
        lease = Lease(request_id, now, now + self.ttl, on_expire)
        self._leases[request_id] = lease
        return lease

    def renew(self, request_id: str) -> bool:
        """Move ``request_id``'s deadline to ``ttl`` seconds from now; False when it has ended."""
        lease = self._leases.get(request_id)
        if lease is None:
            return False
        self._leases[request_id] = Lease(lease.request_id, lease.granted,
                                         time.monotonic() + self.ttl, lease.on_expire)  # fmt: skip
        return True

    def release(self, request_id: str) -> bool:
        """End the lease and free its blocks; False when it had already ended."""
        if self._leases.pop(request_id, None) is None:
            return False
        self.engine_loop.release_nowait(request_id)
        return True

    def reap(self, now: float | None = None) -> list[str]:
        """Expire every lease past its deadline now; returns their request ids."""
        now = time.monotonic() if now is None else now
        expired = [lease for lease in self._leases.values() if lease.expires <= now]
        for lease in expired:
            del self._leases[lease.request_id]
            self.num_expired += 1
            if self.metrics is not None:
                self.metrics.kv_transfer_leases_expired.inc()
            logger.warning(
                "KV lease expired: no progress for %.1fs and no acknowledgement",
                self.ttl, extra={"request_id": lease.request_id},
            )
            try:
                lease.on_expire()
            except Exception:  # noqa: BLE001 - the blocks must be freed whatever happens
                logger.exception("lease expiry callback failed")
            self.engine_loop.release_nowait(lease.request_id)
        return [lease.request_id for lease in expired]

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.reap()
