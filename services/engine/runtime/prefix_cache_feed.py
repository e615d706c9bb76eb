"""A worker's prefix-cache contents as a feed for KV-aware routers (``PrefixCache.Watch``).

The block manager reports every key it stores, evicts or clears (``BlockManager.on_event``) on the
engine thread. :class:`PrefixCacheFeed` fans those events out to subscribers living on the asyncio
loop, without ever blocking the engine thread:

1. ``subscribe()`` registers a :class:`Subscription` *on the engine thread* and takes the snapshot
   there in the same command, so snapshot + later events are exactly the cache's contents.
2. Each event updates every subscription's pending change set under a short lock (last change per
   key wins: stored-then-evicted is evicted, which is exact because keys are independent) and
   wakes its reader with one ``call_soon_threadsafe`` when the set goes from empty to non-empty,
   so a step that evicts a hundred blocks costs one wake-up, not a hundred.
3. ``Subscription.next()`` returns the accumulated change as one update. A clear turns the next
   update into a fresh snapshot. A subscriber whose backlog exceeds ``max_backlog`` keys is cut
   off (``ResourceExhaustedError``): it resubscribes and starts from a snapshot, so a stalled
   router never grows the worker's memory.
4. ``close()`` ends every subscription (worker shutdown), so long-lived streams do not hold up a
   graceful stop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.errors import ResourceExhaustedError, UnavailableError
from services.common.prefix_hash import routing_key
from services.engine.core.engine import LLMEngine
from services.engine.runtime.engine_loop import EngineLoop

logger = logging.getLogger(__name__)

DEFAULT_MAX_BACKLOG = 200_000
"""Keys a subscription may have pending before it is cut off (~a few MB at most)."""


@dataclass(frozen=True, slots=True)
class PrefixCacheChange:
    """One update for a router: a snapshot (replace all) or a change (add / drop keys)."""

    snapshot: bool
    stored: tuple[int, ...]
    removed: tuple[int, ...]


class Subscription:
    """One subscriber's pending changes; ``next()`` from its event loop only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_backlog: int) -> None:
        self._loop = loop
        self.max_backlog = max_backlog
        self._lock = threading.Lock()
        self._pending: dict[int, bool] = {}  # key -> stored (True) / removed (False)
        self._reset = True  # the next update is a snapshot
        self._ended: Exception | None = None
        self._wake = asyncio.Event()

    # ---- engine thread (and close) ----------------------------------------------------------
    def push(self, kind: str, keys: Sequence[int]) -> None:
        with self._lock:
            if self._ended is not None:
                return
            was_empty = not self._pending and not self._reset
            if kind == "cleared":
                self._pending.clear()
                self._reset = True
            else:
                present = kind == "stored"
                for key in keys:
                    self._pending[key] = present
                if len(self._pending) > self.max_backlog:
                    self._pending.clear()
                    self._ended = ResourceExhaustedError(
                        f"prefix-cache subscriber fell more than {self.max_backlog} keys behind;"
                        " resubscribe", code="subscriber_too_slow")
            if was_empty or self._ended is not None:
                self._loop.call_soon_threadsafe(self._wake.set)

    def end(self, error: Exception) -> None:
        with self._lock:
            if self._ended is None:
                self._ended = error
        self._loop.call_soon_threadsafe(self._wake.set)

    # ---- subscriber's loop ------------------------------------------------------------------
    async def next(self) -> PrefixCacheChange:
        """The changes since the last call (waits for at least one).

        Raises:
            ResourceExhaustedError: this subscriber fell too far behind.
            UnavailableError: the feed closed (the worker is stopping).
        """
        while True:
            with self._lock:
                if self._ended is not None:
                    raise self._ended
                if self._pending or self._reset:
                    pending, reset = self._pending, self._reset
                    self._pending, self._reset = {}, False
                    self._wake.clear()
                    break
                self._wake.clear()
            await self._wake.wait()
        stored = tuple(k for k, present in pending.items() if present)
        removed = () if reset else tuple(k for k, present in pending.items() if not present)
        return PrefixCacheChange(snapshot=reset, stored=stored, removed=removed)


class PrefixCacheFeed:
    """Fans one engine's prefix-cache events out to subscriptions (see the module docstring)."""

    def __init__(self, engine_loop: EngineLoop, *, max_backlog: int = DEFAULT_MAX_BACKLOG) -> None:
        self.engine_loop = engine_loop
        self.max_backlog = max_backlog
        self._lock = threading.Lock()
        self._subscriptions: list[Subscription] = []
        self._closed = False

    async def attach(self) -> None:
        """Start hearing the engine's block manager (on the engine thread)."""

        def attach(engine: LLMEngine) -> None:
            engine.block_manager.on_event = self._on_event

        await self.engine_loop.call(attach)

    def _on_event(self, kind: str, digests: Sequence[bytes]) -> None:  # engine thread
        with self._lock:
            subscriptions = list(self._subscriptions)
        if not subscriptions:  # nobody routes by this cache: cost the step nothing more
            return
        keys = [routing_key(d) for d in digests]
        for subscription in subscriptions:
            subscription.push(kind, keys)

    async def subscribe(self) -> Subscription:
        """A new subscription whose first ``next()`` is a snapshot of the cache."""
        if self._closed:
            raise UnavailableError("the worker is stopping")
        subscription = Subscription(asyncio.get_running_loop(), self.max_backlog)

        def register(engine: LLMEngine) -> None:
            # A snapshot alone may hold every block's key: never cut a subscriber off for that.
            subscription.max_backlog = max(self.max_backlog, 4 * engine.block_manager.num_blocks)
            keys = [routing_key(d) for d in engine.block_manager.cached_digests()]
            subscription.push("stored", keys)  # after the pending reset: the snapshot's keys
            with self._lock:
                self._subscriptions.append(subscription)

        await self.engine_loop.call(register)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            if subscription in self._subscriptions:
                self._subscriptions.remove(subscription)

    @property
    def num_subscribers(self) -> int:
        with self._lock:
            return len(self._subscriptions)

    def close(self) -> None:
        """End every subscription (the worker is stopping); later subscribes fail."""
        self._closed = True
        with self._lock:
            subscriptions, self._subscriptions = self._subscriptions, []
        for subscription in subscriptions:
            subscription.end(UnavailableError("the worker is stopping"))
