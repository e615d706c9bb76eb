"""The CUDA IPC KV transport: a prefill and a decode worker on the same GPU hand a request's KV
over device to device (docs/kv-handoff.md).

Why: over gRPC a request's KV goes GPU -> host (read, crc32) -> 4 MiB messages through the
kernel -> host -> GPU, a few GB/s at best. Two workers on one GPU need none of that: decode maps
prefill's KV pool into its own address space through CUDA IPC once, and each transfer becomes
one gather-scatter copy inside the GPU's memory. Only the payload leaves the ``TransferKV``
stream: header, commit, ack, aborts, leases and reservations stay on it, and the sender and
receiver state machines (``sender.py``, ``receiver.py``) are the gRPC transport's own, so every
refusal, abort, expiry and failure path behaves the same.

One transfer:

  1. Offer (prefill, :class:`CudaIpcKVTransport`): the header's ``KVChannelOffer`` carries the
     GPU's uuid, the pool's IPC description (``CudaIpcPool``: what
     ``UntypedStorage._share_cuda_()`` returns for the whole pool tensor, plus its dtype and
     shape; made once per process on the engine thread, then cached) and the request's block ids
     in that pool (``source_blocks``, payload order).
  2. Admit (decode, :class:`CudaIpcEndpoint`): once the receiver checked the header and holds
     the destination blocks, decode compares the uuid with its own GPU's. Equal: it maps the
     pool (:func:`map_remote_pool`, once per prefill instance: cached by peer id, replaced when
     the instance id changes; a pool it cannot map is not tried again for that instance),
     checks the source blocks against the header and the pool, and answers ``tandem-kv-channel:
     cuda-ipc`` in the go-ahead. Otherwise (another GPU, no offer, a pool that cannot be mapped)
     it sends the plain go-ahead and this transfer's bytes travel in the chunks, as over gRPC.
  3. Transfer: prefill announces the whole payload as one chunk (``channel_bytes``, no data,
     crc32 0) and commits; it never reads its pool. Decode checks the announcement's offset,
     range and blocks like any chunk's, then its placer (:meth:`_Transfer.place`, on the engine
     thread) copies the source blocks into the held ones (:func:`copy_blocks`) and synchronizes
     the stream.
  4. Ack: decode acknowledges the commit; prefill frees its blocks (its lease ends).

Synchronisation:

  - Prefill's KV is complete before the offer leaves: the prefill worker ships a request only
    after its engine read the first token back to the host (the sampler's ``.tolist()``), which
    waits for everything queued before it on the engine's one stream, every KV write of that
    request included (prefix-cached blocks were written, and waited for, earlier). Decode's copy
    starts after the header arrived, so it reads finished KV. (The IPC event ``_share_cuda_``
    records is waited for once, when the pool is mapped; it orders nothing per transfer.)
  - Decode's copy is complete before the ack: the placer synchronizes decode's stream before
    it returns, and the ack follows the commit after it. Prefill frees the source blocks, and
    may reuse them for the next prompt, as soon as the ack arrives, so an unfinished copy would
    race that reuse.
  - A transfer prefill gives up on (abort, lease expiry) frees its blocks while decode may
    still be copying them; prefill cancels the stream, so decode's receive is cancelled too
    (the copy's result is dropped, the blocks freed), as for any transfer that fails midway.

Integrity: no crc32 on this path. The bytes never leave one GPU's memory, so there is no wire or
host buffer between the pools to corrupt them, and a checksum would read the payload back to
the host, costing more than the copy. The announcement's offset, range and block indices are
checked like any chunk's, the source blocks against the pool's size, and the pool's dtype,
shape and ref counter (torch writes to it when a mapping is dropped) before anything is mapped.

The wire carries plain fields only, never a pickle (unpickling a peer's bytes would run its
code): :func:`share_pool` and :func:`map_remote_pool` are the one place that talks to torch's
IPC primitives, so the mechanism can be swapped there. Across GPUs nothing here applies and
transfers use gRPC bytes (NCCL between GPUs is not built). A tensor-parallel worker (either
end) neither offers nor accepts the device copy: its rank 0's pool holds that rank's KV heads
only, so its transfers' bytes travel in the chunks, gathered from or scattered to its ranks
(``core/tp_kv.py``).
"""

from __future__ import annotations

import logging
import math
import re
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import torch

