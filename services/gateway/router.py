"""KV-aware, load-aware routing over the prefill and decode pools.

The gateway knows three things about each worker:

1. what the worker last said about itself (``GetStats`` polled every ``interval_s``, after a
   gRPC health check: a worker that is not SERVING, e.g. draining for shutdown, takes no new
   work);
2. how many of the gateway's own requests it is serving right now (``in_flight``), which is
   exact and current, unlike a stats snapshot up to one interval old;
3. which prompt prefixes its KV cache holds (``prefix_index.py``: the worker's
   ``PrefixCache.Watch`` stream, a snapshot then every key stored or evicted).

A worker's load is ``load(w) = max(in_flight, num_running + num_waiting - finished)`` (the
larger covers requests from other gateways; ``finished`` counts this gateway's requests on it
that ended since that snapshot, which the snapshot still counts). For a prompt of ``B`` full
blocks, of which worker ``w`` holds the first ``cached(w)``, the router ranks candidates by

    cost(w) = overlap_weight * (B - cached(w)) + load_weight * load(w)

lowest first, ties broken by KV-cache usage and then round-robin (equal workers share a burst
instead of the first one taking all of it). Both terms count work: blocks the worker would have
to prefill, and requests ahead of this one; ``load_weight`` is how many blocks of recomputation
one queued request is worth. So a conversation's next turn, or a prompt sharing a long system
prompt, goes where its KV already is, until that worker is ``load_weight / overlap_weight``
requests per cached block busier than another. ``overlap_weight = 0`` turns KV-aware routing off
(least-loaded, and no feed is watched). Flags: ``--kv-overlap-weight``, ``--kv-load-weight``.

A worker whose call fails with UNAVAILABLE is marked down at once (:meth:`Router.mark_down`) and
comes back at its next good poll.

Fail closed on the model (docs/security.md): a worker is routed to only when its ``GetStats``
reports the model fingerprint the tokenizer reported (``services/common/model_fingerprint.py``).
A worker that reports none, or another, is refused (one warning per change, the reason in
``/ready``), and so is every worker while the tokenizer's fingerprint is not known yet or when
the tokenizer reported none: nothing is routed on an unchecked model.
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
from services.common.metrics import TandemMetrics
from services.common.periodic import Periodic
from services.common.pb import common_pb2
from services.common.prefix_hash import routing_keys
from services.common.protocol import check_peer
from services.gateway.backend import Role, WorkerClient
from services.gateway.config import RoutingWeights
from services.gateway.prefix_index import PrefixIndex, PrefixWatcher

logger = logging.getLogger(__name__)

REFUSED = "refused:"
FINGERPRINT_NOT_KNOWN = (f"{REFUSED} the model's fingerprint is not known yet (the tokenizer has "
                         "not answered), so no worker's model can be checked")

_ASSUMED_BLOCK_SIZE = 16
"""Block size credited to a worker whose feed has not reported one yet (its overlap is 0)."""


@dataclass(slots=True)
class WorkerState:
    """What the router knows about one worker (mutated only by the router)."""

    client: WorkerClient
    healthy: bool = False
    stats: common_pb2.WorkerStats | None = None
    in_flight: int = 0
    finished_since_poll: int = 0  # the gateway's requests on it that ended after its last stats
    last_error: str | None = "not polled yet"
    polled_at: float = 0.0

    @property
    def address(self) -> str:
        return self.client.address

    def load(self) -> tuple[int, float]:
        """``(requests on the worker, KV usage)``. The reported count still includes this
        gateway's requests that ended since the snapshot; they are taken off, so a worker that
        just finished a request is not seen as busy for up to a poll interval."""
        reported = 0 if self.stats is None else self.stats.num_running + self.stats.num_waiting
        usage = 0.0 if self.stats is None else self.stats.kv_cache_usage
        return max(self.in_flight, reported - self.finished_since_poll), usage

    def finished(self) -> None:
        """One of the gateway's requests on this worker ended."""
        self.in_flight -= 1
        self.finished_since_poll += 1

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


