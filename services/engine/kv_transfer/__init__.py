"""KV hand-off between a prefill and a decode worker (docs/kv-handoff.md).

One block (all layers' K and V for ``block_size`` token slots) is the unit of transfer. The roles,
one small module each:

- ``sender.KVSender`` (prefill): reads a prefilled request's held blocks and streams header,
  chunks (each with a crc32) and commit, under a lease (``lease.LeaseTable``) that frees the
  blocks on ack, failure, abort or expiry — exactly once.
- ``receiver.KVReceiver`` (decode): reserves destination blocks under a lease before the
  prefill starts (``Decode.Reserve``, bound to the prompt and ``cache_salt``), checks the
  layout, admits a header only into its own reservation (PERMISSION_DENIED otherwise), takes the
  reserved blocks before data moves, writes checked chunks, parks committed KV until
  ``Generate`` claims it, frees on every failure path.
- ``transport.KVTransport``: how messages travel. ``grpc_transport.GrpcKVTransport`` (the
  default, ``Decode.TransferKV`` client streams), ``distributed_transport.DistributedKVTransport``
  (the same streams, the payload bytes over a ``torch.distributed`` pair group: ``pair_group``;
  decode's side is ``distributed_endpoint``; the pairs' rendezvous store is ``channel_store``
  on decode, reached from prefill over mutual-TLS gRPC by ``remote_store``), ``cuda_ipc.CudaIpcKVTransport`` (the same
  streams, the payload copied device to device out of prefill's pool mapped through CUDA IPC
  when both workers share a GPU; decode's side is ``cuda_ipc.CudaIpcEndpoint``) and
  ``transport.InProcessTransport`` (a direct call into a receiver object, for tests); all run
  the same sender and receiver state machines.
- ``checks``: what a well-formed header / chunk / commit is; ``payload``: block table <->
  payload byte ranges; ``layout``: the layout both sides must share; ``failures``: metric
  labels for failures.
"""

from __future__ import annotations

from services.engine.kv_transfer.cuda_ipc import CudaIpcEndpoint, CudaIpcKVTransport
from services.engine.kv_transfer.distributed_endpoint import ChannelHost, DistributedKVEndpoint
from services.engine.kv_transfer.distributed_transport import DistributedKVTransport
from services.engine.kv_transfer.grpc_transport import GrpcKVTransport
from services.engine.kv_transfer.lease import LeaseTable
from services.engine.kv_transfer.payload import PrefilledRequest
from services.engine.kv_transfer.receive_entry import ReceiveState
from services.engine.kv_transfer.receiver import KVReceiver
from services.engine.kv_transfer.reservations import Reservation
from services.engine.kv_transfer.sender import (
    KVSender,
    SendState,
    TransferResult,
)
from services.engine.kv_transfer.transport import (
    InProcessTransport,
    KVChannelEndpoint,
    KVEndpoint,
    KVStream,
    KVTransport,
)

__all__ = [
    "ChannelHost",
    "CudaIpcEndpoint",
    "CudaIpcKVTransport",
    "DistributedKVEndpoint",
    "DistributedKVTransport",
    "GrpcKVTransport",
    "InProcessTransport",
    "KVChannelEndpoint",
    "KVEndpoint",
    "KVReceiver",
    "KVSender",
    "KVStream",
    "KVTransport",
    "LeaseTable",
    "PrefilledRequest",
    "ReceiveState",
    "Reservation",
    "SendState",
    "TransferResult",
]
