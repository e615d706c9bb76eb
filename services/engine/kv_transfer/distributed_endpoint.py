"""The distributed KV transport (decode side): host the pairs' rendezvous store and receive
payload pieces over pair groups, for an unchanged :class:`~receiver.KVReceiver`.

The pair set-up and the wire are in ``distributed_transport.py``'s docstring; this side's part:

  1. :class:`ChannelHost` (one per decode worker with ``--kv-transport distributed``) hosts the
     pairs' rendezvous store (``channel_store.ChannelStore``, served to prefill by the
     ``Decode.KVStore`` RPC on this worker's mutual-TLS gRPC server: no port of its own) and
     keeps one :class:`PairGroup` per prefill worker (keyed by its id), built lazily when that
     worker's first offer arrives; the group's store namespace answers only the peer (host and
     certificate) whose ``TransferKV`` call it was advertised on.
  2. :class:`DistributedKVEndpoint.receive` runs one ``TransferKV`` stream: it reads the header's
     offer, and when the receiver gives its go-ahead (blocks allocated), admits the pair and
     adds the advert (group, tag) to the go-ahead's metadata.
  3. Each announced chunk (``channel_bytes``, no data) is received over the group, unsealed with
     the header's payload key (``payload_seal.py``: a changed piece is DATA_LOSS) and handed to
     the receiver with its data filled in, so the crc32, contiguity and commit checks, the
     writes into the blocks, the drain after a failure and every cleanup path are the
     receiver's own. A piece larger than what the header left is DATA_LOSS before anything is
     allocated for it.
  4. A piece that fails or is abandoned (stream cancelled, stall reaper), or a transfer that
     ends before its commit went through (prefill may be sending a piece nobody will take),
     breaks the group: it is retired at once, and the next offer from that worker gets a new
     one. An offer with a new instance id (the prefill worker restarted) or naming the current
     group as retired does too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.common.errors import DataLossError
from services.common.pb import decode_pb2
from services.engine.kv_transfer.channel_store import ChannelStore
from services.engine.kv_transfer.transport import AcceptWithMetadata, Metadata
from services.engine.kv_transfer.pair_group import (
    BUILT_BACKENDS,
    DECODE_RANK,
    SETUP_TIMEOUT_SECONDS,
    STORE_OVER_GRPC,
    ChannelAdvert,
    PairGroup,
    pair_backend,
)
from services.engine.kv_transfer.payload_seal import unseal
from services.engine.kv_transfer.receiver import DRAIN_SECONDS, KVReceiver

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Peer:
    instance: str
    pair: PairGroup
    owner: str  # the peer identity the group's store namespace answers


class ChannelHost:
    """The decode worker's rendezvous store and its pair groups, one per prefill worker."""

    def __init__(
        self,
        *,
        host: str | None = None,
        op_timeout: float,
        setup_timeout: float = SETUP_TIMEOUT_SECONDS,
    ) -> None:
        """``host``: the interface Gloo's pair connections use on this worker (None: the
        machine's name); ``op_timeout``: longest wait for one piece."""
        self.host = host
        self.op_timeout = op_timeout
        self.setup_timeout = setup_timeout
        self.device = "cpu"  # pieces are received as host bytes (payload.py)
        self.instance = secrets.token_hex(4)
        self.store = ChannelStore(max_wait=setup_timeout)
        self.num_built = 0
        self._numbers = itertools.count(1)
        self._open = True
        self._peers: dict[str, _Peer] = {}
        self._refused: set[str] = set()

    def close(self) -> None:
        self._open = False
        for peer in self._peers.values():
            peer.pair.retire("the decode worker is stopping")
        self._peers.clear()
        self.store.close_all()

    def retire_broken(self, pair: PairGroup) -> None:
        """Take a group whose op failed or was abandoned out of service at once."""
        for peer_id, peer in list(self._peers.items()):
            if peer.pair is pair:
                self._retire(peer_id, "an op failed or was abandoned")

    def _retire(self, peer_id: str, reason: str) -> None:
        peer = self._peers.pop(peer_id)
        peer.pair.retire(reason)
        self.store.close(peer.pair.key)  # its rendezvous keys go with it

    def group(self, peer_id: str) -> PairGroup | None:
        """The group in service with prefill worker ``peer_id`` (None: none)."""
        peer = self._peers.get(peer_id)
        return None if peer is None else peer.pair

    def admit(
        self, offer: decode_pb2.KVChannelOffer, caller: str
    ) -> tuple[PairGroup, ChannelAdvert] | None:
        """The pair group one transfer from ``offer``'s worker uses (held: the caller releases
        it) and the advert for its go-ahead; None when this pair cannot have a channel.
        ``caller``: the ``TransferKV`` peer's identity, the only one a new group's store
        namespace answers."""
        if not self._open or not offer.peer_id or offer.HasField("cuda_ipc"):
            return None  # stopping, or a CUDA IPC offer (cuda_ipc.py): no pair group for it
        backend = pair_backend(self.device, offer.device or "cpu")
        if backend not in BUILT_BACKENDS:
            if offer.peer_id not in self._refused:
                self._refused.add(offer.peer_id)
                logger.warning("%s KV channels are not built yet; %s sends KV over gRPC",
                               backend, offer.peer_id)  # fmt: skip
            return None
        peer = self._peers.get(offer.peer_id)
        if peer is not None:
            reason = ("the prefill worker restarted" if peer.instance != offer.peer_instance
                      else "prefill retired it" if peer.pair.key == offer.retired_group
                      else "an op failed or was abandoned" if peer.pair.broken
                      else "another peer claims this prefill worker's id" if peer.owner != caller
                      else "")  # fmt: skip
            if reason:
                self._retire(offer.peer_id, reason)
                peer = None
        if peer is None:
            pair = PairGroup(f"{self.instance}.{next(self._numbers)}", DECODE_RANK, backend,
                             op_timeout=self.op_timeout)  # fmt: skip
            store = self.store.open(pair.key, caller)
            pair.build(lambda: store, host=self.host, timeout=self.setup_timeout)
            peer = self._peers[offer.peer_id] = _Peer(offer.peer_instance, pair, caller)
            self.num_built += 1
        peer.pair.acquire()
        advert = ChannelAdvert(backend, STORE_OVER_GRPC, peer.pair.key, peer.pair.next_tag())
        return peer.pair, advert


