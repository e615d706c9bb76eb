"""Decode side of the KV hand-off: reserve a request's blocks, then receive its KV into them.

One transfer's state machine (ReceiveState), keyed by request id:

  0. RESERVED  — ``reservations.reserve`` (``reservations.py``) ran before the prefill
                 started ("reserve before compute"): the blocks its prompt's KV needs were
                 allocated on the engine thread and are held under the request id for a
                 lease (``reservation_lease_seconds`` by default),
                 bound to the digest of the prompt and ``cache_salt`` the gateway serves
                 (``prefix_hash.reservation_digest``). No room: RESOURCE_EXHAUSTED at once,
                 nothing allocated, no entry, so the gateway tries another decode worker before
                 any prefill work is done. What reservations hold is bounded per caller (its
                 certificate) and in total, from the first one (``reservation_quota.py``; over a
                 bound: RESOURCE_EXHAUSTED at once too). The header then takes these blocks
                 (step 1). A lease that ends with no header frees them and drops the entry (no
                 tombstone: a late header finds no reservation and is refused, and a waiting
                 ``Generate`` keeps waiting); an abort frees them like any other state. Counted
                 in ``tandem:kv_reservations_total{outcome}``. Its holder may renew the lease
                 (``reservations.reserve(..., renew=True)``: the same caller, prompt digest and
                 size; the gateway does so while the prompt waits in a prefill worker's queue), which
                 allocates nothing; a reservation that is gone is NOT_FOUND then.
  1. ALLOCATED — the header passed its checks (``checks.py``; layout: FAILED_PRECONDITION,
                 counts and params: INVALID_ARGUMENT), its request holds a reservation here, and
                 its prompt and ``params.cache_salt`` give the digest that reservation was made
                 for (else PERMISSION_DENIED, and a reservation stays for the real sender): so
                 no KV lands here, nor later in the shared prefix cache, under a prompt or salt
                 the gateway did not reserve for. It takes the reserved blocks before any data
                 moved; then the transport's go-ahead lets the sender stream chunks.
  2. RECEIVING — chunks arrive in offset order; each is checked (crc32, contiguity, block
                 indices: DATA_LOSS) and written into the blocks on the engine thread. A
                 transfer run with a ``placer`` (CUDA IPC, ``cuda_ipc.py``) may instead get
                 chunk announcements (``channel_bytes``, no data, no crc32): the placer copies
                 those payload bytes into the blocks on the device, on the engine thread, and
                 returns once the copy is complete.
  3. COMMITTED — the commit's totals matched; the ack (accepted) goes back to prefill. The KV is
                 parked until the request's ``Generate`` claims it, for at most
                 ``park_seconds`` (then FAILED and the blocks are freed).
  4. RUNNING   — ``claim`` handed the parked KV to the caller, who passes the blocks to the
                 engine (``EngineLoop.generate_prefilled``); the entry leaves this table.
     FAILED    — any check failed, the stream broke or was cancelled, the request was aborted,
                 or it stalled / stayed parked too long: the blocks are freed at once. The entry
                 stays as a tombstone for ``park_seconds`` so a waiting or late ``Generate``
                 learns why (and a header or a reservation for an aborted request is refused).

A failure after the go-ahead first drains what the sender still streams (bounded by
``DRAIN_SECONDS``), so the sender reads the real status instead of a broken pipe.

``claim`` may be called before the header arrives: it waits (up to its timeout) for the entry
to reach COMMITTED or FAILED. Transfer failures seen here count in
``tandem:kv_transfer_failures_total{reason}`` (an aborted or expired reservation is no transfer
failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from services.common.errors import (
    AbortedError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    TandemError,
    UnavailableError,
)
from services.common.metrics import TandemMetrics
from services.common.pb import decode_pb2
from services.engine.core.kv_cache import KVPool
from services.engine.runtime.engine_loop import EngineLoop
from services.engine.kv_transfer.checks import (
    check_chunk,
    check_commit,
    check_header,
    check_reserved_for,
)
from services.engine.kv_transfer.failures import TIMEOUT_CODE, failure_reason
from services.engine.kv_transfer.layout import engine_layout
from services.engine.kv_transfer.payload import PrefilledRequest, handoff_pool, write_payload
from services.engine.kv_transfer.receive_entry import HOLDING, ReceiveEntry, ReceiveState
from services.engine.kv_transfer.reservation_quota import ReservationQuota
from services.engine.kv_transfer.reservations import (
    DEFAULT_RESERVATION_LEASE_SECONDS,
    ReservationDesk,
)

logger = logging.getLogger(__name__)


Placer = Callable[[KVPool, list[int], int, int], None]
"""``placer(kv, block_ids, offset, length)``: copy payload bytes ``[offset, offset + length)``
into the request's blocks ``block_ids`` of ``kv`` on the device, on the engine thread, and return
only once the copy is complete (the ack lets the sender free the source)."""

DRAIN_SECONDS = 10.0
"""Longest a failed transfer keeps reading (and discarding) what the sender still streams."""


async def _drain(messages: AsyncIterator[decode_pb2.KVTransferMessage]) -> None:
    with contextlib.suppress(Exception):  # TimeoutError included; cancellation propagates
        async with asyncio.timeout(DRAIN_SECONDS):
            async for _ in messages:
                pass


class KVReceiver:
    """Receives transfers (``receive``) and hands them to ``Generate`` (``claim``)."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        *,
        park_seconds: float = 30.0,
        reservation_lease_seconds: float = DEFAULT_RESERVATION_LEASE_SECONDS,
        reap_interval: float | None = None,
        metrics: TandemMetrics | None = None,
        quota: ReservationQuota | None = None,
    ) -> None:
        if not (0 < reservation_lease_seconds < float("inf")):
            raise InvalidArgumentError("the reservation lease must be positive",
                                       param="reservation_lease_seconds")
        engine = engine_loop.engine
        self.engine_loop = engine_loop
        self.layout = engine_layout(engine)
        self.block_bytes = handoff_pool(engine).layout.block_bytes  # all the model's KV heads
        self.vocab_size = engine.loaded.config.vocab_size
        self.max_model_len = engine.max_model_len
        self.park_seconds = park_seconds
        self.reservation_lease_seconds = reservation_lease_seconds
        self.reap_interval = (reap_interval if reap_interval is not None
                              else min(1.0, park_seconds / 4, reservation_lease_seconds / 4))
        self.metrics = metrics
        self._entries: dict[str, ReceiveEntry] = {}
        self._changed: asyncio.Future[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.reservations = ReservationDesk(
            engine_loop, self._entries, self._notify, block_size=self.layout.block_size,
            max_model_len=self.max_model_len, lease_seconds=reservation_lease_seconds,
            quota=(quota or ReservationQuota()).validate(), metrics=metrics,
        )  # fmt: skip

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever(), name="kv-receive-reaper")

    async def close(self) -> None:
        """Stop the reaper and fail every transfer still holding blocks."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        for entry in list(self._entries.values()):
            self._fail(entry, UnavailableError("the decode worker is stopping"))

    def state(self, request_id: str) -> ReceiveState | None:
        entry = self._entries.get(request_id)
        return None if entry is None else entry.state

    @property
    def num_pending(self) -> int:
        """Requests holding blocks but not yet generating (reserved, receiving or parked)."""
        return sum(1 for entry in self._entries.values() if entry.state in HOLDING)

    # ------------------------------------------------------------------ receiving
    async def receive(
        self,
        messages: AsyncIterator[decode_pb2.KVTransferMessage],
        on_accept: Callable[[], Awaitable[None]] | None = None,
        placer: Placer | None = None,
    ) -> decode_pb2.KVTransferAck:
        """Run one transfer to its ack (see the state machine); raises typed errors.

        ``on_accept`` is awaited once the header passed and the blocks are allocated: the
        transport's go-ahead, before which the sender sends no chunk. After it, a failure first
        drains what the sender still streams (for at most ``DRAIN_SECONDS``) so that the sender
        sees this error rather than a broken pipe. ``placer`` copies announced chunks (see the
        state machine, step 2); without one an announced chunk is DATA_LOSS.
        """
        first = await anext(messages, None)
        if first is None or first.WhichOneof("kind") != "header":
            raise InvalidArgumentError("a KV transfer must start with a header", param="header")
        header = first.header
        try:
            ready = check_header(header, self.layout, block_bytes=self.block_bytes,
                                 vocab_size=self.vocab_size, max_model_len=self.max_model_len)
            entry = self._admit(ready)
        except TandemError as err:
            self._count_failure(err)
            raise
        accepted = False
        try:
            entry.owns_blocks = True  # a cancelled allocation may still complete
            # Take the reserved blocks: a no-op when the gateway reserved for the prompt's own
            # length (it does); otherwise the excess is freed or the shortfall allocated.
            await self.engine_loop.resize_held(ready.request_id, header.num_blocks)
            if entry.state is ReceiveState.FAILED:  # aborted during the allocation
                return self._ack(entry, header, 0)
            if on_accept is not None:
                await on_accept()
            accepted = True
            received = await self._receive_chunks(entry, header, messages, placer)
        except TandemError as exc:
            failed_before = entry.state is ReceiveState.FAILED  # aborted meanwhile
            self._fail(entry, exc)
            if accepted:
                await _drain(messages)
            if failed_before:
                return self._ack(entry, header, 0)  # refuse in-band
            raise
        except BaseException:
            self._fail(entry, UnavailableError("the KV stream broke"))
            raise
        if entry.state is ReceiveState.FAILED:
            await _drain(messages)
        return self._ack(entry, header, received)

    async def _receive_chunks(
        self,
        entry: ReceiveEntry,
        header: decode_pb2.KVHeader,
        messages: AsyncIterator[decode_pb2.KVTransferMessage],
        placer: Placer | None,
    ) -> int:
        """Write chunks until the commit; returns early when the entry failed meanwhile."""
        received, chunks = 0, 0
        async for message in messages:
            if entry.state is ReceiveState.FAILED:
                return received
            kind = message.WhichOneof("kind")
            if kind == "chunk":
                entry.state = ReceiveState.RECEIVING
                received += await self._write_chunk(entry, header, message.chunk, received,
                                                    placer)  # fmt: skip
                chunks += 1
            elif kind == "commit":
                check_commit(header, message.commit, received, chunks)
                self._set(entry, ReceiveState.COMMITTED)
                return received
            else:
                raise InvalidArgumentError("a KV transfer has exactly one header")
        if entry.state is not ReceiveState.FAILED:
            raise InvalidArgumentError("the KV transfer ended without a commit")
        return received

    def _admit(self, ready: PrefilledRequest) -> ReceiveEntry:
        """The reserved entry this header's transfer runs in (see the state machine, step 1).

        Raises:
            AbortedError: the request was aborted here.
            InvalidArgumentError: a transfer for the request already runs (or ran) here.
            PermissionDeniedError: the request holds no reservation here, or the header's prompt
                or ``cache_salt`` is not the one reserved for (the reservation is kept).
        """
        rid = ready.request_id
        old = self._entries.get(rid)
        if old is not None and old.aborted:
            raise AbortedError(f"request {rid!r} was aborted", code="aborted")
        if old is not None and old.state not in (ReceiveState.RESERVED, ReceiveState.FAILED):
            raise InvalidArgumentError(f"a KV transfer for request {rid!r} already exists",
                                       param="request_id")  # fmt: skip
        if old is None or old.state is not ReceiveState.RESERVED:
            logger.warning("KV transfer refused: no reservation", extra={"request_id": rid})
            raise PermissionDeniedError(
                f"request {rid!r} holds no KV reservation on this decode worker (never reserved, "
                "expired or already used): a TransferKV must follow the gateway's Reserve",
                param="request_id", code="no_reservation",
            )  # fmt: skip
        try:
            check_reserved_for(ready, old.digest)
        except PermissionDeniedError:
            logger.warning("KV transfer refused: its prompt or cache_salt is not the reserved one",
                           extra={"request_id": rid})  # fmt: skip
            raise
        old.state, old.since, old.ready = ReceiveState.ALLOCATED, time.monotonic(), ready
        old.task = asyncio.current_task()
        return old

    async def _write_chunk(
        self,
        entry: ReceiveEntry,
        header: decode_pb2.KVHeader,
        chunk: decode_pb2.KVChunk,
        received: int,
        placer: Placer | None,
    ) -> int:
        data = chunk.data
        length = check_chunk(chunk, received, header.total_bytes, self.block_bytes,
                             on_device=placer is not None)  # fmt: skip
        rid, loop, offset = entry.request_id, self.engine_loop, chunk.offset
        if chunk.channel_bytes and placer is not None:
            await loop.call(lambda engine: placer(engine.kv, loop.held_blocks(rid), offset, length))
        else:
            await loop.call(lambda engine: write_payload(handoff_pool(engine),
                                                         loop.held_blocks(rid), offset, data))  # fmt: skip
        entry.since = time.monotonic()
        return length

    def _ack(self, entry: ReceiveEntry, header: decode_pb2.KVHeader, received: int) -> decode_pb2.KVTransferAck:
        if entry.state is ReceiveState.FAILED:
            message = entry.error.message if entry.error is not None else "failed"
            return decode_pb2.KVTransferAck(request_id=entry.request_id, accepted=False,
                                            error=message)
        return decode_pb2.KVTransferAck(request_id=entry.request_id, accepted=True,
                                        num_blocks=header.num_blocks, bytes_received=received)

    # ------------------------------------------------------------------ claiming
    async def claim(self, request_id: str, timeout: float) -> PrefilledRequest:
        """Wait up to ``timeout`` seconds for the request's KV; the caller then owns the held
        blocks (and must pass them to the engine or release them)."""
        deadline = time.monotonic() + timeout
        while True:
            entry = self._entries.get(request_id)
            if entry is not None and entry.state is ReceiveState.COMMITTED and entry.ready:
                entry.state = ReceiveState.RUNNING
                del self._entries[request_id]
                return entry.ready
            if entry is not None and entry.state is ReceiveState.FAILED:
                raise entry.error or AbortedError(f"the KV of request {request_id!r} failed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NotFoundError(f"the KV of request {request_id!r} did not arrive within "
                                    f"{timeout:g}s", param="request_id")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._change()), remaining)

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Fail the request's reservation or transfer and free its blocks; a later header or
        reservation is refused."""
        entry = self._entries.get(request_id)
        if entry is None:
            entry = ReceiveEntry(request_id, ReceiveState.FAILED, time.monotonic(),
                           error=AbortedError(f"request {request_id!r} was aborted: {reason}"))
            self._entries[request_id] = entry
            found = False
        else:
            found = entry.state in HOLDING
            self._fail(entry, AbortedError(f"request {request_id!r} was aborted: {reason}"))
        entry.aborted = True
        self._notify()
        return found

    # ------------------------------------------------------------------ internals
    def _set(self, entry: ReceiveEntry, state: ReceiveState) -> None:
        entry.state = state
        entry.since = time.monotonic()
        self._notify()

    def _fail(self, entry: ReceiveEntry, error: TandemError) -> None:
        if entry.state is ReceiveState.FAILED:
            return
        holding = entry.state in HOLDING and entry.owns_blocks
        reservation = entry.state is ReceiveState.RESERVED  # no transfer had started
        entry.error = error
        self._set(entry, ReceiveState.FAILED)
        if holding:
            self.engine_loop.release_nowait(entry.request_id)
        if reservation:
            logger.info("KV reservation freed: %s", error.message,
                        extra={"request_id": entry.request_id})
            return
        self._count_failure(error)
        logger.info("KV transfer failed: %s", error.message, extra={"request_id": entry.request_id})

    def _count_failure(self, error: TandemError) -> None:
        if self.metrics is not None:
            self.metrics.kv_transfer_failures.labels(reason=failure_reason(error)).inc()

    def _change(self) -> asyncio.Future[None]:
        if self._changed is None or self._changed.done():
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    def _notify(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    def reap(self, now: float | None = None) -> None:
        """Free reservations whose lease ended; fail stalled or unclaimed transfers; forget old
        tombstones."""
        now = time.monotonic() if now is None else now
        for entry in list(self._entries.values()):
            if entry.state is ReceiveState.RESERVED:
                self.reservations.expire(entry, now)
                continue
            if now - entry.since < self.park_seconds:
                continue
            if entry.state is ReceiveState.FAILED:
                del self._entries[entry.request_id]
            elif entry.state is ReceiveState.COMMITTED:
                self._fail(entry, UnavailableError(
                    f"no Generate call claimed the KV within {self.park_seconds:g}s",
                    code=TIMEOUT_CODE))
            else:  # stalled mid-stream: free now, and stop reading the stream
                self._fail(entry, UnavailableError(
                    f"the KV stream stalled for {self.park_seconds:g}s", code=TIMEOUT_CODE))
                if entry.task is not None and not entry.task.done():
                    entry.task.cancel()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval)
            self.reap()
