"""The distributed KV transport (prefill side): block payloads over a ``torch.distributed`` pair
group, everything else over the ``Decode.TransferKV`` stream (docs/kv-handoff.md).

Only the payload bytes move over the collective channel, sealed (AES-256-GCM under a key made
for each transfer and sent in the header's offer: ``payload_seal.py``): the header, each piece's
crc32, offset and seal tag, the commit, the ack, aborts and the lease stay on gRPC, so the sender and receiver state
machines (``sender.py``, ``receiver.py``) are the very ones the gRPC transport runs, and every
refusal, corruption, abort and expiry path behaves the same. CPU workers use Gloo, so CI runs
the same code a GPU deployment would (NCCL when both ends' tensors are CUDA: ``pair_group.py``).

Pair set-up (one group per prefill–decode pair, no global world):

  1. Rendezvous: every decode worker started with ``--kv-transport distributed`` hosts the
     pairs' rendezvous store in-process (``channel_store.py``), served as the ``Decode.KVStore``
     RPC on its own mutual-TLS gRPC server: only a prefill certificate may call it, and a
     group's namespace answers only the peer the group was advertised to. No port of its own,
     and nothing is set up at start. (It was a ``TCPStore``, which anyone who reached its port
     could read and write.)
  2. Offer: a prefill worker configured the same way puts a ``KVChannelOffer`` in each header
     (its id, a random instance id, its tensors' device, the last group it retired with that
     decode worker).
  3. Go-ahead: a decode worker that hosts a channel answers the offer in its go-ahead (initial
     metadata ``tandem-kv-channel: <backend> grpc <group> <tag>``): the pair's current group,
     or a new one (keyed ``<decode instance>.<n>``, never reused, its store namespace opened
     for this caller) that it starts building as rank 1 — lazily, on the pair's first
     transfer. A worker without a channel (``--kv-transport grpc``) sends the plain go-ahead,
     and the transfer stays on gRPC.
  4. Join: prefill builds its side as rank 0 (a :class:`~remote_store.RemoteStore` of the
     group's namespace, calling ``Decode.KVStore`` over the channel this transfer uses, a
     ``PrefixStore`` of the group's key, a 2-rank Gloo group) or reuses the group it holds
     under that key; later transfers of the pair reuse it. If it cannot (timeout, a refused
     store call, an unbuilt backend, an advert naming a ``host:port`` store: an older decode
     worker's unauthenticated ``TCPStore``, never joined), this transfer's chunks carry their
     data on gRPC as usual and the pair is not offered again for :data:`RETRY_SECONDS`.
  5. Transfer: each chunk is announced on gRPC (``KVChunk`` with its crc32, offset and blocks,
     no data, ``channel_bytes`` set), then its bytes are sent with the transfer's tag; decode
     receives them, fills them into the chunk and hands it to the unchanged receiver (crc32
     check, ``payload.write_payload`` on its engine thread, commit, ack).
  6. Tear-down: a group whose op failed or was abandoned (peer gone, timeout, a transfer
     cancelled mid-piece), or whose transfer's call ended unavailable (the peer died between
     pieces), is retired on the side that saw it; the other side learns it from the
     transfer failing too, or — decode — from the next offer's ``retired_group``, or —
     prefill — from a go-ahead naming another group. A new instance id (prefill restarted)
     retires decode's group of that peer; a new group key (decode restarted) retires prefill's.
     A retired group is dropped when the transfers holding it end, which closes its
     connections; the next transfer builds a fresh one (back to step 3).

Both sides key their groups by peer: prefill by decode address, decode by prefill id, so a
prefill worker talks to many decode workers and back, one group per pair.

Ops never run on the event loop or the engine thread: each is a thread of its own. The lease
reaper (prefill) and the stall reaper (decode) end a transfer whose piece does not move and free
its blocks on time, as with gRPC; the thread's own bound (``op_timeout``, twice the lease or the
stall timeout) is a backstop, and an abandoned piece's thread ends when the op completes, times
out, or the peer drops the group.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from dataclasses import dataclass, field

from services.common.errors import UnavailableError
from services.common.pb import decode_pb2
from services.engine.kv_transfer.grpc_transport import GrpcKVStream, GrpcKVTransport
from services.engine.kv_transfer.payload_seal import new_key, seal
from services.engine.kv_transfer.pair_group import (
    BUILT_BACKENDS,
    PREFILL_RANK,
    SETUP_TIMEOUT_SECONDS,
    ChannelAdvert,
    STORE_OVER_GRPC,
    PairGroup,
)
from services.engine.kv_transfer.remote_store import RemoteStore
from services.engine.kv_transfer.transport import KVStream, KVTransport

logger = logging.getLogger(__name__)

RETRY_SECONDS = 30.0
"""How long a decode worker is not offered the channel after a pair set-up failed."""


@dataclass(slots=True)
class _Decode:
    """Prefill's view of one decode worker: its current group and what was retired."""

    pair: PairGroup | None = None
    retired: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=16))
    retry_after: float = 0.0


