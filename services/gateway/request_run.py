"""One request's ``n`` choices running concurrently, their events merged in arrival order.

Lifecycle:

1. ``RequestRun(...)`` builds one :class:`~services.gateway.choice.ChoiceRun` per choice, each
   with its own backend request id (``<id>-<i>``) and, when the client gave a seed, seed ``+ i``
   so the choices differ yet the request stays reproducible.
2. :meth:`start` launches them as tasks; each pushes its events into one queue, then a marker.
3. :meth:`next_event` returns the next event (None once every choice finished), raising the
   first choice failure, or :class:`~services.gateway.sse.ClientDisconnected` as soon as the
   ``disconnected`` future completes: the wait is raced against the client going away, because
   aiohttp does not cancel handlers on disconnect.
4. :meth:`close` (always, in ``finally``) cancels the choices still running; each cancelled
   choice aborts itself on both of its workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass

from services.common.sampling_params import SamplingParams
from services.gateway.choice import ChoiceDeps, ChoiceEvent, ChoiceRun, ChoiceStats
from services.gateway.sse import ClientDisconnected

logger = logging.getLogger(__name__)

_INT64 = 2**63


@dataclass(frozen=True, slots=True)
class _ChoiceEnded:
    index: int
    error: BaseException | None = None


_GONE = object()  # queued when the client disconnects


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of choice ``index``: one sequence, seed offset by the index."""
    seed = params.seed
    if seed is not None and index:
        seed = (seed + index + _INT64) % (2 * _INT64) - _INT64  # stay within 64 bits
    return dataclasses.replace(params, n=1, seed=seed)


class RequestRun:
    """The choices of one request (see the module lifecycle)."""

    def __init__(
        self,
        deps: ChoiceDeps,
        *,
        request_id: str,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
    ) -> None:
        self._queue: asyncio.Queue[ChoiceEvent | _ChoiceEnded | object] = asyncio.Queue()
        self.choices = [
            ChoiceRun(
                deps,
                index=i,
                request_id=f"{request_id}-{i}",
                prompt_ids=prompt_ids,
                params=choice_params(params, i),
                emit=self._queue.put_nowait,
            )
            for i in range(params.n)
        ]
        self._tasks: list[asyncio.Task[None]] = []
        self._running = 0
        self._watched: asyncio.Future[object] | None = None

    @property
    def stats(self) -> list[ChoiceStats]:
        return [c.stats for c in self.choices]

    def start(self) -> None:
        self._running = len(self.choices)
        self._tasks = [
            asyncio.create_task(self._run_choice(c), name=f"choice-{c.stats.request_id}")
            for c in self.choices
        ]

    async def _run_choice(self, choice: ChoiceRun) -> None:
        try:
            await choice.run()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises
            self._queue.put_nowait(_ChoiceEnded(choice.stats.index, exc))
        else:
            self._queue.put_nowait(_ChoiceEnded(choice.stats.index))

    async def next_event(
        self, disconnected: asyncio.Future[object] | None = None
    ) -> ChoiceEvent | None:
        """The next event of any choice; None when all are done (see the module lifecycle)."""
        while self._running:
            item = await self._get(disconnected)
            if isinstance(item, ChoiceEvent):
                return item
            self._running -= 1
            if item.error is not None:
                raise item.error
        return None

    async def _get(self, disconnected: asyncio.Future[object] | None) -> ChoiceEvent | _ChoiceEnded:
        if disconnected is not None and disconnected is not self._watched:
            # Once per request: the client going away puts a marker in the queue, so each event
            # is one queue get (racing a second future per token cost a task per token).
            self._watched = disconnected
            disconnected.add_done_callback(self._on_disconnect)
        item = await self._queue.get()
        if item is _GONE:
            self._queue.put_nowait(_GONE)  # every later call raises too
            raise ClientDisconnected("client disconnected")
        return item  # type: ignore[return-value]

    def _on_disconnect(self, disconnected: asyncio.Future[object]) -> None:
        if not disconnected.cancelled():  # cancelled: the handler finished, nobody left
            self._queue.put_nowait(_GONE)

    async def close(self) -> None:
        """Cancel every choice still running and wait for them to finish cancelling."""
        pending = [t for t in self._tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
