"""The ``tandem.v1.Decode`` gRPC servicer: protos in and out around :class:`DecodeWorker`.

``TransferKV`` is the receiving end of the default KV transport; ``Generate`` streams one
``GenerateResponse`` per engine output (the first starts with prefill's token; the last carries
the finish reason). Typed errors become status codes through the server's ErrorInterceptor; a
client that cancels ``Generate`` cancels the handler, which aborts the request in the engine.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc.aio

from services.common.errors import InvalidArgumentError
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.wire import token_logprobs_to_proto
from services.decode.worker import DecodeWorker
from services.engine.core.engine import RequestOutput
from services.engine.kv_transfer.grpc_transport import ACCEPTED_METADATA
from services.engine.runtime.worker_runtime import worker_stats

logger = logging.getLogger(__name__)

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """TransferKV, Generate, Abort and GetStats for one worker."""

    def __init__(self, worker: DecodeWorker, *, worker_id: str, address: str) -> None:
        self.worker = worker
        self.worker_id = worker_id
        self.address = address

    async def TransferKV(
        self,
        request_iterator: AsyncIterator[decode_pb2.KVTransferMessage],
        context: grpc.aio.ServicerContext,
    ) -> decode_pb2.KVTransferAck:
        async def accept() -> None:
            await context.send_initial_metadata(ACCEPTED_METADATA)

        return await self.worker.receiver.receive(request_iterator, accept)

    async def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        if not request.request_id:
            raise InvalidArgumentError("request_id is required", param="request_id")
        if request.wait_for_kv_seconds < 0:
            raise InvalidArgumentError("wait_for_kv_seconds must not be negative",
                                       param="wait_for_kv_seconds")
        completion_tokens = 0
        stream = self.worker.generate(request.request_id, request.wait_for_kv_seconds or None)
        async with contextlib.aclosing(stream) as outputs:
            async for out in outputs:
                completion_tokens += len(out.new_token_ids)
                yield _response(out, completion_tokens)

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        if not request.request_id:
            raise InvalidArgumentError("request_id is required", param="request_id")
        found = await self.worker.abort(request.request_id, request.reason or "aborted")
        return common_pb2.AbortResponse(found=found)

    async def GetStats(
        self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerStats:
        return worker_stats(
            self.worker.engine_loop.stats, role="decode", worker_id=self.worker_id,
            address=self.address, extra_waiting=self.worker.receiver.num_pending,
        )


def _response(out: RequestOutput, completion_tokens: int) -> decode_pb2.GenerateResponse:
    return decode_pb2.GenerateResponse(
        token_ids=out.new_token_ids,
        logprobs=[token_logprobs_to_proto(lp) for lp in out.new_logprobs if lp is not None],
        text=out.text,
        finish_reason=(out.finish_reason or "") if out.finished else "",
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        completion_tokens=completion_tokens,
    )
