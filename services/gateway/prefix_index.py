"""Which prompt prefixes each worker's KV cache holds, as the workers' ``PrefixCache.Watch``
streams tell it (``protos/tandem/v1/prefix_cache.proto``).

Per worker address the index keeps the set of routing keys (``services/common/prefix_hash.py``)
its cache holds and the block size they were hashed over. A key names a whole prefix, so a
prompt's overlap with a worker is the number of its leading full blocks whose keys the worker
holds, counted until the first miss — exactly what the worker's own ``allocate_prompt`` would
reuse (give or take blocks evicted since the last update).

:class:`PrefixWatcher` keeps one subscription per worker: it applies the snapshot and changes,
and on any break forgets the worker (stale keys would attract requests to a cache that may be
gone) and resubscribes with backoff, getting a fresh snapshot; the router wakes it at once when
the worker's health check turns good again. A worker that does not serve the
stream (UNIMPLEMENTED) is simply never credited with a prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence

from services.common.errors import TandemError
from services.common.pb import prefix_cache_pb2
from services.gateway.backend import UNSUPPORTED_CODE, WorkerClient

logger = logging.getLogger(__name__)

RETRY_MIN_S = 0.5
RETRY_MAX_S = 10.0
UNIMPLEMENTED_RETRY_S = 60.0


class PrefixIndex:
    """Routing keys held per worker address (see the module docstring)."""

    def __init__(self) -> None:
        self._keys: dict[str, set[int]] = {}
        self._block_size: dict[str, int] = {}

    def apply(self, address: str, update: prefix_cache_pb2.PrefixCacheUpdate) -> None:
        if update.snapshot or address not in self._keys:
            self._keys[address] = set(update.stored)
        else:
            keys = self._keys[address]
            keys.update(update.stored)
            keys.difference_update(update.removed)
        if update.block_size:
            self._block_size[address] = update.block_size

    def forget(self, address: str) -> None:
        self._keys.pop(address, None)
        self._block_size.pop(address, None)

    def block_size(self, address: str) -> int | None:
        """The block size ``address`` hashes over, or None until its snapshot arrived."""
        return self._block_size.get(address)

    def num_keys(self, address: str) -> int:
        return len(self._keys.get(address, ()))

    def overlap_blocks(self, address: str, keys: Sequence[int]) -> int:
        """Leading blocks of a prompt (its routing keys, in order) cached on ``address``."""
        held = self._keys.get(address)
        if not held:
            return 0
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count


class PrefixWatcher:
    """One ``PrefixCache.Watch`` subscription per worker, feeding a :class:`PrefixIndex`."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wakes: dict[str, asyncio.Event] = {}

    def sync(self, clients: Iterable[WorkerClient]) -> None:
        """Watch exactly ``clients``: start new subscriptions, end those of dropped workers."""
        wanted = {c.address: c for c in clients}
        for address in list(self._tasks):
            if address not in wanted:
                self._tasks.pop(address).cancel()
                self._wakes.pop(address, None)
                self.index.forget(address)
        for address, client in wanted.items():
            if address not in self._tasks:
                self._wakes[address] = asyncio.Event()
                self._tasks[address] = asyncio.create_task(
                    self._watch(client), name=f"prefix-watch-{address}"
                )

    def wake(self, address: str) -> None:
        """The worker at ``address`` just answered a health check: resubscribe now rather than
        at the end of a backoff (a gateway started before its workers would otherwise route
        blind for up to ``RETRY_MAX_S``)."""
        event = self._wakes.get(address)
        if event is not None:
            event.set()

    async def _pause(self, address: str, seconds: float) -> None:
        event = self._wakes.get(address)
        if event is None:
            await asyncio.sleep(seconds)
            return
        event.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), seconds)

    async def _watch(self, client: WorkerClient) -> None:
        delay = RETRY_MIN_S
        while True:
            try:
                async for update in client.watch_prefix_cache():
                    self.index.apply(client.address, update)
                    delay = RETRY_MIN_S
                error = "the worker ended the stream"
            except TandemError as err:
                if err.code == UNSUPPORTED_CODE:
                    self.index.forget(client.address)
                    logger.info("worker %s serves no prefix-cache feed; routing it by load only",
                                client.address)  # fmt: skip
                    await self._pause(client.address, UNIMPLEMENTED_RETRY_S)
                    continue
                error = err.message
            self.index.forget(client.address)
            logger.debug("prefix-cache watch of %s ended: %s; retrying in %.1fs",
                         client.address, error, delay)  # fmt: skip
            await self._pause(client.address, delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def stop(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
