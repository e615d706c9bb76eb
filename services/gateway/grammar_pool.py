"""Structured-output compilation off the event loop: a pool of worker processes, a time budget,
and the gateway's compiled-grammar cache.

Why processes: llguidance compiles and validates a grammar holding the GIL (measured: a 36 KB
JSON schema's validation took 0.36 s, during which another Python thread did not run for up to
0.18 s at a stretch), so a thread pool would still freeze the event loop and with it every
stream the gateway relays. Worker processes (``spawn``: the gateway's gRPC threads are never
forked) compile with :func:`~services.gateway.structured_outputs.compile_source`; the event loop
only waits on a future. The workers run at a lower CPU priority (:data:`WORKER_NICENESS`), so
that on a small machine they yield the CPU to the gateway's event loop.

Budgets:

- *size*: checked before anything is sent to a worker, at parse time
  (``structured_outputs.structured_output_source``: a source over ``MAX_GRAMMAR_BYTES`` is 400);
  the compiled grammar is bounded again by the same check in ``compile_source``;
- *time*: at most ``workers`` compilations are handed to the pool at once, so each one starts
  in a worker as soon as it is handed over and its clock counts compiling, never queueing. One
  that has not finished ``timeout_s`` after it was handed over gets 400 ``grammar_too_complex``;
  the pool is then terminated (the only way to stop a native call) and replaced, and the other
  compilations it was running are handed to the new one with fresh clocks (they did nothing
  wrong). The refusal is cached like any other result, so sending the same schema again is
  refused at once instead of costing another worker.

What waits for a worker is bounded by what holds it: every waiting request holds its body in the
body budget (``body_budget.py``) until it ends, so a flood of schemas queues at most as many
requests as the budget admits; a queued compilation whose every request went away (the client
disconnected) is dropped before a worker takes it, so sending schemas and hanging up leaves no
work or memory behind. One already handed to a worker finishes, and its result is cached.

Cache (``services/common/grammar_cache.py``, the type the engine uses too): keyed by the
source's digest (:attr:`~services.gateway.structured_outputs.GrammarSource.key`), it holds the
grammar string or the 400 a source earned. Concurrent requests for one uncached source share one
compilation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.pool
import os
import time
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import InvalidArgumentError, TandemError, UnavailableError
from services.common.grammar_cache import GrammarCache
from services.gateway.structured_outputs import GrammarSource, compile_source

logger = logging.getLogger(__name__)

DEFAULT_GRAMMAR_WORKERS = 2
DEFAULT_GRAMMAR_TIMEOUT_S = 10.0
CACHED_SOURCES = 256
CACHED_BYTES = 64 * 1024 * 1024


def _compile_in_worker(kind: str, value: Any, param: str) -> tuple[str, str, str | None, str]:
    """Runs in a worker process: ``("ok", grammar, None, "")`` or ``("error", message, param,
    code)`` (plain tuples: an exception's own pickling is not relied upon)."""
    try:
        return ("ok", compile_source(GrammarSource(kind, value, param)), None, "")
    except InvalidArgumentError as err:
        return ("error", err.message, err.param, err.code or "invalid_value")
    except Exception as err:  # noqa: BLE001 - the library's failure is this request's 400
        return ("error", f"The output constraint in '{param}' could not be compiled: {err}",
                param.split(".")[0], "invalid_value")  # fmt: skip


WORKER_NICENESS = 19
"""How much lower the workers' CPU priority is than the gateway's: on a machine with few cores,
compiling workers would otherwise take the CPU from the event loop they are meant to spare
(measured on 2 shared cores: a plain request waited 1-2 s behind two busy workers). The lowest
priority (the decode workers' compile threads run at ``grammar_compiler.COMPILE_NICENESS``:
they build the costlier matcher)."""


def _warm() -> None:
    """A worker's initializer: lower its priority, import the compiler before the first job."""
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICENESS)
    import llguidance  # noqa: F401

    compile_source(GrammarSource("regex", "a", "warm-up"))


