"""Prefill side of the KV hand-off: ship a prefilled request's blocks to a decode worker.

One transfer's state machine (SendState):

  1. PENDING   — the lease is granted; nothing sent yet.
  2. SENDING   — the header is written and the receiver's go-ahead awaited (it allocated the
                 destination blocks); then chunks of whole blocks (each read from the KV pool,
                 with its crc32) and the commit. Each chunk the receiver takes renews the lease.
  3. AWAIT_ACK — everything is written; waiting for decode's KVTransferAck.
  4. DONE      — decode accepted the KV: the lease is released and the blocks freed.
     FAILED    — refused, corrupt, broken, or aborted: the lease is released, blocks freed, the
                 caller gets a typed error (DataLossError, FailedPreconditionError, ...).
     EXPIRED   — the lease ran out first: the reaper cancelled the stream and freed the blocks;
                 the caller gets UnavailableError.

Every terminal state frees the blocks exactly once (see ``lease.py``). Chunk reads are
pipelined one deep: the next chunk is read while the current one is sent. A CPU pool's chunks
are read in a worker thread, from the block table the prefill handed over
(``PrefilledRequest.block_ids``), without asking the engine thread at all: the request's blocks
are held for this transfer and nothing writes them, and a read queued behind the engine's next
step would wait for another prompt's whole prefill, chunk after chunk (docs/kv-handoff.md: on a
small CPU that ran long prompts' transfers past their lease). Other pools (CUDA; a
tensor-parallel worker's whole-width view, whose reads are collectives every rank must issue in
step order) are read on the engine thread.

A stream whose go-ahead moved the payload onto the device (``KVStream.payload_on_device``: CUDA
IPC, the decode worker copies the blocks out of this worker's pool itself) gets one chunk
announcement for the whole payload instead (``channel_bytes``, no data, crc32 0): nothing is
read from the pool, which would copy the payload to the host and checksum it, costing more than
the device-to-device copy it replaces. The commit, the ack and the lease are the same.

Metrics: ``tandem:kv_transfer_bytes_total`` and ``tandem:kv_transfer_seconds`` on success,
``tandem:kv_transfer_failures_total{reason}`` on failure, expired leases by ``lease.py``.

Test hook: ``corrupt_chunk(index, data) -> data`` rewrites a chunk's bytes *after* its crc32 was
computed, to prove the receiver catches corruption.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import AbortedError, TandemError, UnavailableError
from services.common.grpc_channel import MAX_KV_CHUNK_BYTES
from services.common.metrics import TandemMetrics
from services.common.pb import decode_pb2
from services.common.wire import sampling_params_to_proto, token_logprobs_to_proto
from services.engine.core.kv_cache import KVPool
from services.engine.runtime.engine_loop import EngineLoop
from services.engine.kv_transfer.failures import TIMEOUT_CODE, failure_reason
from services.engine.kv_transfer.layout import engine_layout
from services.engine.kv_transfer.lease import LeaseTable
from services.engine.kv_transfer.payload import (
    ChunkPlan,
    HandoffPool,
    PrefilledRequest,
    handoff_pool,
    plan_chunks,
    read_payload,
)
from services.engine.kv_transfer.transport import KVStream, KVTransport

logger = logging.getLogger(__name__)

CorruptChunk = Callable[[int, bytes], bytes]


class SendState(enum.Enum):
    PENDING = "pending"
    SENDING = "sending"
    AWAIT_ACK = "await_ack"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What a successful transfer moved and how long it took (first write to ack)."""

    num_blocks: int
    num_bytes: int
    num_chunks: int
    seconds: float


@dataclass(slots=True)
class _Transfer:
    state: SendState = SendState.PENDING
    task: asyncio.Task[TransferResult] | None = None
    error: TandemError | None = None


