"""Least-loaded routing over the prefill and decode pools, from polled worker statistics.

The gateway knows two things about each worker:

1. what the worker last said about itself (``GetStats`` polled every ``interval_s``, after a
   gRPC health check: a worker that is not SERVING, e.g. draining for shutdown, takes no new
   work);
2. how many of the gateway's own requests it is serving right now (``in_flight``), which is
   exact and current, unlike a stats snapshot up to one interval old.

A worker's load is ``max(in_flight, num_running + num_waiting)`` (the larger covers requests
from other gateways), ties broken by KV-cache usage and then round-robin, so equal workers share
a burst instead of the first one taking all of it. A worker whose call fails with UNAVAILABLE is
marked down at once (:meth:`Router.mark_down`) and comes back at its next good poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

from services.common.errors import TandemError, UnavailableError
from services.common.periodic import Periodic
from services.common.pb import common_pb2
from services.gateway.backend import Role, WorkerClient

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerState:
    """What the router knows about one worker (mutated only by the router)."""

    client: WorkerClient
    healthy: bool = False
    stats: common_pb2.WorkerStats | None = None
    in_flight: int = 0
    last_error: str | None = "not polled yet"
    polled_at: float = 0.0

    @property
    def address(self) -> str:
        return self.client.address

    def load(self) -> tuple[int, float]:
        reported = 0 if self.stats is None else self.stats.num_running + self.stats.num_waiting
        usage = 0.0 if self.stats is None else self.stats.kv_cache_usage
        return max(self.in_flight, reported), usage

    def describe(self) -> dict[str, object]:
        """A JSON-able summary for ``/ready``."""
        out: dict[str, object] = {
            "address": self.address,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
        }
        if self.stats is not None:
            out.update(
                worker_id=self.stats.worker_id,
                num_running=self.stats.num_running,
                num_waiting=self.stats.num_waiting,
                kv_blocks_in_use=self.stats.kv_blocks_in_use,
                kv_blocks_free=self.stats.kv_blocks_free,
            )
        if self.last_error:
            out["error"] = self.last_error
        return out


class Router:
    """Picks the least-loaded healthy worker of a role; polls worker stats in the background."""

    def __init__(
        self,
        prefill: Sequence[WorkerClient],
        decode: Sequence[WorkerClient],
        *,
        interval_s: float = 1.0,
    ) -> None:
        self._pools: dict[Role, list[WorkerState]] = {
            "prefill": [WorkerState(c) for c in prefill],
            "decode": [WorkerState(c) for c in decode],
        }
        self._turns: dict[Role, itertools.count[int]] = {
            "prefill": itertools.count(),
            "decode": itertools.count(),
        }
        self._poller = Periodic(self.poll_once, interval_s, "worker stats poll")

    def set_members(self, role: Role, clients: Sequence[WorkerClient]) -> None:
        """Make ``clients`` the pool of ``role`` (membership changes: DNS names re-resolved).
        Known workers keep their state; new ones start unhealthy until their first poll; a
        dropped worker takes no new requests (those in flight on it carry on)."""
        known = {w.address: w for w in self._pools[role]}
        pool = [known.get(c.address) or WorkerState(c) for c in clients]
        added = [w.address for w in pool if w.address not in known]
        dropped = sorted(set(known) - {w.address for w in pool})
        if added or dropped:
            logger.info("%s pool changed: added %s, dropped %s", role, added or "none",
                        dropped or "none")  # fmt: skip
        self._pools[role] = pool

    def workers(self, role: Role) -> tuple[WorkerState, ...]:
        return tuple(self._pools[role])

    def healthy_count(self, role: Role) -> int:
        return sum(1 for w in self._pools[role] if w.healthy)

    # ---- choosing -------------------------------------------------------------------------
    def pick(self, role: Role) -> WorkerState:
        """The least-loaded healthy worker of ``role``.

        Raises:
            UnavailableError: no worker of that role is healthy (HTTP 503).
        """
        worker = self.least_loaded(role)
        if worker is None:
            raise UnavailableError(
                f"no healthy {role} worker is available (of {len(self._pools[role])} "
                "configured); please retry shortly",
                code="no_healthy_workers",
            )
        return worker

    def least_loaded(self, role: Role) -> WorkerState | None:
        """The least-loaded healthy worker of ``role`` (ties rotate), or None when none is."""
        ranked = self.ranked(role)
        return ranked[0] if ranked else None

    def ranked(
        self, role: Role, *, exclude: Collection[str] = ()
    ) -> list[WorkerState]:
        """Every healthy worker of ``role`` not in ``exclude`` (addresses), best first (ties
        rotate between calls)."""
        candidates = [w for w in self._pools[role] if w.healthy and w.address not in exclude]
        if not candidates:
            return []
        start = next(self._turns[role]) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return sorted(rotated, key=WorkerState.load)

    @contextlib.contextmanager
    def lease(self, worker: WorkerState) -> Iterator[WorkerState]:
        """Count one of the gateway's requests on ``worker`` while the block runs."""
        worker.in_flight += 1
        try:
            yield worker
        finally:
            worker.in_flight -= 1

    def lease_until_done(self, worker: WorkerState, task: asyncio.Future[object]) -> None:
        """Count ``task`` as one of the gateway's requests on ``worker`` from now until it is
        done (counted at once, so the next pick in the same burst already sees it)."""
        worker.in_flight += 1

        def done(_: asyncio.Future[object]) -> None:
            worker.in_flight -= 1

        task.add_done_callback(done)

    def mark_down(self, worker: WorkerState, error: TandemError) -> None:
        """Stop routing to ``worker`` until its next successful poll (after an UNAVAILABLE)."""
        if worker.healthy:
            logger.warning(
                "worker marked down",
                extra={
                    "worker": worker.address,
                    "role": worker.client.role,
                    "error": error.message,
                },
            )
        worker.healthy = False
        worker.last_error = error.message

    # ---- polling --------------------------------------------------------------------------
    async def poll_once(self) -> None:
        """Refresh every worker's health and stats concurrently."""
        workers = [w for pool in self._pools.values() for w in pool]
        await asyncio.gather(*(self._poll(w) for w in workers))

    async def _poll(self, worker: WorkerState) -> None:
        status = await worker.client.health()
        error: str | None = None if status == "SERVING" else f"health: {status}"
        stats = None
        if error is None:
            try:
                stats = await worker.client.stats()
            except TandemError as err:
                error = f"stats: {err.message}"
        was_healthy = worker.healthy
        worker.polled_at = time.monotonic()
        worker.healthy = error is None
        worker.last_error = error
        if stats is not None:
            worker.stats = stats
        if was_healthy != worker.healthy:
            log = logger.info if worker.healthy else logger.warning
            log(
                "worker %s",
                "up" if worker.healthy else "down",
                extra={"worker": worker.address, "role": worker.client.role, "error": error},
            )

    async def start(self) -> None:
        """Poll once now, then every ``interval_s`` in a background task."""
        await self.poll_once()
        self._poller.start()

    async def stop(self) -> None:
        await self._poller.stop()