from services.common.errors import (
    DataLossError,
    InvalidArgumentError,
    TandemError,
    UnavailableError,
)
from services.common.pb import decode_pb2
from services.engine.core.engine import LLMEngine
from services.engine.core.kv_cache import KVPool
from services.engine.kv_transfer.pair_group import CHANNEL_KEY
from services.engine.kv_transfer.receiver import KVReceiver
from services.engine.kv_transfer.transport import (
    AcceptWithMetadata,
    KVStream,
    KVTransport,
    Metadata,
)
from services.engine.runtime.engine_loop import EngineLoop

logger = logging.getLogger(__name__)

CUDA_IPC = "cuda-ipc"
CUDA_IPC_ADVERT = (CHANNEL_KEY, CUDA_IPC)
"""The go-ahead's metadata entry saying decode copies this transfer's payload over CUDA IPC."""

REF_COUNTER_SLOTS = 10_000
"""Slots in one of torch's CUDA IPC ref-counter files (``CUDA_IPC_REF_COUNTER_FILE_SIZE``)."""
IPC_HANDLE_BYTES = 64
"""Size of a ``cudaIpcEventHandle_t`` (``CUDA_IPC_HANDLE_SIZE``)."""
_REF_COUNTER_NAME = re.compile(rb"/torch_[0-9A-Za-z_.-]{1,200}")  # at::NewProcessWideShmHandle

SharePool = Callable[[torch.Tensor], decode_pb2.CudaIpcPool]
MapPool = Callable[[decode_pb2.CudaIpcPool, torch.device], torch.Tensor]


# ----------------------------------------------------------------------------- the mechanism


def device_uuid(device: torch.device) -> str:
    """The uuid of the GPU ``device`` is ("" for a device that is not CUDA)."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def share_pool(data: torch.Tensor) -> decode_pb2.CudaIpcPool:
    """Describe the KV pool tensor ``data`` (CUDA, contiguous, at its storage's start) for
    :func:`map_remote_pool` in another process. Call once per process: each call makes a new
    IPC reference to the storage."""
    if not data.is_cuda or not data.is_contiguous() or data.storage_offset() != 0:
        raise ValueError("only a contiguous CUDA tensor at its storage's start can be shared")
    (device, handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset,
     event_handle, event_sync_required) = data.untyped_storage()._share_cuda_()  # fmt: skip
    return decode_pb2.CudaIpcPool(
        device=device, handle=handle, storage_size_bytes=size_bytes,
        storage_offset_bytes=offset_bytes, ref_counter_handle=ref_counter_handle,
        ref_counter_offset=ref_counter_offset, event_handle=event_handle or b"",
        event_sync_required=bool(event_sync_required),
        dtype=str(data.dtype).removeprefix("torch."), shape=list(data.shape),
    )  # fmt: skip


def map_remote_pool(pool: decode_pb2.CudaIpcPool, device: torch.device) -> torch.Tensor:
    """Map another process's pool (described by :func:`share_pool`, checked by
    :func:`pool_problem`) on ``device``, the same GPU as this process sees it: a tensor view of
    the pool's shape over the mapped storage. Dropping the tensor unmaps it.

    The storage is opened with this process's index for the GPU, not the prefill's
    (``pool.device``): the two processes may see different device lists.
    """
    torch.cuda._lazy_init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    storage = torch.UntypedStorage._new_shared_cuda(
        index, pool.handle, pool.storage_size_bytes, pool.storage_offset_bytes,
        pool.ref_counter_handle, pool.ref_counter_offset, pool.event_handle,
        pool.event_sync_required,
    )  # fmt: skip
    view = torch.empty(0, dtype=getattr(torch, pool.dtype), device=torch.device("cuda", index))
    return view.set_(storage, 0, tuple(pool.shape))


def pool_problem(pool: decode_pb2.CudaIpcPool, kv: KVPool) -> str:
    """Why ``pool`` cannot be mapped as a pool of ``kv``'s layout ("" when it can).

    Besides the layout, the ref counter is checked: when the mapping is dropped, torch
    decrements the int64 at ``ref_counter_offset`` of the shared-memory file it names, without
    bounds checks of its own.
    """
    shape, own = tuple(pool.shape), tuple(kv.data.shape)
    if pool.dtype != kv.layout.dtype:
        return f"its dtype {pool.dtype!r} is not {kv.layout.dtype!r}"
    if len(shape) != len(own) or shape[1:] != own[1:] or shape[0] < 1:
        return f"its shape {list(shape)} does not hold blocks of {list(own[1:])}"
    if not pool.handle or math.prod(shape) * kv.data.element_size() > pool.storage_size_bytes:
        return "its storage is smaller than its shape"
    if (pool.ref_counter_offset >= REF_COUNTER_SLOTS
            or not _REF_COUNTER_NAME.fullmatch(pool.ref_counter_handle)):  # fmt: skip
        return "its ref counter is not one torch makes"
    if pool.event_sync_required and len(pool.event_handle) != IPC_HANDLE_BYTES:
        return "its event handle is malformed"
    return ""


def copy_blocks(
    source: torch.Tensor, dest: torch.Tensor, source_ids: Sequence[int], dest_ids: Sequence[int]
) -> None:
    """``dest[dest_ids[i]] = source[source_ids[i]]`` for every ``i``: one gather and one scatter
    along the block dimension, on the tensors' device (asynchronous on CUDA). Copied as bytes:
    PyTorch has no ``index_copy_`` for float8 (an ``fp8`` pool), and bytes are what a block is."""
    source_index = torch.tensor(source_ids, dtype=torch.long, device=source.device)
    dest_index = torch.tensor(dest_ids, dtype=torch.long, device=dest.device)
    dest_bytes, source_bytes = dest.view(torch.uint8), source.view(torch.uint8)
    dest_bytes.index_copy_(0, dest_index, source_bytes.index_select(0, source_index))


def has_cuda_ipc_advert(metadata: Sequence[tuple[str, str | bytes]]) -> bool:
    """Whether a go-ahead's metadata agrees to copy the payload over CUDA IPC."""
    for key, value in metadata:
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        if key == CHANNEL_KEY and text == CUDA_IPC:
            return True
    return False