def _settle(_: int) -> None:
    """Keeps a worker busy a moment, so that ``workers`` of these land on every worker."""
    time.sleep(0.05)


@dataclass(frozen=True, slots=True)
class _Refusal:
    """A cached 400."""

    message: str
    param: str | None
    code: str

    def error(self) -> InvalidArgumentError:
        return InvalidArgumentError(self.message, param=self.param, code=self.code)


@dataclass(slots=True)
class _Job:
    source: GrammarSource
    key: str  # source.key, computed once (a digest of up to 256 KiB of JSON)
    future: asyncio.Future[str | _Refusal]
    dispatched: bool = False
    done: bool = field(default=False)
    waiters: int = 0  # requests awaiting it now


class GrammarPool:
    """Compiles :class:`GrammarSource` s in ``workers`` processes within ``timeout_s`` each."""

    def __init__(self, workers: int = DEFAULT_GRAMMAR_WORKERS,
                 timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S,
                 cache: GrammarCache[str | _Refusal] | None = None) -> None:  # fmt: skip
        if workers < 1 or not 0 < timeout_s < float("inf"):
            raise InvalidArgumentError("the grammar pool needs >= 1 worker and a positive "
                                       "timeout", param="grammar_workers")  # fmt: skip
        self.workers = workers
        self.timeout_s = timeout_s
        self.cache: GrammarCache[str | _Refusal] = cache or GrammarCache(CACHED_SOURCES,
                                                                         CACHED_BYTES)
        self._pool: multiprocessing.pool.Pool | None = None
        self._starting: asyncio.Future[None] | None = None
        self._generation = 0
        self._jobs: dict[str, _Job] = {}
        self._slots: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.restarts = 0
        self.compiled = 0

    @property
    def pending(self) -> int:
        """Compilations submitted and not finished (waiting for a worker, or running)."""
        return len(self._jobs)

    async def compile(self, source: GrammarSource) -> str:
        """The grammar of ``source``; InvalidArgumentError (400) when it is rejected or does
        not compile within the time budget, UnavailableError (503) when no worker can start."""
        key = source.key
        cached = self.cache.get(key)
        if cached is None:
            job = self._jobs.get(key)
            if job is None:
                job = self._start(source, key)
            job.waiters += 1
            try:
                cached = await asyncio.shield(job.future)
            finally:
                job.waiters -= 1
                if job.waiters == 0 and not job.dispatched and not job.done:
                    self._drop(job)
        if isinstance(cached, _Refusal):
            raise cached.error()
        return cached

    async def close(self) -> None:
        """Stop the workers; compilations still pending fail with 503."""
        pool, self._pool = self._pool, None
        self._generation += 1
        for job in list(self._jobs.values()):
            self._fail(job, UnavailableError("The server is shutting down."))
        if pool is not None:
            await asyncio.get_running_loop().run_in_executor(None, _terminate, pool)

    async def _ensure_pool(self) -> multiprocessing.pool.Pool:
        while self._pool is None:
            if self._starting is None:
                loop = asyncio.get_running_loop()
                self._starting = loop.create_future()
                try:
                    self._pool = await loop.run_in_executor(None, self._new_pool)
                finally:
                    self._starting.set_result(None)
                    self._starting = None
            else:
                await asyncio.shield(self._starting)
        return self._pool

    def _new_pool(self) -> multiprocessing.pool.Pool:
        """A started pool whose every worker has imported the compiler (on a helper thread:
        this waits), so a compilation's clock never counts a worker's start-up."""
        pool = multiprocessing.get_context("spawn").Pool(self.workers, initializer=_warm)
        pool.map(_settle, range(self.workers), chunksize=1)
        return pool

    def _start(self, source: GrammarSource, key: str) -> _Job:
        job = _Job(source, key, asyncio.get_running_loop().create_future())
        self._jobs[key] = job
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def _run(self, job: _Job) -> None:
        """Hold one of ``workers`` slots from handing ``job`` over until it is done."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            if job.done:
                return
            try:
                await self._send(job)
            except Exception:  # the pool could not start: this job, and its sharers, 503
                logger.exception("the grammar workers could not start")
                self._fail(job, UnavailableError("The grammar workers are not available."))
                return
            await asyncio.wait([job.future])

    async def _send(self, job: _Job) -> None:
        """Hand ``job`` to the pool, its clock starting now."""
        pool = await self._ensure_pool()
        if job.done:
            return
        loop = asyncio.get_running_loop()
        job.dispatched = True
        generation = self._generation

        def done(result: tuple[str, str, str | None, str]) -> None:
            loop.call_soon_threadsafe(self._arrived, job, generation, result)

        def failed(err: BaseException) -> None:
            result = ("error", f"The output constraint could not be compiled: {err}",
                      job.source.param.split(".")[0], "invalid_value")  # fmt: skip
            loop.call_soon_threadsafe(self._arrived, job, generation, result)

        pool.apply_async(_compile_in_worker, (job.source.kind, job.source.value,
                                              job.source.param), callback=done,
                         error_callback=failed)  # fmt: skip
        loop.call_later(self.timeout_s, self._expire, job, generation)

    def _arrived(self, job: _Job, generation: int,
                 result: tuple[str, str, str | None, str]) -> None:  # fmt: skip
        if job.done or generation != self._generation:
            return  # a terminated pool's late answer: the job was sent again
        status, text, param, code = result
        self.compiled += 1
        value: str | _Refusal = text if status == "ok" else _Refusal(text, param, code)
        self.cache.put(job.key, value, len(text))
        self._finish(job, value)

    def _expire(self, job: _Job, generation: int) -> None:
        if job.done or generation != self._generation:
            return
        logger.warning("an output constraint (%s) did not compile in %gs; restarting the "
                       "grammar workers", job.source.param, self.timeout_s)  # fmt: skip
        refusal = _Refusal(
            f"The output constraint in '{job.source.param.split('.')[0]}' is too complex: it "
            f"did not compile within {self.timeout_s:g} seconds.",
            job.source.param.split(".")[0], "grammar_too_complex")  # fmt: skip
        self.cache.put(job.key, refusal, len(refusal.message))
        self._finish(job, refusal)
        self._restart()

    def _restart(self) -> None:
        """Replace the pool (stopping whatever it runs) and send its other jobs again."""
        pool, self._pool = self._pool, None
        self._generation += 1
        self.restarts += 1
        loop = asyncio.get_running_loop()
        if pool is not None:
            loop.run_in_executor(None, _terminate, pool)
        for job in list(self._jobs.values()):
            if job.dispatched and not job.done:  # was running on the old pool: hand it over
                task = loop.create_task(self._resend(job))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _resend(self, job: _Job) -> None:
        try:
            await self._send(job)
        except Exception:
            logger.exception("the grammar workers could not restart")
            self._fail(job, UnavailableError("The grammar workers are not available."))

    def _fail(self, job: _Job, error: TandemError) -> None:
        job.done = True
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        if not job.future.done():
            job.future.set_exception(error)
            job.future.exception()  # retrieved: a job nobody awaits any more is not an error

    def _drop(self, job: _Job) -> None:
        """Forget a job whose every request went away before a worker took it: a client that
        sends a schema and disconnects leaves neither work nor its schema behind (its body's
        lease ended with the request)."""
        job.done = True
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        job.future.cancel()

    def _finish(self, job: _Job, value: str | _Refusal) -> None:
        job.done = True
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        if not job.future.done():
            job.future.set_result(value)


def _terminate(pool: multiprocessing.pool.Pool) -> None:
    with contextlib.suppress(Exception):
        pool.terminate()
        pool.join()
