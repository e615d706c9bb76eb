"""Runs an :class:`LLMEngine` on its own thread and gives asyncio code a safe way to drive it.

Why a thread: a model step runs for milliseconds to seconds, and the engine, its block manager
and its KV pool are single-threaded; the gRPC servicers live on an asyncio loop that must never
block. So exactly one thread touches the engine, and everything else sends it commands.

Why the model is built on that same thread (:meth:`EngineLoop.build_and_start`): GNU OpenMP
keeps one worker team per thread that opens a parallel region. Loading weights on the main
thread and stepping on another leaves two teams in the process, more OpenMP threads than cores,
and libgomp then stops spinning between regions: every one of a step's hundreds of parallel
regions wakes its workers through the kernel, which made a served batch-1 decode step ~3x
slower than the same step offline. One thread doing all of a worker's torch work keeps one team.

The thread, one iteration at a time:
  1. Sleep on a condition until a command is queued or the engine has unfinished work.
  2. Apply every queued command in FIFO order (add a request, admit a prefilled one, abort,
     allocate / release held blocks, read or write KV bytes, any ``call(fn)``); each one
     resolves its future.
  3. If the engine has work, run one ``engine.step()`` (every schedulable sequence in one
     batch). A step that ran nothing (a prompt waits for blocks that leases hold) sleeps until
     the next command instead of spinning.
  4. Publish an :class:`EngineStats` snapshot (and the Prometheus gauges), then resolve the
     commands' futures and deliver the outputs to their requests' asyncio queues with
     ``loop.call_soon_threadsafe`` — so whoever sees a result also sees stats that new.

Each output passes the loop's ``output_filter`` (the worker's text: ``output_text.OutputText``)
on the engine thread before it is delivered, so a stop string ends its request before the next
step; :class:`~services.engine.runtime.output_router.OutputRouter` takes it from there to its
consumer.

Failure isolation. An error that belongs to one request — its grammar (the engine ends it with
:attr:`RequestOutput.error`), its output's text or stop strings (``output_filter.apply`` raising)
— reaches that request's consumer alone, as a :class:`TandemError`, and the step's other outputs
are delivered as usual. An exception out of ``engine.step()`` itself (the forward pass, the KV)
cannot be pinned on one request: every request on the engine fails with an
:class:`UnavailableError` whose code is ``worker_unhealthy``, the loop turns *unhealthy* (it
refuses new requests with that error, and calls the ``on_unhealthy`` callbacks: the worker
reports NOT_SERVING to gRPC health checks), and the gateway, which reads that code as "this worker
is down", migrates the streams to another decode worker instead of failing them.

Blocks owned by a request id but by no sequence (a prefill-only request's after its first token,
a decode worker's for an incoming transfer) live in :class:`HeldBlocks`, freed exactly once.

A request seen from asyncio:
  1. ``generate(...)`` / ``generate_prefilled(...)`` registers the request's queue and adds it to
     the engine in one command.
  2. The async generator yields outputs until one is finished (or re-raises an engine failure).
  3. If the consumer leaves first (its task cancelled, or the generator closed: use
     ``contextlib.aclosing``), the request is cancelled on the engine thread: aborted, its
     held blocks released, its queue dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from services.common.errors import FailedPreconditionError, UnavailableError
from services.common.metrics import TandemMetrics
from services.common.sampling_params import SamplingParams
from services.engine.core.engine import LLMEngine, OutputFilter, RequestOutput
from services.engine.core.grammar_compiler import CompiledGrammar
from services.engine.core.sampler import TokenLogprobs
from services.engine.runtime.engine_stats import EngineStats, StatsPublisher
from services.engine.runtime.held_blocks import HeldBlocks
from services.engine.runtime.output_router import OutputRouter
from services.engine.runtime.request_sink import RequestSink
from services.engine.runtime.worker_health import WorkerHealth

logger = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_POLL_SECONDS = 0.05
"""Longest sleep of a thread whose engine has work it cannot schedule yet."""

class EngineLoop:
    """Owns the engine thread; every public coroutine is safe to call from any event loop."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        metrics: TandemMetrics | None = None,
        name: str = "engine",
        output_filter: OutputFilter | None = None,
        step_scope: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
        _own_thread: threading.Thread | None = None,
    ) -> None:
        self.engine = engine
        self._step_scope = step_scope  # each step runs in it (core_share.py's team size)
        self.metrics = metrics
        self._cond = threading.Condition()
        self._commands: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()
        self._stopping = False
        self._thread = _own_thread or threading.Thread(target=self._run, name=name, daemon=True)
        # Engine-thread state.
        self._held = HeldBlocks(engine)
        self._router = OutputRouter(engine, self._held, output_filter=output_filter,
                                    metrics=metrics)  # fmt: skip
        self._num_steps = 0
        self._max_batch = 0
        self.health = WorkerHealth()
        self._publisher = StatsPublisher(engine, metrics)
        if metrics is not None:
            metrics.watch_engine_phases(engine.phases.read)
        self._stats = self._publisher.publish(num_held_requests=0, num_steps=0, max_batch_size=0)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    async def build_and_start(
        cls,
        build: Callable[[], tuple[LLMEngine, OutputFilter | None]],
        *,
        metrics: TandemMetrics | None = None,
        name: str = "engine",
        step_scope: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
    ) -> EngineLoop:
        """Start a thread that runs ``build()`` (load the model, make the engine and its output
        filter) and then this loop, so one thread does all of the engine's torch work (see the
        module docstring); returns the running loop, or raises what ``build`` raised.

        If the caller is cancelled while the model loads, the loop is stopped once built.
        """
        built: concurrent.futures.Future[EngineLoop] = concurrent.futures.Future()

        def main() -> None:
            try:
                engine, output_filter = build()
                loop = cls(engine, metrics=metrics, name=name, output_filter=output_filter,
                           step_scope=step_scope, _own_thread=threading.current_thread())  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                built.set_exception(exc)
                return
            built.set_result(loop)
            loop._run()

        threading.Thread(target=main, name=name, daemon=True).start()
        try:
            return await asyncio.shield(asyncio.wrap_future(built))
        except asyncio.CancelledError:
            built.add_done_callback(_stop_when_built)
            raise

    def start(self) -> None:
        """Start the engine thread (once; a loop from :meth:`build_and_start` already runs)."""
        if not self._thread.is_alive():
            self._thread.start()

    async def stop(self, timeout: float = 30.0) -> None:
        """Abort every request (consumers see finish reason "abort"), free every held block,
        and join the thread. Idempotent."""
        if self._thread.is_alive():
            try:
                await self.call(lambda engine: self._shutdown())
            except UnavailableError:
                pass
            await asyncio.to_thread(self._thread.join, timeout)

    @property
    def output_filter(self) -> OutputFilter | None:
        """What each output passes on the engine thread (the worker's text), or None."""
        return self._router.output_filter

    @property
    def healthy(self) -> bool:
        """False once an engine step failed (the engine's state can no longer be trusted)."""
        return self.health.healthy

    def on_unhealthy(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (on the engine thread) when a step fails (:class:`WorkerHealth`)."""
        self.health.on_unhealthy(callback)

    @property
    def stats(self) -> EngineStats:
        """The latest snapshot (updated by the engine thread after every iteration)."""
        return self._stats

    # ------------------------------------------------------------------ commands
    def submit(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Queue ``fn(engine)`` to run on the engine thread; its future carries the result."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise UnavailableError("the engine is not running")
            self._commands.append((lambda: fn(self.engine), future))
            self._cond.notify()
        return future

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread and return its result (or raise its error).

        Cancelling the caller before the command started means it never runs; after, its
        result is dropped (so commands that take ownership key it by request id).
        """
        return await asyncio.wrap_future(self.submit(fn))

    def held_blocks(self, request_id: str) -> list[int]:
        """Blocks held for ``request_id``. Engine thread only (inside ``call``)."""
        if threading.get_ident() != self._thread.ident:
            raise RuntimeError("EngineLoop.held_blocks is for the engine thread only")
        return self._held.blocks(request_id)

    async def allocate_blocks(self, request_id: str, num_blocks: int) -> list[int]:
        """Allocate blocks held for ``request_id`` (ResourceExhaustedError when no room; then
        nothing is allocated)."""

        def allocate(engine: LLMEngine) -> list[int]:
            self._check_free_id(request_id)
            blocks = engine.block_manager.allocate(num_blocks)
            self._held.hold(request_id, blocks)
            return list(blocks)

        return await self.call(allocate)

    async def resize_held(self, request_id: str, num_blocks: int) -> list[int]:
        """Make the blocks held for ``request_id`` exactly ``num_blocks`` (a reservation meeting
        its transfer: allocate the shortfall, free the excess); with none held, allocate them
        like :meth:`allocate_blocks`. ResourceExhaustedError when no room; then nothing changed."""

        def resize(engine: LLMEngine) -> list[int]:
            if request_id not in self._held:
                self._check_free_id(request_id)
            return list(self._held.resize(request_id, num_blocks))

        return await self.call(resize)

    async def release(self, request_id: str) -> bool:
        """Free the blocks held for ``request_id``; False when none were held."""
        return await self.call(lambda engine: self._held.release(request_id))

    def release_nowait(self, request_id: str) -> None:
        """Queue :meth:`release` without waiting (safe in ``finally`` of a cancelled task)."""
        self._submit_quietly(lambda engine: self._held.release(request_id))

    async def abort(self, request_id: str) -> bool:
        """Abort the engine's request (its consumer sees finish reason "abort") and free its
        held blocks. True when anything was found."""

        def abort(engine: LLMEngine) -> bool:
            return engine.abort(request_id) | self._held.release(request_id)

        return await self.call(abort)

    # ------------------------------------------------------------------ requests
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        resume_output_ids: Sequence[int] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs. With ``prefill_only`` the last output has
        finish reason "prefilled" and its blocks stay held until :meth:`release`. With
        ``resume_output_ids`` it continues after outputs generated elsewhere (``add_request``)."""
        prompt = list(prompt_token_ids)
        resumed = list(resume_output_ids)
        sink = RequestSink.create("prefill" if prefill_only else "full")
        grammar = await self._compiled(params)

        def start(engine: LLMEngine) -> None:
            self.health.check()
            self._check_free_id(request_id)
            engine.add_request(request_id, prompt, params, prefill_only=prefill_only,
                               resume_output_ids=resumed, grammar=grammar)  # fmt: skip
            if self.output_filter is not None and not prefill_only:
                self.output_filter.start(request_id, prompt, params, resumed)
            self._router.register(request_id, sink)
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(prompt))

        async for out in self._stream(request_id, sink, start):
            yield out

    async def generate_prefilled(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        first_token_id: int,
        first_logprob: TokenLogprobs | None = None,
        num_cached_tokens: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Hand the blocks held for ``request_id`` (KV already written) to the engine as a
        running sequence and yield its outputs; the first carries ``first_token_id``."""
        prompt = list(prompt_token_ids)
        sink = RequestSink.create("decode")
        grammar = await self._compiled(params)

        def start(engine: LLMEngine) -> None:
            self.health.check()
            if request_id in self._router or engine.scheduler.find(request_id) is not None:
                raise FailedPreconditionError(f"request {request_id!r} is already running")
            blocks = self._held.take(request_id)
            self._router.register(request_id, sink)
            try:
                outputs = engine.add_prefilled(
                    request_id, prompt, params, block_ids=blocks, first_token_id=first_token_id,
                    first_logprob=first_logprob, num_cached_tokens=num_cached_tokens,
                    grammar=grammar,
                )
            except BaseException:
                self._router.unregister(request_id)
                if engine.scheduler.find(request_id) is not None:
                    engine.abort(request_id)
                else:
                    engine.release_blocks(blocks)
                raise
            if self.output_filter is not None:
                self.output_filter.start(request_id, prompt, params)
            for out in outputs:
                self._router.deliver(out, sampled_here=False)

        async for out in self._stream(request_id, sink, start):
            yield out

    async def _compiled(self, params: SamplingParams) -> CompiledGrammar | None:
        """The request's grammar compiled off the engine thread (``grammar_compiler.py``): the
        request waits here while the engine goes on; None when it has no grammar or the worker
        has no compiler (the engine then refuses it)."""
        compiler = self.engine.grammars
        if params.grammar is None or compiler is None:
            return None
        return await compiler.compile(params.grammar)

    async def _stream(
        self, request_id: str, sink: RequestSink, start: Callable[[LLMEngine], None]
    ) -> AsyncIterator[RequestOutput]:
        sink.loop = asyncio.get_running_loop()
        done = False
        try:
            await self.call(start)
            behind: object | None = None  # taken while coalescing, not yet handled
            while not done:
                item, behind = (behind if behind is not None else await sink.queue.get()), None
                if isinstance(item, BaseException):
                    done = True
                    raise item
                # A consumer that fell behind (a busy server thread) takes the outputs queued
                # meanwhile as one: one message for several steps instead of one per step.
                while not item.finished and not sink.queue.empty():
                    nxt = sink.queue.get_nowait()
                    if not isinstance(nxt, RequestOutput):
                        behind = nxt
                        break
                    item = _merged(item, nxt)
                done = item.finished
                yield item
        finally:
            if not done:
                self._submit_quietly(lambda engine: self._router.cancel(request_id, sink))

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        phases = engine.phases  # the engine charges its step's phases, this loop the rest
        phases.start()
        while True:
            with self._cond:
                while not self._commands and not self._stopping and not engine.has_unfinished():
                    self._cond.wait()
                commands, self._commands = self._commands, deque()
                if self._stopping and not commands:
                    break
            phases.lap("idle")
            results: list[tuple[concurrent.futures.Future, bool, object]] = []
            for fn, future in commands:
                if future.set_running_or_notify_cancel():
                    try:
                        results.append((future, True, fn()))
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        results.append((future, False, exc))
            phases.lap("commands")
            ran = self._step() if engine.has_unfinished() else True
            # Publish first, then answer: whoever sees a result or an output sees stats at
            # least as new as the state that produced it.
            self._publish()
            phases.lap("publish")
            for future, ok, value in results:
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)  # type: ignore[arg-type]
            self._router.flush()
            phases.lap("outputs")
            if not ran:
                with self._cond:
                    if not self._commands and not self._stopping:
                        self._cond.wait(IDLE_POLL_SECONDS)
        logger.info("engine thread stopped")

    def _step(self) -> bool:
        """One engine step; False when nothing could run."""
        try:
            with self._step_scope() if self._step_scope is not None else contextlib.nullcontext():
                outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a failed step must not kill the thread
            logger.exception("engine step failed; failing %d requests over to other workers and "
                             "reporting this worker unhealthy", len(self._router))  # fmt: skip
            self._turn_unhealthy(f"engine step failed: {type(exc).__name__}: {exc}")
            return True
        self._num_steps += 1
        sampled = sum(1 for out in outputs if out.new_token_ids)
        self._max_batch = max(self._max_batch, sampled)
        for out in outputs:
            self._router.deliver(out, sampled_here=True)
        self.engine.phases.lap("outputs")
        return bool(outputs) or bool(self.engine.scheduler.running)

    def _turn_unhealthy(self, reason: str) -> None:
        """A step failed: fail every request (the gateway migrates them), drop every sequence
        (its state is suspect), and turn unhealthy (:class:`WorkerHealth`)."""
        self._router.fail_all(self.health.fail(reason))
        scheduler = self.engine.scheduler
        for seq in [*scheduler.running, *scheduler.waiting]:
            self.engine.abort(seq.request_id)

    def _shutdown(self) -> None:
        scheduler = self.engine.scheduler
        for seq in [*scheduler.running, *scheduler.waiting]:
            self.engine.abort(seq.request_id)
        for out in self.engine.step():
            self._router.deliver(out, sampled_here=False)
        self._held.release_all()
        with self._cond:
            self._stopping = True

    def _check_free_id(self, request_id: str) -> None:
        if (
            request_id in self._router
            or request_id in self._held
            or self.engine.scheduler.find(request_id) is not None
        ):
            raise FailedPreconditionError(f"request id {request_id!r} is already in use")

    def _stop_nowait(self) -> None:
        """Ask the thread to shut down without waiting for it (any thread)."""
        self._submit_quietly(lambda engine: self._shutdown())

    def _submit_quietly(self, fn: Callable[[LLMEngine], object]) -> None:
        with contextlib.suppress(UnavailableError):  # stopping: shutdown frees everything
            self.submit(fn)

    def _publish(self) -> None:
        self._stats = self._publisher.publish(
            num_held_requests=len(self._held), num_steps=self._num_steps,
            max_batch_size=self._max_batch,
        )


def _merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (``then``'s state, both steps' tokens)."""
    return dataclasses.replace(
        then,
        new_token_ids=first.new_token_ids + then.new_token_ids,
        new_logprobs=first.new_logprobs + then.new_logprobs,
        text=first.text + then.text,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None
        else then.prompt_logprobs,
    )


def _stop_when_built(built: concurrent.futures.Future[EngineLoop]) -> None:
    if not built.cancelled() and built.exception() is None:
        built.result()._stop_nowait()
