"""Constrained decoding: per-request grammar matchers, who owns them when, and their token masks.

A request with ``SamplingParams.grammar`` (an llguidance grammar: what the gateway compiles a
``response_format`` JSON schema, a regex, a choice list or a Lark/GBNF grammar into) gets an
``llguidance.LLMatcher`` on every worker that samples for it. The sampler masks every token the
matcher does not allow before temperature and top-p; the engine advances the matcher by each token
it appends, and ends the request (``"stop"``) once the grammar is complete.

Why llguidance rather than our own automaton: it is the library vLLM, SGLang and llama.cpp use, it
builds its token trie from the tokenizer we already have (any ``tokenizers`` JSON: Hugging Face
folders and GGUF files alike), computes a 49k-token mask in tens of microseconds, and supports JSON
Schema, regexes and Lark grammars with the same matcher.

The masks are computed off the critical path where the machine has a core to spare:
:meth:`GrammarMasks.prepare` starts them on a helper thread when a step is scheduled (the matchers
already hold every token appended so far), the model's forward pass runs meanwhile, and the sampler
collects them with :meth:`GrammarMasks.take`. Where the engine's threads already use every core
(a 2-core CPU worker), the helper thread would only preempt one of them mid-matmul and stall the
whole parallel region (measured: a 0.7 ms fill made a batch-16 step 4 ms slower), so the masks are
filled in :meth:`take` instead, between the forward pass and the sampling. A step with no
constrained row never touches this module.

Who owns what, when (an ``LLMatcher`` is a PyO3 object: a Rust value behind a borrow flag, and
two threads touching one at once get ``RuntimeError: Already borrowed``; the mask fill releases
the GIL, so this is a real race, not a theoretical one):

* The engine wraps each request's matcher in an :class:`OwnedMatcher`, whose *owner* is the
  thread that made it: the engine thread (``EngineLoop``'s, or the caller's for an engine driven
  directly). Every method of it checks the calling thread and raises
  :class:`MatcherOwnershipError` for any other, so no code path can borrow it by accident.
* :meth:`GrammarMasks.prepare` *lends* the step's constrained matchers to one mask job on the
  helper thread. While lent, only that job touches them (:meth:`OwnedMatcher._raw_for` checks it
  holds the loan). The engine thread gets them back only by joining the job: explicitly with
  :meth:`GrammarMasks.join` (``take`` joins first, whatever rows it is asked for, and the engine
  joins in a ``finally`` at the end of every step, so no loan outlives the step that made it —
  nor a failed forward pass), and implicitly: any engine-thread call on a lent matcher
  (``validate_tokens`` in the greedy fast path, ``consume_token`` after sampling) first waits for
  the job and takes the matcher back.
* Speculative decoding's draft positions (``spec_decoder.py``) are sampled after the step's
  job is joined, on the engine thread: their masks are computed there by :meth:`take`, and a
  request's drafts are checked against its grammar (``validate_tokens``) before the step, with
  the matcher at home.
* Between steps nothing is lent, so everything else the engine thread does to a matcher — an
  abort, a preemption, a migrated stream's replay (``advance``), the first token of a prefilled
  hand-in — runs with the matcher at home.
* Compiling a grammar is not the engine thread's work: ``grammar_compiler.py`` builds it on a
  compile thread before the request reaches the engine, which only copies the compiled start
  state (a fresh matcher, never advanced) into the request's own matcher.

A matcher whose Rust side raises (or a mask that cannot be computed) fails its own request only:
:class:`OwnedMatcher` records the error as :attr:`OwnedMatcher.failure`, answers conservatively
(nothing valid, its mask EOS only), and the engine ends that request with the error while the
step goes on for the others.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from services.common.errors import InvalidArgumentError
from services.engine.core.grammar_compiler import CompiledGrammar, GrammarCompiler

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMasks", "MatcherOwnershipError",
           "OwnedMatcher", "advance"]  # the compiler lives in grammar_compiler.py

logger = logging.getLogger(__name__)

T = TypeVar("T")

class MatcherOwnershipError(RuntimeError):
    """A thread touched a grammar matcher it does not own (a bug: see the module docstring)."""


class _MaskJob:
    """One step's masks being filled on the helper thread; holds the loan of its matchers."""

    __slots__ = ("rows", "done", "masks", "error")

    def __init__(self, rows: list[Any | None]) -> None:
        self.rows = rows
        self.done = threading.Event()
        self.masks: torch.Tensor | None = None
        self.error: BaseException | None = None