class PromptKeys:
    """A prompt's routing keys, hashed once per block size and only when some worker has a
    prefix-cache snapshot to compare them with; ``root`` salts the chain as the workers do
    (the deployment's and the request's ``cache_salt``, ``prefix_hash.prefix_root``)."""

    def __init__(self, token_ids: Sequence[int], root: bytes = b"") -> None:
        self.token_ids = token_ids
        self.root = root
        self._keys: dict[int, list[int]] = {}

    def keys(self, block_size: int) -> list[int]:
        if block_size not in self._keys:
            self._keys[block_size] = routing_keys(self.token_ids, block_size, self.root)
        return self._keys[block_size]


class Router:
    """Ranks healthy workers of a role by prefix overlap and load; polls worker stats and
    follows their prefix caches in the background."""

    def __init__(
        self,
        prefill: Sequence[WorkerClient],
        decode: Sequence[WorkerClient],
        *,
        interval_s: float = 1.0,
        weights: RoutingWeights = RoutingWeights(),
        metrics: TandemMetrics | None = None,
    ) -> None:
        self.weights = weights.validate()
        self.metrics = metrics
        self.prefix_index = PrefixIndex()
        self._model_fingerprint: str | None = None  # the tokenizer's, once known
        self._watcher = PrefixWatcher(self.prefix_index) if weights.kv_aware else None
        self._started = False
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
        self._sync_watcher()

    def _sync_watcher(self) -> None:
        if self._watcher is not None and self._started:
            self._watcher.sync(w.client for pool in self._pools.values() for w in pool)

    def workers(self, role: Role) -> tuple[WorkerState, ...]:
        return tuple(self._pools[role])

    @property
    def model_fingerprint(self) -> str | None:
        """The tokenizer's model fingerprint every worker must report (None: not known yet)."""
        return self._model_fingerprint

    @model_fingerprint.setter
    def model_fingerprint(self, value: str) -> None:
        """Set once the tokenizer answered: workers already polled and refused only for want
        of it are checked again at once (not a poll interval later)."""
        self._model_fingerprint = value
        for pool in self._pools.values():
            for worker in pool:
                if worker.stats is not None and worker.last_error == FINGERPRINT_NOT_KNOWN:
                    self._set_health(worker, self._incompatibility(worker.stats))

    def healthy_count(self, role: Role) -> int:
        return sum(1 for w in self._pools[role] if w.healthy)

    # ---- choosing -------------------------------------------------------------------------
    def pick(self, role: Role, prompt: PromptKeys | None = None) -> WorkerState:
        """The best healthy worker of ``role`` for ``prompt`` (least cost; see the module).

        Raises:
            UnavailableError: no worker of that role is healthy (HTTP 503).
        """
        ranked = self.ranked(role, prompt=prompt)
        worker = ranked[0] if ranked else None
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
        self,
        role: Role,
        *,
        exclude: Collection[str] = (),
        prompt: PromptKeys | None = None,
    ) -> list[WorkerState]:
        """Every healthy worker of ``role`` not in ``exclude`` (addresses), lowest cost first
        for ``prompt`` (by load alone without one); ties rotate between calls."""
        candidates = [w for w in self._pools[role] if w.healthy and w.address not in exclude]
        if not candidates:
            return []
        start = next(self._turns[role]) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        if prompt is None or not self.weights.kv_aware:
            return sorted(rotated, key=WorkerState.load)
        return sorted(rotated, key=lambda w: self._cost(w, prompt))

    def _cost(self, worker: WorkerState, prompt: PromptKeys) -> tuple[float, float]:
        load, usage = worker.load()
        cost = self.weights.load_weight * load
        block_size = self.prefix_index.block_size(worker.address)
        if block_size is not None:
            keys = prompt.keys(block_size)
            uncached = len(keys) - self.prefix_index.overlap_blocks(worker.address, keys)
            cost += self.weights.overlap_weight * uncached
        else:  # nothing known: as if nothing were cached
            cost += self.weights.overlap_weight * (len(prompt.token_ids) // _ASSUMED_BLOCK_SIZE)
        return cost, usage

    def cached_tokens(self, worker: WorkerState, prompt: PromptKeys) -> int:
        """Leading prompt tokens ``worker``'s prefix cache holds, as far as the router knows."""
        block_size = self.prefix_index.block_size(worker.address)
        if block_size is None:
            return 0
        return self.prefix_index.overlap_blocks(worker.address, prompt.keys(block_size)) * block_size

    @contextlib.contextmanager
    def lease(self, worker: WorkerState) -> Iterator[WorkerState]:
        """Count one of the gateway's requests on ``worker`` while the block runs."""
        worker.in_flight += 1
        try:
            yield worker
        finally:
            worker.finished()

    def lease_until_done(self, worker: WorkerState, task: asyncio.Future[object]) -> None:
        """Count ``task`` as one of the gateway's requests on ``worker`` from now until it is
        done (counted at once, so the next pick in the same burst already sees it)."""
        worker.in_flight += 1

        def done(_: asyncio.Future[object]) -> None:
            worker.finished()

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
        # Requests that end while GetStats is in flight may or may not be in its snapshot:
        # keep discounting them until the next one (never count a finished request as load).
        finished_before = worker.finished_since_poll
        if error is None:
            try:
                stats = await worker.client.stats()
            except TandemError as err:
                error = f"stats: {err.message}"
            else:
                error = self._incompatibility(stats)
        worker.polled_at = time.monotonic()
        if stats is not None:
            worker.stats = stats
            worker.finished_since_poll -= finished_before
            self._record(worker, stats)
        self._set_health(worker, error)

    def _set_health(self, worker: WorkerState, error: str | None) -> None:
        """Record a poll's verdict on ``worker`` (None: healthy), logging changes."""
        was_healthy, last_error = worker.healthy, worker.last_error
        worker.healthy = error is None
        worker.last_error = error
        if worker.healthy and not was_healthy and self._watcher is not None:
            self._watcher.wake(worker.address)  # (re)subscribe to its prefix feed now
        if error is not None and error.startswith(REFUSED) and error != last_error:
            log = logger.info if error == FINGERPRINT_NOT_KNOWN else logger.warning
            log("not routing to %s worker %s: %s", worker.client.role, worker.address, error)
        if was_healthy != worker.healthy:
            log = logger.info if worker.healthy else logger.warning
            log(
                "worker %s",
                "up" if worker.healthy else "down",
                extra={"worker": worker.address, "role": worker.client.role, "error": error},
            )

    def _incompatibility(self, stats: common_pb2.WorkerStats) -> str | None:
        """Why this gateway must not route to a worker reporting ``stats`` (None: it may): an
        internal protocol it cannot speak, or a model fingerprint that is not the tokenizer's:
        another, none, or any while the tokenizer's is not known (docs/security.md)."""
        why = check_peer(stats.protocol_version)
        if why is not None:
            return f"{REFUSED} {why}"
        expected = self._model_fingerprint
        if expected is None:
            return FINGERPRINT_NOT_KNOWN
        if not expected:
            return (f"{REFUSED} the tokenizer reports no model fingerprint, so no worker's "
                    "model can be checked")
        if not stats.model_fingerprint:
            return (f"{REFUSED} it reports no model fingerprint (the tokenizer's is {expected}); "
                    "a worker must prove which model it serves")
        if stats.model_fingerprint != expected:
            return (f"{REFUSED} it serves model {stats.model_fingerprint} and the tokenizer "
                    f"{expected} (other weights or another model)")
        return None

    def _record(self, worker: WorkerState, stats: common_pb2.WorkerStats) -> None:
        if self.metrics is None:
            return
        labels = {"role": worker.client.role, "worker": worker.address}
        queries = stats.prefix_cache_query_tokens
        hit_rate = stats.prefix_cache_hit_tokens / queries if queries else 0.0
        self.metrics.worker_prefix_cache_hit_rate.labels(**labels).set(hit_rate)
        self.metrics.worker_prefix_cache_blocks.labels(**labels).set(
            self.prefix_index.num_keys(worker.address)
        )

    def describe(self, worker: WorkerState) -> dict[str, object]:
        """``worker.describe()`` plus what the router knows of its prefix cache (``/ready``)."""
        out = worker.describe()
        if worker.stats is not None and worker.stats.prefix_cache_query_tokens:
            out["prefix_cache_hit_rate"] = round(
                worker.stats.prefix_cache_hit_tokens / worker.stats.prefix_cache_query_tokens, 4
            )
        if self._watcher is not None:
            out["prefix_cache_blocks"] = self.prefix_index.num_keys(worker.address)
        return out

    async def start(self) -> None:
        """Poll once now, then every ``interval_s`` in a background task."""
        await self.poll_once()
        self._poller.start()
        self._started = True
        self._sync_watcher()

    async def stop(self) -> None:
        self._started = False
        await self._poller.stop()
        if self._watcher is not None:
            await self._watcher.stop()
