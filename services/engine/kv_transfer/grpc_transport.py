"""The default KV transport: a ``Decode.TransferKV`` client stream over gRPC (docs/kv-handoff.md).

Works everywhere (CPU included). Each chunk carries at most ``MAX_KV_CHUNK_BYTES`` (4 MiB) of
data, far below the 64 MiB message limit both ends configure, and its own crc32, checked by the
receiver. One channel per decode address is opened on first use and reused by every transfer
(HTTP/2 multiplexes them); :meth:`GrpcKVTransport.close` closes them all.

Go-ahead: after reading the header and allocating the blocks, the decode servicer sends initial
metadata carrying :data:`ACCEPTED_METADATA` (and, when the header offered a payload channel and
this worker serves one, its advert: ``distributed_transport.py``, ``cuda_ipc.py``); the sender
waits for it before the first chunk; ``GrpcKVStream.go_ahead`` keeps it. A
refusal instead ends the call with a status (trailers only, no marker), which the sender reads
without ever having raced a chunk write against it (gRPC reports a write into a call the server
already ended as INTERNAL, hiding the real status).

No gRPC deadline is set on a transfer: the sender's lease bounds how long it may take, and the
lease reaper cancels the call when it expires (the decode worker then sees the stream cancelled
and frees its blocks). A dead peer surfaces through channel keepalive as UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import grpc.aio

from services.common.grpc_channel import open_channel
from services.common.internal_tls import InternalTls
from services.common.peer_roles import DECODE
from services.common.grpc_errors import status_to_error
from services.common.pb import decode_pb2, decode_pb2_grpc
from services.engine.kv_transfer.transport import KVStream, KVTransport

logger = logging.getLogger(__name__)

ACCEPTED_KEY = "tandem-kv-accepted"
ACCEPTED_METADATA = ((ACCEPTED_KEY, "1"),)
"""Initial metadata of an accepted ``TransferKV`` call (sent by the decode servicer)."""


class GrpcKVStream(KVStream):
    """One ``TransferKV`` call used in reader/writer style (errors surface in the sender's code)."""

    def __init__(self, stub: decode_pb2_grpc.DecodeStub) -> None:
        self._call = stub.TransferKV()

    async def write(self, message: decode_pb2.KVTransferMessage) -> bool:
        if self._call.done():
            return False
        try:
            await self._call.write(message)
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            return False  # the receiver already answered; finish() tells how
        return True

    async def accepted(self) -> bool:
        try:
            metadata = await self._call.initial_metadata()
        except grpc.aio.AioRpcError:
            return False
        self.go_ahead = tuple(metadata or ())
        return any(key == ACCEPTED_KEY for key, _ in self.go_ahead)

    async def finish(self) -> decode_pb2.KVTransferAck:
        try:
            if not self._call.done():
                try:
                    await self._call.done_writing()
                except asyncio.InvalidStateError:
                    pass
            return await self._call
        except grpc.aio.AioRpcError as err:
            raise status_to_error(err) from None

    def cancel(self) -> None:
        self._call.cancel()


class GrpcKVTransport(KVTransport):
    """Opens ``TransferKV`` streams, one cached channel per decode address, each mutual TLS
    with ``tls`` (this prefill worker's identity) to a peer that must hold a decode certificate."""

    name = "grpc"

    def __init__(self, tls: InternalTls) -> None:
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, decode_pb2_grpc.DecodeStub] = {}

    def open(self, address: str) -> GrpcKVStream:
        return GrpcKVStream(self.stub(address))

    def stub(self, address: str) -> decode_pb2_grpc.DecodeStub:
        """The ``Decode`` stub on the cached channel to ``address`` (opened on first use)."""
        stub = self._stubs.get(address)
        if stub is None:
            channel = open_channel(address, tls=self._tls, server_role=DECODE)
            self._channels[address] = channel
            stub = self._stubs[address] = decode_pb2_grpc.DecodeStub(channel)
        return stub

    async def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, {}, {}
        for address, channel in channels.items():
            logger.debug("closing KV channel to %s", address)
            await channel.close()
