"""The prefill worker's embeddings: validate inputs, batch them across ``Embed`` calls, and run
them on the engine thread with :class:`~services.engine.core.embedder.Embedder`.

Prefill workers already run prompts without decoding, so they serve ``/v1/embeddings`` too. One
call (``EmbeddingQueue.embed``):

  1. Check every input (non-empty, ids in the vocabulary, at most the context) and
     ``dimensions`` (at most the hidden size): InvalidArgumentError naming the param.
  2. Queue its inputs, one job each, behind those of earlier calls; one drain task per worker
     takes queued jobs (skipping those of calls that went away) as waves and runs each wave as one
     engine-loop command (:meth:`Embedder.run`: forward passes over fresh blocks, freed before the
     command returns), so inputs of concurrent calls share forward passes.
  3. A wave that cannot get blocks now (prefills or leases hold them) waits briefly and retries;
     an input longer than the whole pool fails alone (ResourceExhaustedError).
  4. Each vector is truncated to ``dimensions`` and L2-normalised when the pooling says so.

Cancellation: a call that is cancelled (its client went away, its deadline passed) marks its
jobs done; the drain task never starts them, and a wave already running finishes and frees its
blocks in its own command, its vectors dropped. Nothing holds KV between commands, so no path
leaks a block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgumentError, TandemError, UnavailableError
from services.common.pooling_config import PoolingConfig
from services.engine.core.embedder import Embedder, finish_embedding
from services.engine.core.engine import LLMEngine
from services.engine.runtime.engine_loop import EngineLoop

logger = logging.getLogger(__name__)

RETRY_SECONDS = (0.005, 0.2)
"""First and longest wait before a wave that found no free blocks tries again (doubling)."""


@dataclass(slots=True)
class _Job:
    token_ids: list[int]
    future: asyncio.Future[torch.Tensor]


class EmbeddingQueue:
    """Embeds inputs of every ``Embed`` call of one worker (see the module docstring)."""

    def __init__(self, engine_loop: EngineLoop, pooling: PoolingConfig) -> None:
        self.engine_loop = engine_loop
        self.pooling = pooling
        engine = engine_loop.engine
        self.embedder = Embedder(
            engine.loaded.model, engine.kv, engine.block_manager, pooling=pooling.mode,
            max_num_batched_tokens=engine.config.max_num_batched_tokens,
        )  # fmt: skip
        self.vocab_size = engine.loaded.config.vocab_size
        self.max_model_len = engine.max_model_len
        self._pending: deque[_Job] = deque()
        self._drain: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def hidden_size(self) -> int:
        return self.embedder.hidden_size

    @property
    def idle(self) -> bool:
        """Whether no wave runs or waits to (the drain task has finished)."""
        return self._drain is None or self._drain.done()

    @property
    def num_waiting(self) -> int:
        """Queued inputs not yet computed (the worker's ``num_waiting`` counts them)."""
        return sum(1 for job in self._pending if not job.future.done())

    async def embed(
        self, inputs: Sequence[Sequence[int]], *, dimensions: int | None = None
    ) -> list[torch.Tensor]:
        """One vector per input, in order; see the module docstring.

        Raises:
            InvalidArgumentError: a bad input (param ``input``) or ``dimensions``.
            ResourceExhaustedError: an input needs more KV blocks than the worker has.
            UnavailableError: the worker is stopping.
        """
        self._check(inputs, dimensions)
        if self._closed:
            raise UnavailableError("the worker is stopping")
        loop = asyncio.get_running_loop()
        jobs = [_Job([int(t) for t in ids], loop.create_future()) for ids in inputs]
        self._pending.extend(jobs)
        self._kick()
        try:
            vectors = [await job.future for job in jobs]
        finally:
            for job in jobs:  # a call that left: its queued jobs are skipped, never started
                if job.future.done() and not job.future.cancelled():
                    job.future.exception()  # seen (one failure fails the whole call)
                job.future.cancel()
        return [finish_embedding(v, dimensions=dimensions, normalize=self.pooling.normalize)
                for v in vectors]  # fmt: skip

    def _check(self, inputs: Sequence[Sequence[int]], dimensions: int | None) -> None:
        if not inputs:
            raise InvalidArgumentError("input must hold at least one item", param="input")
        for index, ids in enumerate(inputs):
            if not ids:
                raise InvalidArgumentError(f"input[{index}] is empty", param="input")
            if len(ids) > self.max_model_len:
                raise InvalidArgumentError(
                    f"This model's maximum context length is {self.max_model_len} tokens, "
                    f"however input[{index}] has {len(ids)} tokens.",
                    param="input", code="context_length_exceeded",
                )  # fmt: skip
            if any(not 0 <= int(t) < self.vocab_size for t in ids):
                raise InvalidArgumentError(
                    f"input[{index}] holds a token id outside [0, {self.vocab_size})",
                    param="input", code="invalid_value",
                )  # fmt: skip
        if dimensions is not None and not 1 <= dimensions <= self.hidden_size:
            raise InvalidArgumentError(
                f"dimensions must be between 1 and this model's embedding size "
                f"{self.hidden_size}, got {dimensions}", param="dimensions", code="invalid_value",
            )  # fmt: skip

    def _kick(self) -> None:
        if self._drain is None or self._drain.done():
            self._drain = asyncio.get_running_loop().create_task(self._run(), name="embed-drain")

    async def _run(self) -> None:
        """Run queued jobs wave by wave until none is left (the drain task)."""
        wait = RETRY_SECONDS[0]
        while True:
            while self._pending and self._pending[0].future.done():
                self._pending.popleft()  # its call went away
            if not self._pending:
                return
            jobs = [job for job in self._pending if not job.future.done()]
            ids = [job.token_ids for job in jobs]
            try:
                vectors = await self.engine_loop.call(lambda engine: self._wave(engine, ids))
            except TandemError as err:  # the first job alone (too long), or the engine stopping
                failed = jobs[:1] if err.code == "kv_cache_too_small" else jobs
                self._settle(failed, err)
                continue
            except Exception as exc:  # noqa: BLE001 - the forward pass failed: these calls fail
                logger.exception("embedding forward pass failed")
                self._settle(jobs, UnavailableError(f"the embedding pass failed: {exc}"))
                continue
            if not vectors:  # no blocks free now: prefills or leases hold them
                await asyncio.sleep(wait)
                wait = min(2 * wait, RETRY_SECONDS[1])
                continue
            wait = RETRY_SECONDS[0]
            done = jobs[: len(vectors)]
            for job in done:
                self._pending.remove(job)
            for job, vector in zip(done, vectors, strict=True):
                if not job.future.done():
                    job.future.set_result(vector)

    def _wave(self, engine: LLMEngine, ids: list[list[int]]) -> list[torch.Tensor]:
        """On the engine thread: refuse on an unhealthy worker, else embed what fits now."""
        self.engine_loop.health.check()
        vectors = self.embedder.run(ids)
        if vectors and self.engine_loop.metrics is not None:
            self.engine_loop.metrics.prompt_tokens.inc(sum(len(i) for i in ids[: len(vectors)]))
        return vectors

    def _settle(self, jobs: list[_Job], error: BaseException) -> None:
        for job in jobs:
            with contextlib.suppress(ValueError):
                self._pending.remove(job)
            if not job.future.done():
                job.future.set_exception(error)

    async def close(self) -> None:
        """Fail every queued job and stop the drain task (the worker is stopping)."""
        self._closed = True
        self._settle(list(self._pending), UnavailableError("the worker is stopping"))
        if self._drain is not None:
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain
