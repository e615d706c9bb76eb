"""The decode worker: receive prompts' KV from prefill workers and generate in one running batch.

One request (docs/request-lifecycle.md steps 4-7, docs/kv-handoff.md):
  0. ``Reserve`` (``receiver.reserve``), before the prefill starts: allocate the destination
     blocks under a lease for one prompt and ``cache_salt``, or refuse at once when there is no
     room (required: a transfer without its reservation is refused; see
     ``kv_transfer/receiver.py``).
  1. ``TransferKV`` (``receive_kv``: ``receiver.receive``, behind the payload channel's
     endpoint when this worker serves one: the distributed pair groups or CUDA IPC) checks the
     header, takes the reserved blocks (or allocates them), writes the checked chunks (or copies
     them on the GPU) and parks the committed KV.
  2. ``Generate`` (``generate``) waits for that commit (or its failure), then hands the blocks
     to the engine as a running sequence: it joins the continuous batch at the next step, and
     every step appends one token to every running sequence.
  3. Outputs stream back until a stop condition; the sequence's blocks are then freed.
  4. ``abort`` frees the request wherever it is: reserved, mid-transfer, parked, or generating (the
     stream then ends with finish reason "abort"). A client that cancels ``Generate`` aborts
     the request in the engine the same way.

A request may also skip steps 1-2 (``generate_local``): the gateway sends the prompt itself when
it is short enough to prefill here (conditional disaggregation) or when no prefill pool exists
(``tandem up --mode colocated``). The engine then chunks that prompt into its running batch
under the step's token budget, next to the other sequences' decode tokens (vLLM v1's rule; see
``services/engine/core/scheduler.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

from services.common.errors import AbortedError, FailedPreconditionError, NotFoundError
from services.common.pb import decode_pb2
from services.common.sampling_params import SamplingParams
from services.engine.core.engine import RequestOutput
from services.engine.runtime.engine_loop import EngineLoop
from services.engine.kv_transfer import KVReceiver
from services.engine.kv_transfer.channel_store import ChannelStore
from services.engine.kv_transfer.transport import AcceptWithMetadata, KVChannelEndpoint

logger = logging.getLogger(__name__)


class DecodeWorker:
    """KV receiving + generation over one engine loop."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        receiver: KVReceiver,
        *,
        wait_for_kv_seconds: float = 30.0,
        channel: KVChannelEndpoint | None = None,
        channel_store: ChannelStore | None = None,
    ) -> None:
        """``channel``: the payload channel's endpoint, if this worker serves one;
        ``channel_store``: the distributed channel's rendezvous store (``Decode.KVStore``)."""
        self.engine_loop = engine_loop
        self.receiver = receiver
        self.wait_for_kv_seconds = wait_for_kv_seconds
        self.channel = channel
        self.channel_store = channel_store

    def start(self) -> None:
        self.receiver.start()

    async def close(self) -> None:
        await self.receiver.close()
        if self.channel is not None:
            self.channel.close()

    async def receive_kv(
        self,
        messages: AsyncIterator[decode_pb2.KVTransferMessage],
        accept: AcceptWithMetadata,
        caller: str = "",
    ) -> decode_pb2.KVTransferAck:
        """Run one ``TransferKV`` stream; ``accept(metadata)`` sends the go-ahead (with the KV
        channel's advert when the sender offered one and this worker serves that channel);
        ``caller``: the sender's identity (a channel's store answers only that peer)."""
        if self.channel is not None:
            return await self.channel.receive(messages, accept, caller)
        return await self.receiver.receive(messages, lambda: accept(()))

    async def serve_store(
        self, request: decode_pb2.KVStoreRequest, caller: str
    ) -> decode_pb2.KVStoreResponse:
        """One op on the KV channel's rendezvous store (``Decode.KVStore``) for ``caller``.

        Raises:
            FailedPreconditionError: this worker hosts no distributed KV channel.
        """
        if self.channel_store is None:
            raise FailedPreconditionError("this decode worker hosts no KV channel store "
                                          "(--kv-transport distributed)")  # fmt: skip
        return await self.channel_store.serve(request, caller)

    async def generate(
        self, request_id: str, wait_for_kv_seconds: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Wait for the request's KV, then yield its outputs (the first has prefill's token).

        Raises:
            NotFoundError: the KV did not arrive in time.
            TandemError: the transfer failed (its typed error) or the request was aborted.
        """
        wait = wait_for_kv_seconds if wait_for_kv_seconds else self.wait_for_kv_seconds
        ready = await self.receiver.claim(request_id, wait)
        try:
            stream = self.engine_loop.generate_prefilled(
                request_id, ready.prompt_token_ids, ready.params,
                first_token_id=ready.first_token_id, first_logprob=ready.first_logprob,
                num_cached_tokens=ready.num_cached_tokens,
            )
            async with contextlib.aclosing(stream) as outputs:
                async for out in outputs:
                    yield out
        except NotFoundError:
            # The blocks vanished between claim and admission: an Abort got there first.
            raise AbortedError(f"request {request_id!r} was aborted", code="aborted") from None
        finally:
            # Claimed blocks the engine never took (cancelled before admission) are freed here;
            # once the engine owns them this is a no-op.
            self.engine_loop.release_nowait(request_id)

    async def generate_local(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        resume_output_ids: Sequence[int] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Prefill ``prompt_token_ids`` here (with ``resume_output_ids``, the outputs of a stream
        migrated from a dead worker) and yield every new output. Cancelling the consumer aborts
        the request and frees its blocks."""
        stream = self.engine_loop.generate(request_id, prompt_token_ids, params,
                                           resume_output_ids=resume_output_ids)  # fmt: skip
        async with contextlib.aclosing(stream) as outputs:
            async for out in outputs:
                yield out

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Free ``request_id`` on this worker wherever it is; True when it was found."""
        found = self.receiver.abort(request_id, reason)
        found = await self.engine_loop.abort(request_id) or found
        if found:
            logger.info("aborted: %s", reason, extra={"request_id": request_id})
        return found