class KVSender:
    """Ships prefilled requests' KV over a transport under leases (see the state machine)."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        transport: KVTransport,
        *,
        lease_seconds: float = 30.0,
        lease_interval: float | None = None,
        max_chunk_bytes: int = MAX_KV_CHUNK_BYTES,
        metrics: TandemMetrics | None = None,
        corrupt_chunk: CorruptChunk | None = None,
    ) -> None:
        self.engine_loop = engine_loop
        self.transport = transport
        self.max_chunk_bytes = max_chunk_bytes
        self.metrics = metrics
        self.corrupt_chunk = corrupt_chunk
        self.leases = LeaseTable(engine_loop, lease_seconds, interval=lease_interval,
                                 metrics=metrics)
        self._transfers: dict[str, _Transfer] = {}

    def start(self) -> None:
        """Start the lease reaper (on the running event loop)."""
        self.leases.start()

    async def close(self) -> None:
        """Abort transfers in flight and free every leased block."""
        for request_id in list(self._transfers):
            self.abort(request_id, "worker stopping")
        await self.leases.close()
        await self.transport.close()

    def state(self, request_id: str) -> SendState | None:
        """The state of a transfer in flight (None once it ended)."""
        transfer = self._transfers.get(request_id)
        return None if transfer is None else transfer.state

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Cancel the transfer of ``request_id`` (its ``send`` raises AbortedError)."""
        transfer = self._transfers.get(request_id)
        if transfer is None or transfer.task is None or transfer.task.done():
            return False
        transfer.state = SendState.FAILED
        transfer.error = AbortedError(f"request {request_id!r} was aborted: {reason}")
        transfer.task.cancel()
        return True

    async def send(self, request: PrefilledRequest, address: str) -> TransferResult:
        """Ship ``request``'s held blocks to the decode worker at ``address``; free them after.

        Raises:
            TandemError: the typed reason the transfer failed (see the module docstring).
        """
        rid = request.request_id
        transfer = _Transfer()
        self.leases.grant(rid, lambda: self._expire(rid, transfer))  # refuses a duplicate id
        self._transfers[rid] = transfer
        task = asyncio.create_task(self._send(request, address, transfer))
        transfer.task = task
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and transfer.error is not None and not (
                current is not None and current.cancelling()
            ):
                self._count_failure(transfer.error)
                raise transfer.error from None
            task.cancel()
            raise
        except TandemError as err:
            transfer.state = SendState.FAILED
            self._count_failure(err)
            raise
        finally:
            self._transfers.pop(rid, None)
            self.leases.release(rid)

    def _expire(self, request_id: str, transfer: _Transfer) -> None:
        if transfer.state in (SendState.DONE, SendState.FAILED):
            return
        transfer.state = SendState.EXPIRED
        transfer.error = UnavailableError(
            f"decode did not acknowledge the KV of request {request_id!r} within the "
            f"{self.leases.ttl:g}s lease",
            code=TIMEOUT_CODE,
        )
        if transfer.task is not None:
            transfer.task.cancel()

    def _count_failure(self, err: TandemError) -> None:
        if self.metrics is not None:
            self.metrics.kv_transfer_failures.labels(reason=failure_reason(err)).inc()

    async def _send(
        self, request: PrefilledRequest, address: str, transfer: _Transfer
    ) -> TransferResult:
        rid = request.request_id
        layout = engine_layout(self.engine_loop.engine)
        block_bytes = handoff_pool(self.engine_loop.engine).layout.block_bytes  # all KV heads
        total = request.num_blocks * block_bytes
        header = decode_pb2.KVHeader(
            request_id=rid,
            layout=layout,
            num_tokens=len(request.prompt_token_ids),
            num_blocks=request.num_blocks,
            total_bytes=total,
            prompt_token_ids=request.prompt_token_ids,
            first_token_id=request.first_token_id,
            params=request.wire_params or sampling_params_to_proto(request.params),
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.num_cached_tokens,
        )
        if request.first_logprob is not None and request.params.logprobs is not None:
            header.first_logprob.CopyFrom(token_logprobs_to_proto(request.first_logprob))
        transfer.state = SendState.SENDING
        started = time.monotonic()
        stream = self.transport.open(address)
        finished = False
        try:
            ack, num_chunks = await self._stream(stream, header, block_bytes, request.block_ids)
            finished = True
        finally:
            if not finished:
                stream.cancel()
        if not ack.accepted:
            raise AbortedError(f"decode worker {address} refused the KV: {ack.error}")
        transfer.state = SendState.DONE
        seconds = time.monotonic() - started
        if self.metrics is not None:
            self.metrics.kv_transfer_bytes.inc(total)
            self.metrics.kv_transfer_seconds.observe(seconds)
        logger.debug("sent %d KV bytes in %d chunks in %.4fs%s", total, num_chunks, seconds,
                     " (on the device)" if stream.payload_on_device else "",
                     extra={"request_id": rid, "decode": address})  # fmt: skip
        return TransferResult(request.num_blocks, total, num_chunks, seconds)

    async def _stream(
        self, stream: KVStream, header: decode_pb2.KVHeader, block_bytes: int,
        block_ids: tuple[int, ...] = (),
    ) -> tuple[decode_pb2.KVTransferAck, int]:
        """Header, go-ahead, chunks (or announcements) and commit; the ack and the chunk count."""
        rid, total = header.request_id, header.total_bytes
        ok = await stream.write(decode_pb2.KVTransferMessage(header=header))
        ok = ok and await stream.accepted()
        if ok and stream.payload_on_device:  # one announcement: no per-message cost to amortise
            plans = plan_chunks(header.num_blocks, block_bytes, max(total, 1))
            ok = await self._announce(stream, plans)
        else:
            plans = plan_chunks(header.num_blocks, block_bytes, self.max_chunk_bytes)
            ok = ok and await self._send_chunks(stream, rid, plans, block_ids)
        if ok:
            commit = decode_pb2.KVCommit(num_chunks=len(plans), total_bytes=total)
            if await stream.write(decode_pb2.KVTransferMessage(commit=commit)):
                self.leases.renew(rid)  # a lease from here for what is still in flight, and the ack
        transfer_state = self._transfers.get(rid)
        if transfer_state is not None:
            transfer_state.state = SendState.AWAIT_ACK
        return await stream.finish(), len(plans)

    async def _send_chunks(
        self, stream: KVStream, rid: str, plans: list[ChunkPlan], block_ids: tuple[int, ...]
    ) -> bool:
        """Read each chunk from the pool (one ahead) and send it with its crc32; False once the
        receiver ended the transfer. ``block_ids``: the request's table, when the caller has it."""
        loop = self.engine_loop
        kv = loop.engine.kv
        off_thread = (bool(block_ids) and loop.engine.loaded.sharding is None
                      and isinstance(kv, KVPool) and kv.data.device.type == "cpu")  # fmt: skip
        if off_thread:  # the engine thread may be deep in the next prompt's prefill: not asked
            pool: HandoffPool = kv
            blocks = list(block_ids)
        else:
            pool, blocks = await loop.call(
                lambda engine: (handoff_pool(engine), list(loop.held_blocks(rid))))

        def read(plan: ChunkPlan) -> asyncio.Future[bytes]:
            if off_thread:
                return asyncio.ensure_future(
                    asyncio.to_thread(read_payload, pool, blocks, plan.offset, plan.length))
            return asyncio.ensure_future(loop.call(
                lambda engine: read_payload(pool, blocks, plan.offset, plan.length)))

        ok = True
        pending = read(plans[0]) if plans else None
        try:
            for index, plan in enumerate(plans):
                if not ok or pending is None:
                    break
                data = await pending
                pending = read(plans[index + 1]) if index + 1 < len(plans) else None
                crc = zlib.crc32(data)
                if self.corrupt_chunk is not None:
                    data = self.corrupt_chunk(index, data)
                chunk = decode_pb2.KVChunk(first_block=plan.first_block, num_blocks=plan.num_blocks,
                                           data=data, crc32=crc, offset=plan.offset)
                ok = await stream.write(decode_pb2.KVTransferMessage(chunk=chunk))
                if ok:
                    self.leases.renew(rid)  # the receiver took it: the transfer is alive
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
        return ok

    @staticmethod
    async def _announce(stream: KVStream, plans: list[ChunkPlan]) -> bool:
        """Announce each chunk (no data, crc32 0): the receiver copies it on the device."""
        for plan in plans:
            chunk = decode_pb2.KVChunk(first_block=plan.first_block, num_blocks=plan.num_blocks,
                                       offset=plan.offset, channel_bytes=plan.length)
            if not await stream.write(decode_pb2.KVTransferMessage(chunk=chunk)):
                return False
        return True
