"""A worker's grammar compiler: builds each request's llguidance matcher off the engine thread,
within a time budget, and keeps the compiled grammars in a bounded cache.

A request with ``SamplingParams.grammar`` needs an ``LLMatcher`` built from that grammar string
against the model's tokenizer. Building one for a large grammar (a 200 KiB JSON schema: a few
hundred milliseconds) on the engine thread would stall every stream of the worker for as long,
so the engine loop (``runtime/engine_loop.py``) awaits :meth:`GrammarCompiler.compile` *before*
it hands the request to the engine thread: the request waits, the running streams do not, and
the engine thread only copies the compiled start state (:meth:`CompiledGrammar.matcher`, tens of
microseconds).

Why threads and not processes (the gateway's ``grammar_pool.py`` uses processes): a matcher is a
native object bound to this process's tokenizer that can be neither pickled nor sent, so it must
be built here; and llguidance (1.9) releases the GIL while it builds the parser, the costly part
(measured, ``docs/security.md``: a 200 KiB schema's 0.3 s build let another Python thread run
with gaps of a few milliseconds). Only parsing the grammar's JSON text holds the GIL, briefly. The
compile threads run at a lower CPU priority (:data:`COMPILE_NICENESS`, Linux: per thread), so
that on a small machine they take spare cycles, not the engine's.

Budget and isolation:

- at most ``threads`` compilations run at once, each on its own daemon thread; the others queue
  (first come, first served; concurrent requests for one grammar share one compilation), and a
  queued one whose every request went away (aborted: the client disconnected) leaves the queue;
- a compilation's budget is ``timeout_s`` of its thread's own CPU time (Linux's per-thread CPU
  clock), so what is "too complex" is the grammar's cost, not how busy the machine is: at a
  lower priority on a machine whose engine uses every core, a compile thread gets few cycles,
  and a wall-clock budget refused grammars the gateway had just compiled in time (measured: every
  one of 24 distinct 200 KiB schemas, ``docs/security.md``). Wall time is still bounded, at
  :data:`MAX_WALL_FACTOR` times the budget from the compilation's start (not while it queues).
  One past either is answered 400 ``grammar_too_complex`` (that request only, and the refusal is
  cached: the same grammar is refused again at once). Where the thread's CPU clock cannot be read
  the budget is wall time. A native call cannot be
  stopped, so its thread is *abandoned*: it stops counting against ``threads`` (the queue moves
  on) and its result is dropped when it ends. While :data:`MAX_ABANDONED` abandoned threads
  still run, nothing new starts (CPU spent on runaway grammars stays bounded);
- an invalid grammar is answered 400 and cached as such.

:meth:`GrammarCompiler.matcher` compiles on the calling thread (an engine driven directly: tests,
the generate CLI); the cache is shared and thread-safe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidArgumentError
from services.common.grammar_cache import GrammarCache, grammar_key

logger = logging.getLogger(__name__)

CACHED_GRAMMARS = 64
"""Compiled grammars kept per worker: a repeated schema (every request of one application sends
the same) is compiled once, and each request gets a cheap copy of the fresh matcher. The cache is
``services/common/grammar_cache.py``'s, the gateway's type, keyed by the digest of the grammar
string the gateway compiled (what is shared with the gateway, and what cannot be: see there)."""

DEFAULT_COMPILE_THREADS = 1
DEFAULT_COMPILE_TIMEOUT_S = 10.0
"""The gateway's own budget (``grammar_pool.DEFAULT_GRAMMAR_TIMEOUT_S``): a grammar that
compiled there in time compiles here in time too, unless the worker is much busier."""

MAX_WALL_FACTOR = 6
"""A compilation's wall-clock bound, in multiples of its CPU budget (``timeout_s``)."""

MAX_ABANDONED = 4
COMPILE_NICENESS = 10
"""Below the engine's priority, not the lowest: measured on 2 cores with a decode step using both
(``bench/grammar_flood.py``, 24 distinct 200 KiB schemas against ``tandem up``): at 19 a compile
thread got ~4% of a core, each 0.9 s matcher build took 30-60 s of wall time, requests queued
behind each other for over ten minutes and some were refused at the wall-clock bound; at 10 the
same flood was compiled in ~9 s each and answered in full while the concurrent stream's ITL p50
rose 9%. One compile thread runs at a time (abandoned ones aside), so this is the whole of the
flood's weight on the engine's cores. (At 10 with a wall-clock budget, four abandoned threads
still compiling beside the live one raised the ITL p50 by 26%: the CPU-time budget is what keeps
them rare.) The gateway's pool stays at 19: its validation is a quarter of this work."""
GRAMMAR_TOO_COMPLEX = "grammar_too_complex"


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A grammar compiled against this worker's tokenizer: a matcher in its start state that is
    never advanced, only copied."""

    key: str
    fresh: Any  # llguidance.LLMatcher

    def matcher(self) -> Any:
        """A new matcher at the grammar's start (a copy: cheap)."""
        return self.fresh.deep_copy()


