"""What every worker role answers over gRPC, written once: ``Abort``, ``GetStats`` and the
request-id check. A role's servicer (``services/prefill/servicer.py``: ``Prefill``;
``services/decode/servicer.py``: ``TransferKV``, ``Generate``) subclasses :class:`WorkerServicer`
together with its generated gRPC base class and adds only its own methods.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import grpc.aio

from services.common.errors import InvalidArgumentError
from services.common.pb import common_pb2
from services.common.protocol import PROTOCOL_VERSION
from services.engine.runtime.engine_loop import EngineLoop
from services.engine.runtime.engine_stats import EngineStats


def worker_stats(
    stats: EngineStats, *, role: str, worker_id: str, address: str, extra_waiting: int = 0,
    model_fingerprint: str = "",
) -> common_pb2.WorkerStats:
    """The ``GetStats`` answer for an engine snapshot."""
    return common_pb2.WorkerStats(
        worker_id=worker_id,
        role=role,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting + extra_waiting,
        kv_blocks_total=stats.num_blocks_total,
        kv_blocks_in_use=stats.num_blocks_in_use,
        kv_blocks_free=stats.num_blocks_free,
        kv_cache_usage=stats.kv_cache_usage,
        block_size=stats.block_size,
        address=address,
        prefix_cache_hit_tokens=stats.prefix_hits,
        prefix_cache_query_tokens=stats.prefix_queries,
        model_fingerprint=model_fingerprint,
        protocol_version=PROTOCOL_VERSION,
    )


class RoleWorker(Protocol):
    """A role's worker object (``PrefillWorker``, ``DecodeWorker``) as the shared parts see it."""

    engine_loop: EngineLoop

    def start(self) -> None: ...
    async def close(self) -> None: ...
    async def abort(self, request_id: str, reason: str) -> bool: ...


def require_request_id(request_id: str) -> None:
    """Every per-request call names its request."""
    if not request_id:
        raise InvalidArgumentError("request_id is required", param="request_id")


class WorkerServicer:
    """``Abort`` and ``GetStats`` for one worker of ``role``; ``address`` is set once serving."""

    role: ClassVar[str]

    def __init__(self, worker: RoleWorker, *, worker_id: str, address: str = "") -> None:
        self.worker = worker
        self.worker_id = worker_id or self.role
        self.address = address

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        require_request_id(request.request_id)
        found = await self.worker.abort(request.request_id, request.reason or "aborted")
        return common_pb2.AbortResponse(found=found)

    async def GetStats(
        self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerStats:
        return worker_stats(self.worker.engine_loop.stats, role=self.role,
                            worker_id=self.worker_id, address=self.address,
                            extra_waiting=self.waiting_outside_the_engine(),
                            model_fingerprint=self.worker.engine_loop.engine.loaded.fingerprint,
                            )  # fmt: skip

    def waiting_outside_the_engine(self) -> int:
        """Requests this role holds that the engine does not see yet (decode: parked KV)."""
        return 0