class DistributedKVEndpoint:
    """Runs ``TransferKV`` streams into a :class:`KVReceiver`, their payload over pair groups."""

    def __init__(self, receiver: KVReceiver, host: ChannelHost) -> None:
        self.receiver = receiver
        self.host = host

    def close(self) -> None:
        """Retire the channel's groups and drop their store namespaces."""
        self.host.close()

    async def receive(
        self,
        messages: AsyncIterator[decode_pb2.KVTransferMessage],
        on_accept: AcceptWithMetadata,
        caller: str = "",
    ) -> decode_pb2.KVTransferAck:
        """Like ``KVReceiver.receive``; ``on_accept(metadata)`` sends the go-ahead with the
        channel advert (if any) in its metadata; ``caller``: the peer's identity."""
        transfer = _Transfer(self.host, caller)
        pieces = transfer.messages(messages)

        async def accept() -> None:
            await on_accept(transfer.admit())

        try:
            return await self.receiver.receive(pieces, accept)
        finally:
            await pieces.aclose()
            transfer.release()


class _Transfer:
    """One stream's view of the channel: the offer, the admitted pair and tag, bytes so far."""

    def __init__(self, host: ChannelHost, caller: str = "") -> None:
        self.host = host
        self.caller = caller
        self.offer: decode_pb2.KVChannelOffer | None = None
        self.total_bytes = 0
        self.received = 0
        self.pair: PairGroup | None = None
        self.tag = 0
        self.key = b""  # the header's payload key (payload_seal.py)
        self.finished = False  # the commit (or the stream's end) went through

    def admit(self) -> Metadata:
        if self.offer is None:
            return ()
        admitted = self.host.admit(self.offer, self.caller)
        if admitted is None:
            return ()
        self.pair, advert = admitted
        self.tag = advert.tag
        return (advert.metadata(),)

    def release(self) -> None:
        pair, self.pair = self.pair, None
        if pair is None:
            return
        if not self.finished:  # ended mid-stream: prefill may be sending a piece nobody takes
            pair.broken = True
        pair.release()
        if pair.broken:  # out of service now: dropping it fails the peer's pending ops
            self.host.retire_broken(pair)

    async def messages(
        self, messages: AsyncIterator[decode_pb2.KVTransferMessage]
    ) -> AsyncIterator[decode_pb2.KVTransferMessage]:
        async for message in messages:
            kind = message.WhichOneof("kind")
            if kind == "header":
                self.total_bytes = message.header.total_bytes
                if message.header.HasField("channel"):
                    self.offer = message.header.channel
                    self.key = self.offer.payload_key
            elif kind == "chunk":
                if message.chunk.channel_bytes:
                    try:
                        message = await self._fill(message.chunk)
                    except SealBroken:
                        await self._take_the_rest(messages)  # the sender is not left hanging
                        raise
                self.received += len(message.chunk.data)
            elif kind == "commit":
                self.finished = True
            yield message
        self.finished = True

    async def _fill(self, chunk: decode_pb2.KVChunk) -> decode_pb2.KVTransferMessage:
        """Receive an announced chunk's bytes; the chunk with its data filled in."""
        if self.pair is None:
            raise DataLossError("a KV chunk came over a channel this transfer did not agree on")
        if chunk.channel_bytes > self.total_bytes - self.received:
            self.pair.broken = True  # its bytes are on their way and will not be taken
            raise DataLossError(f"KV chunk of {chunk.channel_bytes} bytes overruns the payload")
        sealed = await self.pair.recv(chunk.channel_bytes, self.tag)
        try:
            data = unseal(self.key, chunk.offset, sealed, chunk.seal_tag)
        except DataLossError as err:
            raise SealBroken(err.message, code=err.code) from None
        filled = decode_pb2.KVChunk(first_block=chunk.first_block, num_blocks=chunk.num_blocks,
                                    data=data, crc32=chunk.crc32, offset=chunk.offset)
        return decode_pb2.KVTransferMessage(chunk=filled)

    async def _take_the_rest(self, messages: AsyncIterator[decode_pb2.KVTransferMessage]) -> None:
        """After a piece failed its seal: receive (and drop) the pieces the sender still sends,
        up to its commit, so that its sends complete and it reads the refusal (DATA_LOSS) instead
        of a broken channel; the group stays usable. Bounded by ``DRAIN_SECONDS``."""
        assert self.pair is not None
        with contextlib.suppress(Exception):
            async with asyncio.timeout(DRAIN_SECONDS):
                async for message in messages:
                    kind = message.WhichOneof("kind")
                    if kind == "chunk" and message.chunk.channel_bytes:
                        if message.chunk.channel_bytes > self.total_bytes - self.received:
                            break
                        await self.pair.recv(message.chunk.channel_bytes, self.tag)
                        self.received += message.chunk.channel_bytes
                    elif kind == "commit":
                        self.finished = True
                        break


class SealBroken(DataLossError):
    """A piece failed its seal (changed on the channel): DATA_LOSS, after the rest is taken."""
