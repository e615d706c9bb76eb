"""Start a decode worker in this process: the shared worker runtime (with the output text) plus
the decode role (the KV receiver with its reaper for parked KV and reservation leases, the KV
channel's pair groups and their rendezvous store (served as ``Decode.KVStore``) with
``--kv-transport distributed``, the CUDA IPC endpoint with ``cuda-ipc``,
the ``Decode`` servicer). A model without an LM head (an embedding model) is refused: it has no
tokens to decode.

:func:`start_decode_worker` is what ``tandem serve decode`` runs (``main.py``) and what tests
call directly; it returns a :class:`~services.engine.runtime.worker_runtime.WorkerHandle`
(``handle.address``, ``handle.engine_loop.stats``, ``await handle.stop()``).
"""

from __future__ import annotations

from services.common.errors import ModelLoadError
from services.common.metrics import TandemMetrics
from services.common.pb import decode_pb2_grpc
from services.decode.options import (
    DEFAULT_RESERVATION_LEASE_SECONDS,
    DEFAULT_WAIT_FOR_KV_SECONDS,
    check_reservation_lease,
)
from services.decode.servicer import SERVICE_NAME, DecodeServicer
from services.decode.worker import DecodeWorker
from services.engine.kv_transfer.channel_store import ChannelStore
from services.engine.kv_transfer.reservation_quota import ReservationQuota
from services.engine.core.loaders import LoadedModel
from services.engine.kv_transfer import (
    ChannelHost,
    CudaIpcEndpoint,
    DistributedKVEndpoint,
    KVChannelEndpoint,
    KVReceiver,
)
from services.engine.runtime.engine_loop import EngineLoop
from services.engine.runtime.worker_options import WorkerOptions, resolve_kv_transport
from services.engine.runtime.worker_runtime import RoleParts, WorkerHandle, start_worker
from services.tokenizer.tokenizer import Tokenizer


async def start_decode_worker(
    options: WorkerOptions,
    *,
    wait_for_kv_seconds: float = DEFAULT_WAIT_FOR_KV_SECONDS,
    park_seconds: float | None = None,
    reservation_lease_seconds: float = DEFAULT_RESERVATION_LEASE_SECONDS,
    reap_interval: float | None = None,
    loaded: LoadedModel | None = None,
    tokenizer: Tokenizer | None = None,
    metrics: TandemMetrics | None = None,
    reservation_quota: ReservationQuota | None = None,
) -> WorkerHandle:
    """Build and start a decode worker; see the module docstring.

    Args:
        options: the shared worker options.
        wait_for_kv_seconds: default wait of ``Generate`` for its KV.
        park_seconds: how long committed KV waits for ``Generate`` (and stalled transfers may
            idle) before being freed; default ``wait_for_kv_seconds``.
        reservation_lease_seconds: how long reserved blocks wait for their header when the
            ``Reserve`` call asks for no lease.
        reap_interval: how often parked KV and reservation leases are checked (default: a
            quarter of the shorter wait, at most 1 s).
        loaded / tokenizer: already loaded model and tokenizer (tests share them).
        metrics: the registry to record into (default: a fresh one).
        reservation_quota: bounds on reserved KV per caller and in total (default: 50% of the
            pool in total, 25% per caller; ``reservation_quota.py``).
    """

    check_reservation_lease(reservation_lease_seconds)
    quota = (reservation_quota or ReservationQuota()).validate()
    kind = resolve_kv_transport(options.kv_transport, options.device)

    def decode_role(engine_loop: EngineLoop, metrics: TandemMetrics) -> RoleParts:
        if not engine_loop.engine.loaded.config.has_lm_head:
            raise ModelLoadError(
                f"{engine_loop.engine.loaded.source.name} is a base checkpoint without an LM head "
                "(an embedding model): it cannot decode; serve it on prefill workers alone "
                "(tandem up --decode 0)")
        receiver = KVReceiver(
            engine_loop, park_seconds=park_seconds or wait_for_kv_seconds,
            reservation_lease_seconds=reservation_lease_seconds, reap_interval=reap_interval,
            metrics=metrics, quota=quota,
        )  # fmt: skip
        channel: KVChannelEndpoint | None = None
        channel_store: ChannelStore | None = None
        if kind == "distributed":  # the stall reaper ends a stalled piece first
            host = ChannelHost(host=options.reachable_host(),
                               op_timeout=2 * receiver.park_seconds)  # fmt: skip
            channel, channel_store = DistributedKVEndpoint(receiver, host), host.store
        elif kind == "cuda-ipc":
            channel = CudaIpcEndpoint(receiver)
        worker = DecodeWorker(engine_loop, receiver, wait_for_kv_seconds=wait_for_kv_seconds,
                              channel=channel, channel_store=channel_store)  # fmt: skip
        servicer = DecodeServicer(worker, worker_id=options.worker_id)
        return worker, servicer, decode_pb2_grpc.add_DecodeServicer_to_server, SERVICE_NAME

    return await start_worker("decode", options, decode_role, loaded=loaded, tokenizer=tokenizer,
                              metrics=metrics, with_text=True)  # fmt: skip