class OwnedMatcher:
    """An ``LLMatcher`` with one owning thread at a time (see the module docstring).

    The methods are the ``LLMatcher`` ones the engine and the sampler use; each one runs on the
    owner thread only, first takes the matcher back from a mask job that holds it, and turns an
    exception of the Rust side into :attr:`failure` (this request's grammar failed) and a
    conservative answer, so one request's grammar never fails a whole step.
    """

    __slots__ = ("_matcher", "_owner", "_job", "failure")

    def __init__(self, matcher: Any, owner: int | None = None) -> None:
        """``owner``: the owning thread's ident (default: the calling thread)."""
        self._matcher = matcher
        self._owner = threading.get_ident() if owner is None else owner
        self._job: _MaskJob | None = None
        self.failure: str | None = None

    # ---- the owner thread's API
    def consume_token(self, token: int) -> bool:
        return self._call("consume_token", lambda m: bool(m.consume_token(token)), False)

    def consume_tokens(self, tokens: Sequence[int]) -> bool:
        return self._call("consume_tokens", lambda m: bool(m.consume_tokens(list(tokens))), False)

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        return self._call("validate_tokens", lambda m: int(m.validate_tokens(list(tokens))), 0)

    def is_stopped(self) -> bool:
        return self._call("is_stopped", lambda m: bool(m.is_stopped()), False)

    def is_error(self) -> bool:
        return self._call("is_error", lambda m: bool(m.is_error()), True) or self.failure is not None

    def get_error(self) -> str:
        if self.failure is not None:
            self._claim()
            return self.failure
        return self._call("get_error", lambda m: str(m.get_error()), "")

    @property
    def lent(self) -> bool:
        """Whether a mask job holds the matcher now (any thread may ask)."""
        return self._job is not None

    # ---- hand-over
    def _claim(self) -> Any:
        """The raw matcher for the owner thread: waits for a mask job holding it, takes it back."""
        if threading.get_ident() != self._owner:
            raise MatcherOwnershipError(
                f"thread {threading.current_thread().name!r} touched a grammar matcher owned by "
                f"thread {self._owner}"
            )
        job = self._job
        if job is not None:
            job.done.wait()
            self._job = None
        return self._matcher

    def _lend(self, job: _MaskJob) -> None:
        self._claim()  # a matcher is lent by its owner, and to one job at a time
        self._job = job

    def _give_back(self, job: _MaskJob) -> None:
        """The owner, after ``job`` is done: the loan ends."""
        if self._job is job:
            self._job = None

    def _raw_for(self, job: _MaskJob | None) -> Any:
        """The raw matcher for ``job`` (on the helper thread, holding the loan) or, with None,
        for the owner thread."""
        if job is None:
            return self._claim()
        if self._job is not job or threading.get_ident() == self._owner:
            raise MatcherOwnershipError("a mask job touched a grammar matcher it does not hold")
        return self._matcher

    def _fail(self, what: str, err: BaseException) -> None:
        if self.failure is None:
            self.failure = f"{what} failed: {type(err).__name__}: {err}"
            logger.warning("grammar matcher failed: %s", self.failure)

    def _call(self, what: str, fn: Callable[[Any], T], fallback: T) -> T:
        matcher = self._claim()
        if self.failure is not None:
            return fallback
        try:
            return fn(matcher)
        except Exception as err:  # noqa: BLE001 - the request's grammar failed, not the step
            self._fail(what, err)
            return fallback


def advance(matcher: Any, tokens: Sequence[int]) -> None:
    """Feed tokens sampled elsewhere (prefill's first token, a migrated stream's output) to a
    matcher; InvalidArgumentError when the grammar does not allow them."""
    if tokens and not matcher.consume_tokens(list(tokens)):
        raise InvalidArgumentError(
            f"the tokens generated so far do not follow the output grammar: {matcher.get_error()}",
            param="output_token_ids",
        )


