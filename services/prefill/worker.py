"""The prefill worker: run prompts through the engine, then ship their KV to a decode worker.

One request (docs/request-lifecycle.md, steps 5-6):
  1. The prompt joins the engine as a prefill-only request; the engine loop batches it with
     every other queued prompt into the same forward passes, chunks it when it is longer than
     the step's token budget, and reuses cached prefix blocks.
  2. The first token is sampled; the engine keeps the blocks (held by the engine loop).
  3. :class:`~services.engine.kv_transfer.KVSender` streams the blocks to the decode worker
     under a lease, and frees them on ack, failure, abort or lease expiry.
  4. The result carries the first token, prefix-cache hits, bytes and timings.

Embeddings (the ``Embed`` RPC) are the :class:`EmbeddingQueue`'s, closed with the worker.

``abort`` works in every phase: queued or computing (the engine drops the sequence), shipping
(the transfer is cancelled and the lease released), or not started yet (the id is remembered for
a while, so a Prefill that arrives after its Abort is refused).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.errors import AbortedError, ResourceExhaustedError
from services.common.pb import common_pb2
from services.common.sampling_params import SamplingParams
from services.engine.core.engine import RequestOutput
from services.engine.runtime.engine_loop import EngineLoop
from services.engine.kv_transfer import KVSender, PrefilledRequest
from services.engine.core.sampler import TokenLogprobs
from services.prefill.embedding_queue import EmbeddingQueue

logger = logging.getLogger(__name__)

ABORT_MEMORY_SECONDS = 60.0
"""How long an aborted request id is remembered (an Abort may overtake its Prefill)."""


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What the Prefill RPC answers."""

    request_id: str
    first_token_id: int
    first_logprob: TokenLogprobs | None
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_bytes: int
    num_blocks: int
    prefill_seconds: float
    transfer_seconds: float
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # with params.prompt_logprobs


class PrefillWorker:
    """Prefill + KV shipping over one engine loop and one sender."""

    def __init__(
        self, engine_loop: EngineLoop, sender: KVSender, embeddings: EmbeddingQueue | None = None
    ) -> None:
        self.engine_loop = engine_loop
        self.sender = sender
        self.embeddings = embeddings  # the Embed RPC's queue (embedding_queue.py)
        self._aborted: dict[str, float] = {}

    def start(self) -> None:
        self.sender.start()

    async def close(self) -> None:
        if self.embeddings is not None:
            await self.embeddings.close()
        await self.sender.close()

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        decode_address: str,
        *,
        wire_params: common_pb2.SamplingParams | None = None,
    ) -> PrefillResult:
        """Prefill the prompt and hand its KV to ``decode_address``; see the module lifecycle.
        ``wire_params``: ``params`` as the request carried them, forwarded to decode unchanged.

        Raises:
            AbortedError: aborted meanwhile (or before it arrived).
            ResourceExhaustedError: the prompt needs more KV blocks than this worker has.
            TandemError: the KV transfer failed (DataLossError, FailedPreconditionError, ...).
        """
        self._forget_old_aborts()
        if request_id in self._aborted:
            raise AbortedError(f"request {request_id!r} was aborted", code="aborted")
        started = time.monotonic()
        final = await self._run_prefill(request_id, prompt_token_ids, params)
        prefill_seconds = time.monotonic() - started
        try:
            first_logprob = final.new_logprobs[0] if final.new_logprobs else None
            request = PrefilledRequest(
                request_id=request_id,
                prompt_token_ids=tuple(int(t) for t in prompt_token_ids),
                params=params,
                first_token_id=final.new_token_ids[0],
                first_logprob=first_logprob,
                num_blocks=len(final.block_ids),
                num_cached_tokens=final.num_cached_tokens,
                wire_params=wire_params,
                block_ids=tuple(final.block_ids),
            )
            result = await self.sender.send(request, decode_address)
        finally:
            self.engine_loop.release_nowait(request_id)  # no-op unless something went wrong
        logger.info(
            "prefilled %d tokens (%d cached) and shipped %d KV bytes",
            len(prompt_token_ids), final.num_cached_tokens, result.num_bytes,
            extra={"request_id": request_id, "decode": decode_address},
        )
        return PrefillResult(
            request_id=request_id,
            first_token_id=request.first_token_id,
            first_logprob=first_logprob if params.logprobs is not None else None,
            num_prompt_tokens=len(prompt_token_ids),
            num_cached_tokens=final.num_cached_tokens,
            kv_bytes=result.num_bytes,
            num_blocks=result.num_blocks,
            prefill_seconds=prefill_seconds,
            transfer_seconds=result.seconds,
            prompt_logprobs=tuple(final.prompt_logprobs or ()),
        )

    async def _run_prefill(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> RequestOutput:
        final: RequestOutput | None = None
        stream = self.engine_loop.generate(request_id, prompt_token_ids, params, prefill_only=True)
        async with contextlib.aclosing(stream) as outputs:
            async for out in outputs:
                if out.finished:
                    final = out
        if final is None or final.finish_reason == "abort":
            raise AbortedError(f"request {request_id!r} was aborted", code="aborted")
        if final.finish_reason != "prefilled" or not final.new_token_ids:
            raise ResourceExhaustedError(
                f"the prompt ({len(prompt_token_ids)} tokens) needs more KV blocks than this "
                "prefill worker has",
                param="prompt",
                code="kv_cache_too_small",
            )
        return final

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Stop ``request_id`` wherever it is and free its blocks; True when it was found."""
        self._aborted[request_id] = time.monotonic()
        found = self.sender.abort(request_id, reason)
        found = await self.engine_loop.abort(request_id) or found
        if found:
            logger.info("aborted: %s", reason, extra={"request_id": request_id})
        return found

    def _forget_old_aborts(self) -> None:
        cutoff = time.monotonic() - ABORT_MEMORY_SECONDS
        for request_id in [rid for rid, t in self._aborted.items() if t < cutoff]:
            del self._aborted[request_id]