# ----------------------------------------------------------------------------- prefill side


class CudaIpcKVTransport(KVTransport):
    """Opens ``TransferKV`` streams whose header offers the pool over CUDA IPC (prefill side)."""

    name = CUDA_IPC

    def __init__(
        self,
        engine_loop: EngineLoop,
        *,
        peer_id: str,
        inner: KVTransport,
        gpu_uuid: str | None = None,
        share: SharePool | None = None,
    ) -> None:
        """``peer_id``: this worker's id (decode keys its mappings by it); ``inner``: what
        carries the messages (default gRPC); ``gpu_uuid`` / ``share``: the GPU's uuid and
        :func:`share_pool` (tests put fakes here)."""
        self.engine_loop = engine_loop
        self.instance = secrets.token_hex(4)
        self.peer_id = peer_id or f"prefill-{self.instance}"
        self.inner = inner
        device = engine_loop.engine.kv.data.device
        self.device = str(device)
        self.gpu_uuid = device_uuid(device) if gpu_uuid is None else gpu_uuid
        self._share = share or share_pool
        self._pool: decode_pb2.CudaIpcPool | None = None
        # a CPU pool is never offered, nor a tensor-parallel rank 0's (it holds its own KV heads
        # only: a split worker's hand-off gathers every rank's heads, core/tp_kv.py)
        self._unavailable = not self.gpu_uuid or engine_loop.engine.loaded.sharding is not None

    def open(self, address: str) -> KVStream:
        return CudaIpcKVStream(self, self.inner.open(address))

    async def close(self) -> None:
        await self.inner.close()

    async def offer(self, request_id: str) -> decode_pb2.KVChannelOffer | None:
        """The header's offer for ``request_id`` (its held blocks); None when the pool cannot be
        shared (then every transfer's bytes travel over gRPC)."""
        if self._unavailable:
            return None
        loop = self.engine_loop

        def describe(engine: LLMEngine) -> tuple[decode_pb2.CudaIpcPool, list[int]]:
            if self._pool is None:
                self._pool = self._share(engine.kv.data)
            return self._pool, list(loop.held_blocks(request_id))

        try:
            pool, blocks = await loop.call(describe)
        except TandemError:
            raise  # the request's blocks are gone (aborted), or the engine is stopping
        except Exception as err:  # noqa: BLE001 - torch refused to share: gRPC from now on
            self._unavailable = True
            logger.warning("the KV pool cannot be shared over CUDA IPC (%s); KV travels over "
                           "gRPC", err)  # fmt: skip
            return None
        return decode_pb2.KVChannelOffer(
            peer_id=self.peer_id, peer_instance=self.instance, device=self.device,
            gpu_uuid=self.gpu_uuid, cuda_ipc=pool, source_blocks=blocks,
        )  # fmt: skip


