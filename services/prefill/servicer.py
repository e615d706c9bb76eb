"""The ``tandem.v1.Prefill`` gRPC servicer: protos in and out around :class:`PrefillWorker`.

Validation failures raise typed errors (the server's ErrorInterceptor turns them into
INVALID_ARGUMENT etc.); a request past its ``deadline_unix`` is answered DEADLINE_EXCEEDED
without computing, and one that runs past it is cancelled (freeing its blocks) and answered the
same. A client that cancels the call cancels the work the same way. A ``decode_address`` that
is not a current decode member (``--decode-members``, ``services/common/member_addresses.py``)
is refused with INVALID_ARGUMENT before any compute or connection, and a model without an LM
head (an embedding model) refuses every Prefill with FAILED_PRECONDITION.

``Embed`` hands a batch of inputs to the worker's
:class:`~services.prefill.embedding_queue.EmbeddingQueue` (same deadline and cancellation rules)
and answers one pooled vector per input.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import grpc.aio

from services.common.errors import FailedPreconditionError, InvalidArgumentError
from services.common.member_addresses import MemberAddresses
from services.common.pb import prefill_pb2, prefill_pb2_grpc
from services.common.wire import sampling_params_from_proto, token_logprobs_to_proto
from services.engine.runtime.worker_servicer import WorkerServicer, require_request_id
from services.prefill.worker import PrefillWorker


SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


class PrefillServicer(WorkerServicer, prefill_pb2_grpc.PrefillServicer):
    """Prefill, plus the shared Abort and GetStats, for one worker."""

    role = "prefill"
    worker: PrefillWorker

    def __init__(
        self,
        worker: PrefillWorker,
        *,
        worker_id: str,
        address: str = "",
        decode_members: MemberAddresses | None = None,
    ) -> None:
        super().__init__(worker, worker_id=worker_id, address=address)
        self.decode_members = decode_members if decode_members is not None else MemberAddresses(())

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        require_request_id(request.request_id)
        if not self.worker.engine_loop.engine.loaded.config.has_lm_head:
            raise FailedPreconditionError(
                "this model is a base checkpoint without an LM head: it serves embeddings only "
                "(POST /v1/embeddings)", code="no_lm_head")
        if not request.token_ids:
            raise InvalidArgumentError("token_ids must not be empty", param="prompt")
        if not request.decode_address:
            raise InvalidArgumentError("decode_address is required", param="decode_address")
        if not await self.decode_members.allows(request.decode_address):
            raise InvalidArgumentError(
                f"decode_address {request.decode_address} is not a decode worker of this "
                "deployment (--decode-members)", param="decode_address", code="not_a_member")
        params = sampling_params_from_proto(request.params)
        timeout = None
        if request.deadline_unix:
            timeout = request.deadline_unix - time.time()
            if timeout <= 0:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    "the request's deadline passed before prefill started")
        try:
            async with asyncio.timeout(timeout):
                result = await self.worker.prefill(
                    request.request_id, list(request.token_ids), params, request.decode_address,
                    wire_params=request.params,  # reaches decode as the gateway sent it
                )
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the request's deadline passed during prefill")
        response = prefill_pb2.PrefillResponse(
            request_id=result.request_id,
            first_token_id=result.first_token_id,
            num_prompt_tokens=result.num_prompt_tokens,
            num_cached_tokens=result.num_cached_tokens,
            kv_bytes=result.kv_bytes,
            prefill_seconds=result.prefill_seconds,
            transfer_seconds=result.transfer_seconds,
            num_blocks=result.num_blocks,
            prompt_logprobs=[token_logprobs_to_proto(lp) for lp in result.prompt_logprobs],
        )
        if result.first_logprob is not None:
            response.first_logprob.CopyFrom(token_logprobs_to_proto(result.first_logprob))
        return response

    async def Embed(
        self, request: prefill_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.EmbedResponse:
        require_request_id(request.request_id)
        queue = self.worker.embeddings
        if queue is None:
            raise FailedPreconditionError("this prefill worker serves no embeddings",
                                          code="no_embeddings")  # fmt: skip
        timeout = None
        if request.deadline_unix:
            timeout = request.deadline_unix - time.time()
            if timeout <= 0:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    "the request's deadline passed before embedding started")
        started = time.monotonic()
        inputs = [list(item.token_ids) for item in request.inputs]
        try:
            async with asyncio.timeout(timeout):
                vectors = await queue.embed(inputs, dimensions=request.dimensions or None)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the request's deadline passed while embedding")
        return prefill_pb2.EmbedResponse(
            request_id=request.request_id,
            embeddings=[prefill_pb2.Embedding(values=v.tolist()) for v in vectors],
            num_prompt_tokens=sum(len(ids) for ids in inputs),
            pooling=queue.pooling.mode,
            normalized=queue.pooling.normalize,
            embed_seconds=time.monotonic() - started,
        )

    def waiting_outside_the_engine(self) -> int:
        """Embedding inputs queued for the engine thread."""
        queue = self.worker.embeddings
        return queue.num_waiting if queue is not None else 0