@dataclass(frozen=True, slots=True)
class _Refusal:
    """A cached 400."""

    message: str
    code: str

    def error(self) -> InvalidArgumentError:
        return InvalidArgumentError(self.message, param="response_format", code=self.code)


class _Job:
    """One grammar being compiled: ``started`` gets the monotonic start time and the compile
    thread's CPU clock (None where unreadable), ``done`` the result (both thread-safe futures,
    awaited from the event loop)."""

    __slots__ = ("key", "grammar", "started", "done", "abandoned", "waiters")

    def __init__(self, key: str, grammar: str) -> None:
        self.key = key
        self.grammar = grammar
        self.started: concurrent.futures.Future[tuple[float, int | None]] = (
            concurrent.futures.Future())  # fmt: skip
        self.done: concurrent.futures.Future[CompiledGrammar | _Refusal] = (
            concurrent.futures.Future())  # fmt: skip
        self.abandoned = False
        self.waiters = 0  # requests awaiting it now (under the compiler's lock)


class GrammarCompiler:
    """The served model's llguidance tokenizer, the compile threads and the compiled grammars."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int], *,
                 threads: int = DEFAULT_COMPILE_THREADS,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:  # fmt: skip
        """``tokenizer_json``: the ``tokenizers`` library's JSON of the model's tokenizer;
        ``vocab_size``: the model's logits width (may exceed the tokenizer's)."""
        import llguidance

        if threads < 1 or not 0 < timeout_s < float("inf"):
            raise InvalidArgumentError("the grammar compiler needs >= 1 thread and a positive "
                                       "timeout", param="grammar_threads")  # fmt: skip
        self._llguidance = llguidance
        eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos or None)  # fmt: skip
        self.vocab_size = vocab_size
        self.threads = threads
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._cache: GrammarCache[CompiledGrammar | _Refusal] = GrammarCache(CACHED_GRAMMARS)
        self._jobs: dict[str, _Job] = {}
        self._queue: deque[_Job] = deque()
        self._running = 0
        self.abandoned = 0
        self.compiled = 0
        self.timeouts = 0

    @classmethod
    def create(cls, tokenizer_json: str | None, vocab_size: int,
               eos_token_ids: Sequence[int]) -> GrammarCompiler | None:  # fmt: skip
        """A compiler, or None (one log line) without a tokenizer or without llguidance."""
        if tokenizer_json is None:
            return None
        try:
            return cls(tokenizer_json, vocab_size, eos_token_ids)
        except ImportError:
            logger.warning("llguidance is not installed: structured outputs are refused")
        except Exception as err:  # noqa: BLE001 - a tokenizer llguidance cannot read
            logger.warning("structured outputs are off: llguidance cannot use this tokenizer "
                           "(%s)", err)  # fmt: skip
        return None

    @property
    def pending(self) -> int:
        """Compilations queued or running (abandoned ones not counted)."""
        with self._lock:
            return len(self._jobs)

    # ---- the event loop's API
    async def compile(self, grammar: str) -> CompiledGrammar:
        """``grammar`` compiled, off the calling thread; InvalidArgumentError (400) when it is
        invalid or does not compile within ``timeout_s`` of starting."""
        key = grammar_key(grammar)
        job: _Job | None = None
        with self._lock:
            result = self._cache.get(key)
            if result is None:
                job = self._jobs.get(key) or self._enqueue_locked(key, grammar)
                job.waiters += 1
        if job is not None:
            try:
                result = await self._wait(job)
            finally:
                self._leave(job)
        assert result is not None
        if isinstance(result, _Refusal):
            raise result.error()
        return result

    async def _wait(self, job: _Job) -> CompiledGrammar | _Refusal:
        """``job``'s result, or its expiry once its thread used ``timeout_s`` of CPU time (or
        :data:`MAX_WALL_FACTOR` times that of wall time) since it started."""
        started, clock = await asyncio.shield(asyncio.wrap_future(job.started))
        wall_deadline = started + self.timeout_s * MAX_WALL_FACTOR
        while True:
            now = time.monotonic()
            used = _cpu_seconds(clock)
            spent = used if used is not None else now - started
            # CPU time never runs faster than wall time: waiting what is left of the budget
            # cannot overshoot it
            wait = min(self.timeout_s - spent, wall_deadline - now)
            if wait <= 0:
                return self._expire(job)
            try:
                return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.done)), wait)
            except TimeoutError:
                continue

    def _leave(self, job: _Job) -> None:
        """One request stopped waiting for ``job``; the last one to leave a job still queued
        drops it (a client that sent a schema and went away leaves no compile work behind; a
        compilation already running finishes, and its result is cached)."""
        with self._lock:
            job.waiters -= 1
            if job.waiters == 0 and job in self._queue:  # queued: not started
                self._queue.remove(job)
                self._jobs.pop(job.key, None)
                job.done.cancel()

    # ---- any thread
    def matcher(self, grammar: str) -> Any:
        """A fresh matcher for ``grammar``, compiled on the calling thread when not cached (an
        engine driven directly); InvalidArgumentError when the grammar does not compile."""
        key = grammar_key(grammar)
        with self._lock:
            result = self._cache.get(key)
        if result is None:
            result = self._build(grammar, key)
            with self._lock:
                self.compiled += 1
                self._cache.put(key, result)
        if isinstance(result, _Refusal):
            raise result.error()
        return result.matcher()

    # ---- internals
    def _build(self, grammar: str, key: str) -> CompiledGrammar | _Refusal:
        try:
            fresh = self._llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if fresh.is_error():
                return _Refusal(f"the output grammar is invalid: {fresh.get_error()}",
                                "invalid_value")  # fmt: skip
        except Exception as err:  # noqa: BLE001 - the library's failure is this request's 400
            return _Refusal(f"the output grammar could not be compiled: {err}", "invalid_value")
        return CompiledGrammar(key, fresh)

    def _enqueue_locked(self, key: str, grammar: str) -> _Job:
        job = _Job(key, grammar)
        self._jobs[key] = job
        self._queue.append(job)
        self._dispatch_locked()
        return job

    def _dispatch_locked(self) -> None:
        """Start queued jobs while a thread slot is free (and not too many are abandoned)."""
        while self._queue and self._running < self.threads and self.abandoned < MAX_ABANDONED:
            job = self._queue.popleft()
            self._running += 1
            threading.Thread(target=self._run, args=(job,), name="grammar-compile",
                             daemon=True).start()  # fmt: skip

    def _run(self, job: _Job) -> None:
        """On a compile thread: build ``job``'s grammar, publish it unless abandoned meanwhile."""
        with contextlib.suppress(OSError, AttributeError):  # Linux: this thread alone
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
        clock: int | None = None
        with contextlib.suppress(OSError, AttributeError):  # not every platform has it
            clock = time.pthread_getcpuclockid(threading.get_ident())
        job.started.set_result((time.monotonic(), clock))
        result = self._build(job.grammar, job.key)
        with self._lock:
            if job.abandoned:
                self.abandoned -= 1
                logger.info("an abandoned grammar compilation ended (%d still running)",
                            self.abandoned)  # fmt: skip
            else:
                self._running -= 1
                self.compiled += 1
                self._cache.put(job.key, result)
                self._jobs.pop(job.key, None)
                job.done.set_result(result)
            self._dispatch_locked()

    def _expire(self, job: _Job) -> CompiledGrammar | _Refusal:
        """``job`` ran past the budget: refuse it (cached) and abandon its thread."""
        with self._lock:
            if job.done.done():  # it finished, or another waiter expired it first
                return job.done.result()
            refusal = _Refusal(f"the output grammar is too complex: it did not compile within "
                               f"{self.timeout_s:g} seconds of compile time on this worker",
                               GRAMMAR_TOO_COMPLEX)  # fmt: skip
            job.abandoned = True
            self._running -= 1
            self.abandoned += 1
            self.timeouts += 1
            self._cache.put(job.key, refusal)
            self._jobs.pop(job.key, None)
            job.done.set_result(refusal)
            self._dispatch_locked()
        logger.warning("an output grammar did not compile within %gs of compile time; its thread "
                       "is abandoned (%d abandoned)", self.timeout_s, self.abandoned)  # fmt: skip
        return refusal


def _cpu_seconds(clock: int | None) -> float | None:
    """CPU seconds of the thread whose CPU clock is ``clock``; None when unknown (no clock, or
    the thread has ended)."""
    if clock is None:
        return None
    try:
        return time.clock_gettime(clock)
    except OSError:
        return None

