"""The ``tandem.v1.Decode`` gRPC servicer: protos in and out around :class:`DecodeWorker`.

``Reserve`` holds a request's destination blocks before its prefill starts (RESOURCE_EXHAUSTED at
once when there is no room or the caller's quota, counted per certificate, is spent), bound to
the digest of the prompt and ``cache_salt`` it is for; ``TransferKV`` is the receiving end of the
KV transports (it takes the reserved blocks, and is refused without a reservation for its
header's prompt and salt; its go-ahead advertises the KV channel when this worker hosts one);
``KVStore`` is the rendezvous store of that channel's pair groups (answering only the peer a group
was advertised to); ``Generate`` streams one
``GenerateResponse`` per engine output (the first starts with prefill's token; the last carries
the finish reason). A ``Generate`` that carries the prompt (``prompt_token_ids``) is prefilled
here instead (local prefill: no transfer). Typed errors become status codes through the
server's ErrorInterceptor; a client that cancels ``Generate`` cancels the handler, which aborts
the request in the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc.aio

from services.common.errors import InvalidArgumentError
from services.common.pb import decode_pb2, decode_pb2_grpc
from services.common.peer_roles import caller_identity, peer_identity
from services.common.wire import sampling_params_from_proto, token_logprobs_to_proto
from services.decode.worker import DecodeWorker
from services.engine.core.engine import RequestOutput
from services.engine.kv_transfer.grpc_transport import ACCEPTED_METADATA
from services.engine.runtime.worker_servicer import WorkerServicer, require_request_id


SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


class DecodeServicer(WorkerServicer, decode_pb2_grpc.DecodeServicer):
    """Reserve, TransferKV and Generate, plus the shared Abort and GetStats, for one worker."""

    role = "decode"
    worker: DecodeWorker

    async def Reserve(
        self, request: decode_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.ReserveResponse:
        require_request_id(request.request_id)
        grant = await self.worker.receiver.reservations.reserve(
            request.request_id, request.num_tokens, request.lease_seconds,
            prompt_digest=request.prompt_digest,
            caller=caller_identity(context.peer(), context.auth_context()),
            renew=request.renew,
        )
        return decode_pb2.ReserveResponse(
            request_id=grant.request_id, num_blocks=grant.num_blocks,
            lease_seconds=grant.lease_seconds, kv_blocks_free=grant.kv_blocks_free,
        )  # fmt: skip

    async def TransferKV(
        self,
        request_iterator: AsyncIterator[decode_pb2.KVTransferMessage],
        context: grpc.aio.ServicerContext,
    ) -> decode_pb2.KVTransferAck:
        async def accept(channel: tuple[tuple[str, str], ...]) -> None:
            await context.send_initial_metadata((*ACCEPTED_METADATA, *channel))

        caller = peer_identity(context.peer(), context.auth_context())
        return await self.worker.receive_kv(request_iterator, accept, caller)

    async def KVStore(
        self, request: decode_pb2.KVStoreRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.KVStoreResponse:
        return await self.worker.serve_store(
            request, peer_identity(context.peer(), context.auth_context()))

    async def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        require_request_id(request.request_id)
        if request.wait_for_kv_seconds < 0:
            raise InvalidArgumentError("wait_for_kv_seconds must not be negative",
                                       param="wait_for_kv_seconds")
        completion_tokens = 0
        if request.prompt_token_ids:
            if not request.HasField("params"):
                raise InvalidArgumentError("params is required with prompt_token_ids",
                                           param="params")
            completion_tokens = len(request.output_token_ids)
            stream = self.worker.generate_local(
                request.request_id, list(request.prompt_token_ids),
                sampling_params_from_proto(request.params), list(request.output_token_ids),
            )  # fmt: skip
        elif request.output_token_ids:
            raise InvalidArgumentError("output_token_ids needs prompt_token_ids",
                                       param="output_token_ids")
        else:
            stream = self.worker.generate(request.request_id, request.wait_for_kv_seconds or None)
        async with contextlib.aclosing(stream) as outputs:
            async for out in outputs:
                completion_tokens += len(out.new_token_ids)
                yield _response(out, completion_tokens)

    def waiting_outside_the_engine(self) -> int:
        return self.worker.receiver.num_pending


def _response(out: RequestOutput, completion_tokens: int) -> decode_pb2.GenerateResponse:
    return decode_pb2.GenerateResponse(
        token_ids=out.new_token_ids,
        logprobs=[token_logprobs_to_proto(lp) for lp in out.new_logprobs if lp is not None],
        text=out.text,
        finish_reason=(out.finish_reason or "") if out.finished else "",
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        completion_tokens=completion_tokens,
        prompt_logprobs=[token_logprobs_to_proto(lp) for lp in out.prompt_logprobs or ()],
    )