class CudaIpcKVStream(KVStream):
    """A ``TransferKV`` stream whose payload decode copies on the device once it agreed."""

    def __init__(self, transport: CudaIpcKVTransport, inner: KVStream) -> None:
        self._transport = transport
        self._inner = inner
        self._offered = False
        self._on_device = False

    @property
    def payload_on_device(self) -> bool:
        return self._on_device

    async def write(self, message: decode_pb2.KVTransferMessage) -> bool:
        if message.WhichOneof("kind") == "header":
            offer = await self._transport.offer(message.header.request_id)
            if offer is not None:
                header = decode_pb2.KVHeader()
                header.CopyFrom(message.header)
                header.channel.CopyFrom(offer)
                message = decode_pb2.KVTransferMessage(header=header)
                self._offered = True
        return await self._inner.write(message)

    async def accepted(self) -> bool:
        if not await self._inner.accepted():
            return False
        self.go_ahead = self._inner.go_ahead
        self._on_device = self._offered and has_cuda_ipc_advert(self.go_ahead)
        return True

    async def finish(self) -> decode_pb2.KVTransferAck:
        return await self._inner.finish()

    def cancel(self) -> None:
        self._inner.cancel()


# ----------------------------------------------------------------------------- decode side


@dataclass(slots=True)
class _Peer:
    """One prefill worker's pool as this worker mapped it (None: it could not be)."""

    instance: str
    pool: torch.Tensor | None


class CudaIpcEndpoint:
    """Runs ``TransferKV`` streams into a :class:`KVReceiver`, copying the payload out of the
    prefill worker's mapped pool when both are on this GPU (decode side)."""

    def __init__(
        self, receiver: KVReceiver, *, gpu_uuid: str | None = None, map_pool: MapPool | None = None
    ) -> None:
        """``gpu_uuid`` / ``map_pool``: this GPU's uuid and :func:`map_remote_pool` (tests put
        fakes here)."""
        self.receiver = receiver
        self.engine_loop = receiver.engine_loop
        kv = self.engine_loop.engine.kv
        self.gpu_uuid = device_uuid(kv.data.device) if gpu_uuid is None else gpu_uuid
        # a tensor-parallel rank 0's pool holds its own KV heads only: its ranks take a
        # hand-off's blocks through the scatter of core/tp_kv.py, so never a device copy
        self.split = self.engine_loop.engine.loaded.sharding is not None
        self._map = map_pool or map_remote_pool
        self._peers: dict[str, _Peer] = {}
        self._elsewhere: set[str] = set()  # prefill workers seen on another GPU (logged once)
        self.num_mapped = 0

    def close(self) -> None:
        """Drop every mapping (transfers in flight keep theirs until they end)."""
        self._peers.clear()

    def pool(self, peer_id: str) -> torch.Tensor | None:
        """The mapped pool of prefill worker ``peer_id`` (None: none)."""
        peer = self._peers.get(peer_id)
        return None if peer is None else peer.pool

    async def receive(
        self,
        messages: AsyncIterator[decode_pb2.KVTransferMessage],
        on_accept: AcceptWithMetadata,
        caller: str = "",
    ) -> decode_pb2.KVTransferAck:
        """Like ``KVReceiver.receive``; ``on_accept(metadata)`` sends the go-ahead, with the
        CUDA IPC advert when this transfer's payload is copied on the device (``caller`` is not
        needed: the pool handle travels on this authenticated stream)."""
        transfer = _Transfer(self)

        async def accept() -> None:
            await on_accept(await transfer.admit())

        return await self.receiver.receive(transfer.messages(messages), accept,
                                           placer=transfer.place)  # fmt: skip

    def on_this_gpu(self, offer: decode_pb2.KVChannelOffer) -> bool:
        """Whether ``offer`` is a CUDA IPC offer from a worker on this GPU."""
        if not offer.HasField("cuda_ipc") or self.split:
            return False
        if self.gpu_uuid and offer.gpu_uuid == self.gpu_uuid:
            return True
        if offer.peer_id not in self._elsewhere:
            self._elsewhere.add(offer.peer_id)
            logger.info("prefill %s is on another GPU (%s, this one %s): its KV travels over gRPC",
                        offer.peer_id, offer.gpu_uuid or "none", self.gpu_uuid or "none")
        return False

    async def mapped_pool(self, offer: decode_pb2.KVChannelOffer) -> torch.Tensor | None:
        """The offering worker's pool, mapped on first use per instance; None when it cannot
        be (then not tried again for that instance)."""
        peer = self._peers.get(offer.peer_id)
        if peer is not None and peer.instance == offer.peer_instance:
            return peer.pool
        if peer is not None:
            logger.info("prefill %s restarted: dropping the mapping of its old KV pool",
                        offer.peer_id)
        kv = self.engine_loop.engine.kv
        pool: torch.Tensor | None = None
        problem = pool_problem(offer.cuda_ipc, kv)
        if not problem:
            description = offer.cuda_ipc
            try:
                pool = await self.engine_loop.call(
                    lambda engine: self._map(description, kv.data.device))
            except TandemError:
                raise  # the engine is stopping
            except Exception as err:  # noqa: BLE001 - e.g. another IPC namespace
                problem = f"mapping it failed: {err}"
        if problem:
            logger.warning("not mapping the KV pool of prefill %s over CUDA IPC: %s; its KV "
                           "travels over gRPC", offer.peer_id, problem)  # fmt: skip
        current = self._peers.get(offer.peer_id)
        if current is not None and current.instance == offer.peer_instance:
            return current.pool  # a concurrent transfer got there first
        if pool is not None:
            self.num_mapped += 1
        self._peers[offer.peer_id] = _Peer(offer.peer_instance, pool)
        return pool