class DistributedKVTransport(KVTransport):
    """Opens ``TransferKV`` streams whose payload moves over pair groups when decode agrees."""

    name = "distributed"

    def __init__(
        self,
        *,
        peer_id: str,
        host: str | None,
        op_timeout: float,
        setup_timeout: float = SETUP_TIMEOUT_SECONDS,
        grpc: GrpcKVTransport,
    ) -> None:
        """``peer_id``: this worker's id; ``host``: where decode reaches this worker (None: the
        machine's name); ``op_timeout``: longest wait for one piece."""
        self.instance = secrets.token_hex(4)
        self.peer_id = peer_id or f"prefill-{self.instance}"  # decode keys its groups by it
        self.host = host
        self.op_timeout = op_timeout
        self.setup_timeout = setup_timeout
        self.device = "cpu"  # the payload travels as host bytes (payload.py)
        self.grpc = grpc
        self.num_built = 0
        self._decodes: dict[str, _Decode] = {}

    def open(self, address: str) -> KVStream:
        return DistributedKVStream(self, address, self.grpc.open(address))

    async def close(self) -> None:
        for decode in self._decodes.values():
            if decode.pair is not None:
                decode.pair.retire("the prefill worker is stopping")
        self._decodes.clear()
        await self.grpc.close()

    def group(self, address: str) -> PairGroup | None:
        """The group in service with the decode worker at ``address`` (None: none yet)."""
        decode = self._decodes.get(address)
        return None if decode is None else decode.pair

    # ------------------------------------------------------------------ negotiation
    def offer(self, address: str) -> decode_pb2.KVChannelOffer | None:
        """The header's offer to ``address``; None while a failed set-up is being waited out."""
        decode = self._decodes.setdefault(address, _Decode())
        if decode.pair is not None and decode.pair.broken:
            self._retire(decode, "an op failed or was abandoned")
        if time.monotonic() < decode.retry_after:
            return None
        return decode_pb2.KVChannelOffer(
            peer_id=self.peer_id, peer_instance=self.instance, device=self.device,
            retired_group=decode.retired[-1] if decode.retired else "",
        )  # fmt: skip

    async def join(self, address: str, advert: ChannelAdvert) -> PairGroup | None:
        """The group ``advert`` names, built (or reused) and held for one transfer (the caller
        releases it); None when it cannot be had: the transfer then stays on gRPC."""
        decode = self._decodes.setdefault(address, _Decode())
        if advert.backend not in BUILT_BACKENDS or advert.store != STORE_OVER_GRPC:
            logger.warning("decode %s advertised a %s KV channel with its store at %r, which this "
                           "build does not join (only %s backends, store over mutual-TLS gRPC)",
                           address, advert.backend, advert.store,
                           "/".join(BUILT_BACKENDS))  # fmt: skip
            decode.retry_after = time.monotonic() + RETRY_SECONDS
            return None
        if decode.pair is not None and decode.pair.broken:
            self._retire(decode, "an op failed or was abandoned")
        if advert.group in decode.retired:
            return None  # an advert from before decode learned we retired it: gRPC this time
        pair = decode.pair
        if pair is None or pair.key != advert.group:
            if pair is not None:
                self._retire(decode, f"decode {address} moved to group {advert.group}")
            pair = PairGroup(advert.group, PREFILL_RANK, advert.backend,
                             op_timeout=self.op_timeout)  # fmt: skip
            store = self._store(address, advert.group)
            pair.build(lambda: store, host=self.host, timeout=self.setup_timeout)
            decode.pair = pair
            self.num_built += 1
        pair.acquire()
        try:
            await pair.ready()
        except UnavailableError as err:
            pair.release()
            if decode.pair is pair:  # its set-up failed (not: another transfer moved on)
                self._retire(decode, err.message)
                decode.retry_after = time.monotonic() + RETRY_SECONDS
                logger.warning("KV channel to %s unavailable, using gRPC for %gs: %s", address,
                               RETRY_SECONDS, err.message)  # fmt: skip
            return None
        except BaseException:
            pair.release()
            raise
        return pair

    def retire_broken(self, address: str, pair: PairGroup) -> None:
        """Take a group whose op failed or was abandoned out of service at once."""
        decode = self._decodes.get(address)
        if decode is not None and decode.pair is pair:
            self._retire(decode, "an op failed or was abandoned")

    def _retire(self, decode: _Decode, reason: str) -> None:
        if decode.pair is not None:
            decode.pair.retire(reason)
            decode.retired.append(decode.pair.key)
            decode.pair = None

    def _store(self, address: str, group: str) -> RemoteStore:
        """``group``'s namespace of the rendezvous store of the decode worker at ``address``,
        over this transport's mutual-TLS channel to it (made on the event loop; its ops run on
        the group's set-up thread)."""
        stub = self.grpc.stub(address)

        async def call(request: decode_pb2.KVStoreRequest,
                       deadline: float) -> decode_pb2.KVStoreResponse:  # fmt: skip
            return await stub.KVStore(request, timeout=deadline)

        return RemoteStore(call, group, asyncio.get_running_loop(), self.setup_timeout)


