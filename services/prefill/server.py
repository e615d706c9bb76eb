"""Start a prefill worker in this process: the shared worker runtime plus the prefill role (the
KV sender with its lease reaper over the ``--kv-transport`` transport: gRPC, the distributed
pair groups or CUDA IPC; the ``Prefill`` servicer, whose ``Embed`` runs on the worker's
:class:`~services.prefill.embedding_queue.EmbeddingQueue`).

:func:`start_prefill_worker` is what ``tandem serve prefill`` runs (``main.py``) and what tests
call directly; it returns a :class:`~services.engine.runtime.worker_runtime.WorkerHandle`
(``handle.address``, ``handle.engine_loop.stats``, ``await handle.stop()``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from services.common.grpc_channel import MAX_KV_CHUNK_BYTES
from services.common.member_addresses import MemberAddresses
from services.common.metrics import TandemMetrics
from services.common.pb import prefill_pb2_grpc
from services.common.pooling_config import read_pooling_config
from services.engine.core.loaders import LoadedModel
from services.engine.kv_transfer import (
    CudaIpcKVTransport,
    DistributedKVTransport,
    GrpcKVTransport,
    KVSender,
    KVTransport,
)
from services.engine.kv_transfer.sender import CorruptChunk
from services.engine.runtime.engine_loop import EngineLoop
from services.engine.runtime.worker_options import WorkerOptions, resolve_kv_transport
from services.engine.runtime.worker_runtime import RoleParts, WorkerHandle, start_worker
from services.prefill.embedding_queue import EmbeddingQueue
from services.prefill.options import DEFAULT_LEASE_SECONDS
from services.prefill.servicer import SERVICE_NAME, PrefillServicer
from services.prefill.worker import PrefillWorker

logger = logging.getLogger(__name__)


async def start_prefill_worker(
    options: WorkerOptions,
    *,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    lease_interval: float | None = None,
    loaded: LoadedModel | None = None,
    transport: KVTransport | None = None,
    metrics: TandemMetrics | None = None,
    max_chunk_bytes: int = MAX_KV_CHUNK_BYTES,
    corrupt_chunk: CorruptChunk | None = None,
    decode_members: Sequence[str] = (),
    pooling: str | None = None,
) -> WorkerHandle:
    """Build and start a prefill worker; see the module docstring.

    Args:
        options: the shared worker options.
        lease_seconds / lease_interval: KV lease TTL and reaper period.
        loaded: an already loaded model (tests share one between workers).
        transport: how KV travels (default: ``options.kv_transport``'s, to the decode worker's
            address; CUDA IPC's needs the engine loop, so it is always built here).
        metrics: the registry to record into (default: a fresh one).
        max_chunk_bytes: KV chunk size budget.
        corrupt_chunk: test-only fault hook, see ``KVSender``.
        decode_members: the decode pool's ``host:port`` entries (names follow DNS); a Prefill
            whose ``decode_address`` is none of them is refused. Empty: any address (mTLS still
            requires a decode certificate there).
        pooling: ``--pooling``: how ``Embed`` pools hidden states (``last`` / ``mean``), over
            the model folder's sentence-transformers config (``pooling_config.py``); None: the
            folder's, else last-token.
    """
    members = MemberAddresses(decode_members)
    if not members.restricted:
        logger.warning("no --decode-members: KV goes to whichever decode_address a gateway names "
                       "(mutual TLS still requires a decode certificate there)")
    kind = resolve_kv_transport(options.kv_transport, options.device)

    def prefill_role(engine_loop: EngineLoop, metrics: TandemMetrics) -> RoleParts:
        kv_transport: KVTransport
        if transport is not None:
            kv_transport = transport
        elif kind == "distributed":  # the lease ends a stuck piece before op_timeout
            kv_transport = DistributedKVTransport(
                peer_id=options.worker_id, host=options.reachable_host(),
                op_timeout=2 * lease_seconds, grpc=GrpcKVTransport(options.internal_tls()))
        elif kind == "cuda-ipc":
            kv_transport = CudaIpcKVTransport(engine_loop, peer_id=options.worker_id,
                                              inner=GrpcKVTransport(options.internal_tls()))
        else:
            kv_transport = GrpcKVTransport(options.internal_tls())
        sender = KVSender(
            engine_loop, kv_transport, lease_seconds=lease_seconds,
            lease_interval=lease_interval, max_chunk_bytes=max_chunk_bytes, metrics=metrics,
            corrupt_chunk=corrupt_chunk,
        )  # fmt: skip
        source = engine_loop.engine.loaded.source
        folder = Path(source.path) if source.kind == "hf" else None
        embeddings = EmbeddingQueue(engine_loop, read_pooling_config(folder, pooling))
        worker = PrefillWorker(engine_loop, sender, embeddings)
        servicer = PrefillServicer(worker, worker_id=options.worker_id, decode_members=members)
        return worker, servicer, prefill_pb2_grpc.add_PrefillServicer_to_server, SERVICE_NAME

    # prefill-only requests end at their first token: no text to make
    return await start_worker("prefill", options, prefill_role, loaded=loaded, metrics=metrics)
