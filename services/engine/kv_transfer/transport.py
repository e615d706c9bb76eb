"""The one interface every KV transport implements, and the in-process transport for tests.

A transport moves one request's ``KVTransferMessage`` stream (header, chunks, commit; see
``decode.proto``) from a prefill worker to a decode worker and brings back the decode worker's
``KVTransferAck``. The sender (``sender.py``) builds the messages and owns the state machine, so
every transport behaves the same; a transport only carries messages:

  1. ``stream = transport.open(address)`` starts a transfer to the decode worker at ``address``.
  2. ``await stream.write(header)``, then ``await stream.accepted()``: the receiver's go-ahead
     once it checked the header and allocated the destination blocks (False: it refused, and
     ``finish()`` says why). No chunk moves before that, so a refusal never races a write.
  3. ``await stream.write(message)`` for each chunk and the commit, in order; it returns False
     once the receiver has already ended the transfer: stop writing then.
  4. ``await stream.finish()`` half-closes and returns the ack, or raises the receiver's typed
     error (DataLossError, FailedPreconditionError, ResourceExhaustedError, ...).
  5. ``stream.cancel()`` abandons the transfer at any point (the receiver frees its blocks).

A stream whose go-ahead agreed to move the payload on the device (CUDA IPC: ``cuda_ipc.py``)
says so in :attr:`KVStream.payload_on_device`; the sender then writes chunk announcements
without reading the payload. Every byte-moving transport leaves it False.

:class:`InProcessTransport` hands the messages to a receiver object in the same process (its
``receive(messages) -> KVTransferAck``, the very method the gRPC servicer calls), running it as
its own task like a server would, so unit tests exercise the same receiver state machine without
sockets; fakes with the same method simulate slow or silent decode workers. Its go-ahead may
carry metadata like gRPC's (a channel endpoint's ``on_accept(metadata)``).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Protocol

from services.common.errors import UnavailableError
from services.common.pb import decode_pb2

Metadata = tuple[tuple[str, str], ...]
"""Initial metadata a decode worker adds to its go-ahead (a channel's advert)."""
AcceptWithMetadata = Callable[[Metadata], Awaitable[None]]
"""Sends the go-ahead with this metadata (the decode servicer's, for channel endpoints)."""


class KVEndpoint(Protocol):
    """A decode-side receiver: consumes one transfer's messages and answers with an ack."""

    async def receive(
        self,
        messages: AsyncIterator[decode_pb2.KVTransferMessage],
        on_accept: Callable[[], Awaitable[None]] | None = None,
    ) -> decode_pb2.KVTransferAck: ...


class KVChannelEndpoint(Protocol):
    """A decode worker's side of a payload channel (``distributed_endpoint``, ``cuda_ipc``):
    runs a transfer into its receiver, its go-ahead carrying the channel's advert."""

    async def receive(
        self,
        messages: AsyncIterator[decode_pb2.KVTransferMessage],
        on_accept: AcceptWithMetadata,
        caller: str = "",
    ) -> decode_pb2.KVTransferAck:
        """Run one transfer; ``caller`` is the sending peer's identity
        (``peer_roles.peer_identity``)."""
        ...

    def close(self) -> None: ...


class KVStream(ABC):
    """One transfer in flight; see the module lifecycle."""

    go_ahead: tuple[tuple[str, str | bytes], ...] = ()
    """The go-ahead's initial metadata, once ``accepted()`` saw it (channel adverts)."""

    @property
    def payload_on_device(self) -> bool:
        """True once the go-ahead agreed that the payload moves device to device (the receiver
        copies it itself): the sender then announces chunks without reading them."""
        return False

    @abstractmethod
    async def write(self, message: decode_pb2.KVTransferMessage) -> bool:
        """Send one message; False when the receiver already ended the transfer."""

    @abstractmethod
    async def accepted(self) -> bool:
        """Wait for the receiver's go-ahead after the header; False when it refused."""

    @abstractmethod
    async def finish(self) -> decode_pb2.KVTransferAck:
        """Half-close and wait for the ack (or the receiver's typed error)."""

    @abstractmethod
    def cancel(self) -> None:
        """Abandon the transfer; idempotent."""


class KVTransport(ABC):
    """Opens transfers to decode workers by address."""

    name: str = "abstract"

    @abstractmethod
    def open(self, address: str) -> KVStream:
        """Start a transfer to the decode worker at ``address``."""

    async def close(self) -> None:
        """Release connections; transfers in flight are the callers' to cancel."""


class _End:
    """End-of-stream marker for the in-process queue."""


class InProcessStream(KVStream):
    """Feeds a receiver's ``receive`` through a small bounded queue (back-pressure like a socket)."""

    def __init__(self, endpoint: KVEndpoint, depth: int = 4) -> None:
        self._queue: asyncio.Queue[decode_pb2.KVTransferMessage | _End] = asyncio.Queue(depth)
        self._accepted = asyncio.Event()
        self._task = asyncio.create_task(endpoint.receive(self._messages(), self._accept))

    async def _accept(self, metadata: Metadata = ()) -> None:
        self.go_ahead = tuple(metadata)
        self._accepted.set()

    async def _messages(self) -> AsyncIterator[decode_pb2.KVTransferMessage]:
        while True:
            item = await self._queue.get()
            if isinstance(item, _End):
                return
            yield item

    async def write(self, message: decode_pb2.KVTransferMessage) -> bool:
        return await self._put(message)

    async def accepted(self) -> bool:
        waiter = asyncio.ensure_future(self._accepted.wait())
        try:
            await asyncio.wait({waiter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiter.done():
                waiter.cancel()
        return self._accepted.is_set()

    async def finish(self) -> decode_pb2.KVTransferAck:
        await self._put(_End())
        return await self._task

    async def _put(self, item: decode_pb2.KVTransferMessage | _End) -> bool:
        """Queue ``item`` unless the receiver ends first; True when queued."""
        if self._task.done():
            return False
        put = asyncio.ensure_future(self._queue.put(item))
        try:
            await asyncio.wait({put, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not put.done():
                put.cancel()
        return put.done() and not put.cancelled()

    def cancel(self) -> None:
        self._task.cancel()


class InProcessTransport(KVTransport):
    """Delivers transfers to receivers in this process, looked up by address."""

    name = "inprocess"

    def __init__(self, endpoints: Mapping[str, KVEndpoint] | None = None) -> None:
        self.endpoints: dict[str, KVEndpoint] = dict(endpoints or {})

    def register(self, address: str, endpoint: KVEndpoint) -> None:
        self.endpoints[address] = endpoint

    def open(self, address: str) -> KVStream:
        endpoint = self.endpoints.get(address)
        if endpoint is None:
            raise UnavailableError(f"no in-process decode worker at {address!r}")
        return InProcessStream(endpoint)