class _Transfer:
    """One stream's view of CUDA IPC: the header, and the pool and source blocks once agreed."""

    def __init__(self, endpoint: CudaIpcEndpoint) -> None:
        self.endpoint = endpoint
        self.header: decode_pb2.KVHeader | None = None
        self.pool: torch.Tensor | None = None
        self.source: list[int] = []

    async def messages(
        self, messages: AsyncIterator[decode_pb2.KVTransferMessage]
    ) -> AsyncIterator[decode_pb2.KVTransferMessage]:
        async for message in messages:
            if self.header is None and message.WhichOneof("kind") == "header":
                self.header = message.header
            yield message

    async def admit(self) -> Metadata:
        """The go-ahead's metadata (after the receiver checked the header and holds the
        blocks): the advert when the payload is copied on the device, else nothing.

        Raises:
            InvalidArgumentError: the offer's source blocks disagree with the header or lie
                outside the pool.
        """
        header = self.header
        if header is None or not header.HasField("channel"):
            return ()
        offer = header.channel
        if not self.endpoint.on_this_gpu(offer):
            return ()
        pool = await self.endpoint.mapped_pool(offer)
        if pool is None:
            return ()
        source = list(offer.source_blocks)
        if len(source) != header.num_blocks or any(b >= pool.shape[0] for b in source):
            raise InvalidArgumentError(
                f"the CUDA IPC offer names {len(source)} source blocks for {header.num_blocks} "
                f"(a pool of {pool.shape[0]})", param="source_blocks")
        self.pool, self.source = pool, source
        return (CUDA_IPC_ADVERT,)

    def place(self, kv: KVPool, block_ids: list[int], offset: int, length: int) -> None:
        """The receiver's placer (``receiver.Placer``; engine thread): copy the source blocks of
        payload bytes ``[offset, offset + length)`` into ``block_ids`` and wait for the copy."""
        if self.pool is None:
            raise DataLossError("a KV chunk came over a channel this transfer did not agree on")
        block_bytes = kv.layout.block_bytes
        if offset % block_bytes or length % block_bytes:
            raise DataLossError(f"a CUDA IPC chunk at offset {offset} does not cover whole blocks")
        first, count = offset // block_bytes, length // block_bytes
        if first + count > min(len(block_ids), len(self.source)):
            raise DataLossError(f"a CUDA IPC chunk at offset {offset} overruns the blocks")
        try:
            copy_blocks(self.pool, kv.data, self.source[first : first + count],
                        block_ids[first : first + count])  # fmt: skip
            if kv.data.is_cuda:  # the ack lets prefill free (and reuse) the source blocks
                torch.cuda.current_stream(kv.data.device).synchronize()
        except RuntimeError as err:  # a CUDA error: the transfer fails like a broken stream
            raise UnavailableError(f"the CUDA IPC copy of the KV failed: {err}") from err