class GrammarMasks:
    """Token masks of the constrained rows of a step, computed on a helper thread (which holds
    the rows' :class:`OwnedMatcher` s on loan until joined: see the module docstring)."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int] = (),
                 overlap: bool | None = None) -> None:  # fmt: skip
        """``eos_token_ids``: what a row whose grammar allows nothing (a matcher in its error
        state) may still pick, so that it ends; ``overlap``: fill on a helper thread during the
        forward pass; None decides by the machine (only when a core is left over by the engine's
        intra-op threads)."""
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        self.words = -(-vocab_size // 32)
        self.overlap = overlap
        self._pool: ThreadPoolExecutor | None = None
        self._pending: _MaskJob | None = None

    def prepare(self, matchers: Sequence[Any | None]) -> None:
        """Start the masks of a step whose sampled rows have these matchers (None: row
        unconstrained), lending them to the helper thread. Nothing starts when no row is
        constrained, where no core is spare, or when a row's matcher is a bare ``LLMatcher``
        (only an :class:`OwnedMatcher` can be lent)."""
        self.join()
        if all(m is None for m in matchers):
            return
        if self.overlap is None:
            self.overlap = (os.cpu_count() or 1) > torch.get_num_threads()
        if not self.overlap or not all(m is None or isinstance(m, OwnedMatcher) for m in matchers):
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        job = _MaskJob(list(matchers))
        for matcher in job.rows:
            if matcher is not None:
                matcher._lend(job)
        self._pending = job
        self._pool.submit(self._run, job)

    def join(self) -> _MaskJob | None:
        """Wait for the mask job in flight (if any) and take its matchers back: after this, the
        calling (owner) thread holds every matcher. Returns the finished job."""
        job, self._pending = self._pending, None
        if job is None:
            return None
        job.done.wait()
        for matcher in job.rows:
            if matcher is not None:
                matcher._give_back(job)
        return job

    @property
    def in_flight(self) -> bool:
        """Whether a mask job was started and not joined yet."""
        return self._pending is not None

    def take(self, matchers: Sequence[Any | None]) -> torch.Tensor:
        """``[rows, vocab]`` bool: True where the row's grammar allows the token (all True for an
        unconstrained row). Joins the prepared job first, whatever rows are asked for, and uses
        its masks when they are for these matchers."""
        job = self.join()
        if (job is not None and job.masks is not None and len(job.rows) == len(matchers)
                and all(a is b for a, b in zip(job.rows, matchers))):  # fmt: skip
            return job.masks
        return self._fill(list(matchers), None)

    def _run(self, job: _MaskJob) -> None:
        """On the helper thread: fill ``job``'s masks, then hand its matchers back (``done``)."""
        try:
            job.masks = self._fill(job.rows, job)
        except BaseException as err:  # noqa: BLE001 - take() recomputes on the owner thread
            job.error = err
            logger.warning("grammar masks failed on the helper thread: %s", err)
        finally:
            job.done.set()

    def _fill(self, matchers: list[Any | None], job: _MaskJob | None) -> torch.Tensor:
        """The masks of ``matchers``: on the helper thread for ``job``, or (None) on the owner."""
        words = np.full((len(matchers), self.words), -1, dtype=np.int32)
        for row, matcher in enumerate(matchers):
            if matcher is None:
                continue
            if not isinstance(matcher, OwnedMatcher):  # a bare matcher: the caller's own thread
                matcher.unsafe_compute_mask_ptr(words[row].ctypes.data, self.words * 4)
                continue
            raw = matcher._raw_for(job)
            if matcher.failure is not None:
                words[row] = 0
                continue
            try:
                raw.unsafe_compute_mask_ptr(words[row].ctypes.data, self.words * 4)
            except Exception as err:  # noqa: BLE001 - this row's grammar failed, not the step
                matcher._fail("computing the token mask", err)
                words[row] = 0
        dead = ~words.any(axis=1)  # a matcher in its error state allows nothing: let it end
        unsigned = words.view(np.uint32)
        for token in self.eos_token_ids:
            unsigned[dead, token // 32] |= np.uint32(1 << (token % 32))
        # bit i of word w is token 32 w + i: little-endian words, least significant bit first
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, : self.vocab_size].view(np.bool_))

    def close(self) -> None:
        self.join()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