class DistributedKVStream(KVStream):
    """A ``TransferKV`` stream whose chunks' bytes go over the pair group once decode agreed."""

    def __init__(
        self, transport: DistributedKVTransport, address: str, inner: GrpcKVStream
    ) -> None:
        self._transport = transport
        self._address = address
        self._inner = inner
        self._pair: PairGroup | None = None
        self._tag = 0
        self._key = b""  # this transfer's payload key, made with the header's offer

    @property
    def pair(self) -> PairGroup | None:
        """The group this transfer's payload uses (None: gRPC)."""
        return self._pair

    async def write(self, message: decode_pb2.KVTransferMessage) -> bool:
        kind = message.WhichOneof("kind")
        if kind == "header":
            offer = self._transport.offer(self._address)
            if offer is not None:
                self._key = offer.payload_key = new_key()  # this transfer's (payload_seal.py)
                header = decode_pb2.KVHeader()
                header.CopyFrom(message.header)
                header.channel.CopyFrom(offer)
                message = decode_pb2.KVTransferMessage(header=header)
        elif kind == "chunk" and self._pair is not None:
            return await self._send_piece(self._pair, message.chunk)
        return await self._inner.write(message)

    async def _send_piece(self, pair: PairGroup, chunk: decode_pb2.KVChunk) -> bool:
        sealed, tag = seal(self._key, chunk.offset, chunk.data)
        announce = decode_pb2.KVChunk(
            first_block=chunk.first_block, num_blocks=chunk.num_blocks, crc32=chunk.crc32,
            offset=chunk.offset, channel_bytes=len(chunk.data), seal_tag=tag,
        )  # fmt: skip
        try:
            if not await self._inner.write(decode_pb2.KVTransferMessage(chunk=announce)):
                return False  # the receiver ended the call: nothing was announced
            await pair.send(sealed, self._tag)
        except BaseException:  # announced, maybe, and not sent: decode may wait for it
            pair.broken = True
            raise
        return True

    async def accepted(self) -> bool:
        if not await self._inner.accepted():
            return False
        advert = ChannelAdvert.from_metadata(self._inner.go_ahead)
        if advert is not None:
            self._pair = await self._transport.join(self._address, advert)
            self._tag = advert.tag
        return True

    async def finish(self) -> decode_pb2.KVTransferAck:
        try:
            return await self._inner.finish()
        except UnavailableError:
            # The call died under the transfer (its peer gone or unreachable), maybe between a
            # piece's announcement and its send: whether decode posted its receives is not known,
            # so the group is not trusted for another transfer (rebuilding it is cheap).
            if self._pair is not None:
                self._pair.broken = True
            raise
        finally:
            self._release()

    def cancel(self) -> None:
        self._inner.cancel()
        self._release()

    def _release(self) -> None:
        pair, self._pair = self._pair, None
        if pair is not None:
            pair.release()
            if pair.broken:  # out of service now: dropping it fails the peer's pending ops
                self._transport.retire_broken(self._address, pair)
