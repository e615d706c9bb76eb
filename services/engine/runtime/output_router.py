"""Takes each engine output to its request's consumer: the engine thread's side of every request.

Why a class of its own: an output leaves the engine through several hands before a consumer sees
it, and each has its failure to contain. On the engine thread, per output:

  1. The ``output_filter`` (the worker's text: ``output_text.OutputText``) turns its tokens into
     text and checks stop strings; when that raises, the request alone ends with an
     ``output_failed`` :class:`TandemError` (its sequence finished on the engine), the step's
     other outputs go on.
  2. A prefill-only request's last output ("prefilled") leaves its blocks held
     (:class:`HeldBlocks`) for the hand-off, owned by the sink that will read them; with no
     consumer left they are freed at once.
  3. Its metrics are recorded (``RequestSink.record``) and it waits in the outbox.

After the step, :meth:`OutputRouter.flush` hands the outbox over: one
``loop.call_soon_threadsafe`` per consumer event loop per step (each call writes that loop's
self-pipe), not one per request. A consumer whose event loop has closed is cancelled: its
request aborted, what it held freed.

Everything here runs on the engine thread (:class:`~services.engine.runtime.engine_loop.EngineLoop`
owns one router); only :func:`_put_all` runs on a consumer's loop.
"""

from __future__ import annotations

import asyncio
import logging

from services.common.errors import TandemError
from services.common.metrics import TandemMetrics
from services.engine.core.engine import LLMEngine, OutputFilter, RequestOutput
from services.engine.runtime.held_blocks import HeldBlocks
from services.engine.runtime.request_sink import RequestSink

logger = logging.getLogger(__name__)

OUTPUT_FAILED = "output_failed"
"""The error code of a request whose output's post-processing (text, stop strings) failed."""


class OutputRouter:
    """The requests that have a consumer (``rid -> RequestSink``) and the step's undelivered
    outputs. Engine thread only."""

    def __init__(self, engine: LLMEngine, held: HeldBlocks, *,
                 output_filter: OutputFilter | None = None,
                 metrics: TandemMetrics | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.held = held
        self.output_filter = output_filter
        self.metrics = metrics
        self._sinks: dict[str, RequestSink] = {}
        self._outbox: list[tuple[str, RequestSink, RequestOutput | BaseException]] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sinks

    def __len__(self) -> int:
        return len(self._sinks)

    def register(self, request_id: str, sink: RequestSink) -> None:
        """``sink``'s consumer now reads ``request_id``'s outputs."""
        self._sinks[request_id] = sink

    def unregister(self, request_id: str) -> None:
        """Forget ``request_id``'s consumer (its request never started)."""
        self._sinks.pop(request_id, None)

    def deliver(self, out: RequestOutput, *, sampled_here: bool) -> None:
        """Put one engine output through the steps above, into the outbox."""
        rid = out.request_id
        if self.output_filter is not None and out.error is None:
            try:
                self.output_filter.apply(out, self.engine)
            except Exception as exc:  # noqa: BLE001 - this request's failure, not the step's
                logger.warning("request %s: its output text failed: %s", rid, exc)
                if not out.finished:
                    self.engine.finish(rid, "error")
                out.finished, out.finish_reason = True, "error"
                out.error = TandemError(f"request {rid}: producing its output text failed: "
                                        f"{type(exc).__name__}: {exc}", code=OUTPUT_FAILED)  # fmt: skip
        sink = self._sinks.get(rid)
        if out.finished and out.finish_reason == "prefilled":
            self.held.hold(rid, out.block_ids, sink)
            if sink is None:  # nobody will ever take them
                self.held.release(rid)
        if sink is None:
            return
        if out.finished:
            del self._sinks[rid]
        if out.error is not None:  # this request alone failed: its consumer gets the error
            self._outbox.append((rid, sink, out.error))
            return
        if self.metrics is not None:
            sink.record(self.metrics, out, sampled_here=sampled_here)
        self._outbox.append((rid, sink, out))

    def flush(self) -> None:
        """Hand the outbox to the consumers: one wake-up per event loop."""
        outbox, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestSink, object]]] = {}
        for _, sink, item in outbox:
            by_loop.setdefault(sink.loop, []).append((sink, item))  # type: ignore[arg-type]
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the consumers' event loop is closed
                for rid, sink, _ in outbox:
                    if sink.loop is loop:
                        self.cancel(rid, sink)

    def cancel(self, request_id: str, sink: RequestSink) -> None:
        """The consumer of ``sink`` left: abort its request and free what it still holds."""
        if self._sinks.get(request_id) is sink:
            del self._sinks[request_id]
            self.engine.abort(request_id)
        self.held.release_if_owned(request_id, sink)

    def fail_all(self, error: TandemError) -> None:
        """Abort every request that has a consumer; each consumer gets ``error``."""
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            self.engine.abort(rid)
            self._outbox.append((rid, sink, error))


def _put_all(items: list[tuple[RequestSink, object]]) -> None:
    """On a consumer's event loop: queue each output for its request."""
    for sink, item in items:
        sink.queue.put_nowait(item)
