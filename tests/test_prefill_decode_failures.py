"""Every way a prefill-to-decode hand-off can end early, between real gRPC workers on 127.0.0.1:
Abort, a client cancelling, refusal for room, corruption, a foreign layout, lease expiry, a
prefill's abort and deadline, and the pair group's own life (reuse, a peer dying mid-transfer,
restarts) — each returning the KV blocks in use to zero on both sides, over both transports
(``prefill_decode_cluster.py``)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

import grpc
import grpc.aio
import pytest

from services.common.grpc_channel import open_channel
from services.common.grpc_server import start_grpc_server
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.peer_roles import peer_identity
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_to_proto
from services.decode.server import start_decode_worker
from services.engine.kv_transfer.distributed_endpoint import ChannelHost
from services.engine.kv_transfer.grpc_transport import ACCEPTED_METADATA
from services.engine.kv_transfer import receiver as receiver_module
from services.engine.kv_transfer import sender as sender_module
from services.engine.kv_transfer.layout import engine_layout
from services.engine.core.loaders import LoadedModel
from services.engine.runtime.worker_options import WorkerOptions
from services.prefill.server import start_prefill_worker
from tests.tls_identities import tls_for
from tests.prefill_decode_cluster import (  # noqa: F401 - model and transport are fixtures
    GREEDY, Cluster, cluster, model, prompt_of, read_rest, transport,
)


async def test_abort_on_decode_ends_the_stream_and_frees_blocks(
    model: LoadedModel, transport: str
) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    async with cluster(model, transport=transport) as c:
        call = c.generate("ab")
        await c.prefill("ab", prompt_of(30), long)
        first = await call.read()
        assert first.token_ids
        reply = await c.decode_stub.Abort(common_pb2.AbortRequest(request_id="ab", reason="test"))
        assert reply.found
        rest = await read_rest(call)
        assert rest[-1].finish_reason == "abort"
        await c.wait_idle()
        again = await c.decode_stub.Abort(common_pb2.AbortRequest(request_id="ab"))
        assert not again.found


async def test_client_cancelling_generate_frees_blocks(model: LoadedModel, transport: str) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    async with cluster(model, transport=transport) as c:
        call = c.generate("cx")
        await c.prefill("cx", prompt_of(30), long)
        await call.read()
        await call.read()
        call.cancel()
        await c.wait_idle()


async def test_abort_after_transfer_before_generate_frees_blocks(
    model: LoadedModel, transport: str
) -> None:
    async with cluster(model, transport=transport) as c:
        await c.prefill("parked", prompt_of(30))
        _, dec = await c.stats()
        assert dec.kv_blocks_in_use == 2 and dec.num_waiting == 1  # parked, waiting for Generate
        reply = await c.decode_stub.Abort(common_pb2.AbortRequest(request_id="parked"))
        assert reply.found
        await c.wait_idle()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in c.generate("parked", wait=1.0):
                pass
        assert err.value.code() == grpc.StatusCode.ABORTED


async def test_decode_without_room_refuses_and_both_sides_free(
    model: LoadedModel, transport: str
) -> None:
    async with cluster(model, transport=transport, decode_blocks=2) as c:
        call = c.generate("big", wait=1.0)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the reservation finds no room
            await c.reserve("big", prompt_of(60))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AioRpcError) as err:  # so the KV has nowhere to go
            await c.prefill("big", prompt_of(60), reserve=False)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as gen_err:
            async for _ in call:
                pass
        assert gen_err.value.code() == grpc.StatusCode.NOT_FOUND  # no KV ever came
        await c.wait_idle()
        # A prompt that fits still goes through.
        _, responses = await c.run("small", prompt_of(10))
        assert responses[-1].finish_reason == "length"
        await c.wait_idle()


async def test_prompt_larger_than_the_prefill_pool_is_refused(
    model: LoadedModel, transport: str
) -> None:
    async with cluster(model, transport=transport, prefill_blocks=2) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill("huge", prompt_of(60), reserve=False)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await c.wait_idle()


async def test_corrupted_chunk_fails_with_data_loss(model: LoadedModel, transport: str) -> None:
    def flip(index: int, data: bytes) -> bytes:
        return bytes([data[0] ^ 0x01]) + data[1:]

    corrupted: list[int] = []

    def once(index: int, data: bytes) -> bytes:
        if index != 1 or corrupted:
            return data
        corrupted.append(index)
        return flip(index, data)

    # Small chunks so the transfer has several and the second is corrupted mid-way (once).
    kw = {"corrupt_chunk": once, "max_chunk_bytes": 8192}
    async with cluster(model, transport=transport, prefill_kw=kw) as c:
        call = c.generate("crc")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill("crc", prompt_of(60))
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        with pytest.raises(grpc.aio.AioRpcError) as gen_err:
            async for _ in call:
                pass
        assert gen_err.value.code() == grpc.StatusCode.DATA_LOSS
        await c.wait_idle()
        failures = c.prefill_handle.metrics.kv_transfer_failures.labels(reason="checksum")._value.get()
        assert failures == 1
        if transport == "distributed":  # the bad bytes came over the channel, which survives
            group, received = c.prefill_group(), c.decode_group()
            assert group is not None and received is not None
            assert group.num_bytes == received.num_bytes > 0 and not group.broken
            _, responses = await c.run("after-crc", prompt_of(20))
            assert responses[-1].finish_reason == "length"
            assert c.prefill_group() is group
            await c.wait_idle()


async def test_header_from_another_model_is_refused(model: LoadedModel, transport: str) -> None:
    async with cluster(model, transport=transport) as c:
        layout = engine_layout(c.decode_handle.engine_loop.engine)
        layout.model_fingerprint = "0123456789abcdef"
        header = decode_pb2.KVHeader(
            request_id="foreign", layout=layout, num_tokens=16, num_blocks=1,
            total_bytes=c.decode_handle.engine_loop.engine.layout.block_bytes,
            prompt_token_ids=list(range(3, 19)), num_prompt_tokens=16,
            params=sampling_params_to_proto(GREEDY),
        )
        async with open_channel(c.decode_handle.address, tls=tls_for("prefill")) as channel:
            call = decode_pb2_grpc.DecodeStub(channel).TransferKV()  # as a prefill worker would
            await call.write(decode_pb2.KVTransferMessage(header=header))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "model_fingerprint" in (err.value.details() or "")
        await c.wait_idle()
        layout_failures = c.decode_handle.metrics.kv_transfer_failures.labels(reason="layout")
        assert layout_failures._value.get() == 1


class SilentDecode(decode_pb2_grpc.DecodeServicer):
    """Reads a whole transfer and never answers (a hung decode worker). With a ``channel`` it
    advertises it in its go-ahead and then never receives a piece."""

    def __init__(self, channel: ChannelHost | None = None) -> None:
        self.cancelled = asyncio.Event()
        self.channel = channel

    async def TransferKV(self, request_iterator, context):  # type: ignore[no-untyped-def]
        header = (await anext(request_iterator)).header
        metadata = ACCEPTED_METADATA
        if self.channel is not None and header.HasField("channel"):
            caller = peer_identity(context.peer(), context.auth_context())
            admitted = self.channel.admit(header.channel, caller)
            assert admitted is not None
            metadata = (*metadata, admitted[1].metadata())
        await context.send_initial_metadata(metadata)
        async for _ in request_iterator:
            pass
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def KVStore(self, request, context):  # type: ignore[no-untyped-def]
        assert self.channel is not None
        return await self.channel.store.serve(
            request, peer_identity(context.peer(), context.auth_context()))


async def test_lease_expires_when_decode_never_acknowledges(
    model: LoadedModel, transport: str
) -> None:
    channel = None
    if transport == "distributed":
        channel = ChannelHost(host="127.0.0.1", op_timeout=5.0)
    silent = SilentDecode(channel)
    server = await start_grpc_server(
        [(decode_pb2_grpc.add_DecodeServicer_to_server, silent, "tandem.v1.Decode")],
        tls=tls_for("decode"), host="127.0.0.1", port=0,
    )
    kw = {"lease_seconds": 0.4, "lease_interval": 0.05}
    try:
        async with cluster(model, transport=transport, prefill_kw=kw,
                           decode_address=server.address) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.prefill("hung", prompt_of(30))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "lease" in (err.value.details() or "")
            await asyncio.wait_for(silent.cancelled.wait(), 5)
            await c.wait_idle()
            assert c.prefill_handle.metrics.kv_transfer_leases_expired._value.get() == 1  # type: ignore[attr-defined]
            if channel is not None:  # the piece that never went through broke the group
                transport = c.prefill_handle.worker.sender.transport  # type: ignore[attr-defined]
                assert transport.num_built == 1 and c.prefill_group() is None  # retired
    finally:
        await server.stop(0)
        if channel is not None:
            channel.close()


async def test_prefill_abort_and_deadline(model: LoadedModel, transport: str) -> None:
    async with cluster(model, transport=transport) as c:
        await c.prefill_stub.Abort(common_pb2.AbortRequest(request_id="early"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill("early", prompt_of(20), reserve=False)
        assert err.value.code() == grpc.StatusCode.ABORTED
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await c.prefill("late", prompt_of(20), reserve=False, deadline_unix=time.time() - 1)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await c.prefill("bad", [], reserve=False)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            async for _ in c.generate("nobody", wait=0.1):
                pass
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        c.decode_target = f"127.0.0.1:{_closed_port()}"
        with pytest.raises(grpc.aio.AioRpcError) as down:
            await c.prefill("down", prompt_of(20))
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        await c.wait_idle()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SlowWrite:
    """Holds the decode engine thread on the next payload write once armed, so that a transfer
    is mid-way (a piece written, the next one on its way) while a test acts."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds: float = 0.3) -> None:
        self.armed, self.started = threading.Event(), threading.Event()
        real = receiver_module.write_payload

        def write(kv, block_ids, offset, data):  # type: ignore[no-untyped-def]
            if self.armed.is_set():
                self.armed.clear()
                self.started.set()
                time.sleep(seconds)
            real(kv, block_ids, offset, data)

        monkeypatch.setattr(receiver_module, "write_payload", write)

    async def hold_next(self, start: Callable[[], object]) -> asyncio.Future[object]:
        """Arm, start the transfer (``start()``: an awaitable), return once the write is held."""
        self.started.clear()
        self.armed.set()
        task = asyncio.ensure_future(start())  # type: ignore[arg-type]
        assert await asyncio.to_thread(self.started.wait, 10)
        return task


async def test_pair_group_is_reused_and_rebuilt_when_a_peer_dies_or_restarts(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Distributed only: one group serves all of a pair's transfers (an Abort mid-transfer
    drains the pieces still coming, so the group survives it); a decode worker dying
    mid-transfer frees prefill's blocks and breaks the group; a decode worker restarted at the
    same address (new store) and then a restarted prefill worker (same id, new instance) each
    get a fresh group."""
    slow = SlowWrite(monkeypatch)
    kw = {"max_chunk_bytes": 4096}  # many pieces per transfer
    async with cluster(model, transport="distributed", prefill_kw=kw) as c:
        for rid in ("a", "b"):
            _, responses = await c.run(rid, prompt_of(40))
            assert responses[-1].finish_reason == "length"
        group, decode_side = c.prefill_group(), c.decode_group()
        assert group is not None and decode_side is not None and group.key == decode_side.key
        assert c.groups_built() == (1, 1)
        await c.wait_idle()

        # Aborted on decode mid-transfer: the rest is drained over the channel, which survives.
        aborting = await slow.hold_next(lambda: c.prefill("mid", prompt_of(60)))
        reply = await c.decode_stub.Abort(common_pb2.AbortRequest(request_id="mid"))
        assert reply.found
        with pytest.raises(grpc.aio.AioRpcError) as aborted:
            await aborting
        assert aborted.value.code() == grpc.StatusCode.ABORTED
        await c.wait_idle()
        _, responses = await c.run("c", prompt_of(40))
        assert responses[-1].finish_reason == "length"
        assert c.prefill_group() is group and not group.broken and c.groups_built() == (1, 1)

        # The decode worker dies with a piece on its way: prefill frees its blocks.
        dying = await slow.hold_next(lambda: c.prefill("dying", prompt_of(60)))
        port = c.decode_handle.port
        await c.decode_handle.stop(0)
        with pytest.raises(grpc.aio.AioRpcError) as died:
            await dying
        assert died.value.code() == grpc.StatusCode.UNAVAILABLE
        assert group.broken
        await _prefill_blocks_freed(c)

        # Restarted at the same address: a new store and group (the old one is retired).
        c.decode_handle = await start_decode_worker(
            WorkerOptions(tls=tls_for("decode"),
                          host="127.0.0.1", port=port, num_blocks=64, worker_id="decode-t",
                          kv_transport="distributed"), loaded=model)  # fmt: skip
        await _run_until_reachable(c, "after-decode-restart")
        assert c.groups_built() == (2, 1) and group.retired
        rebuilt, decode_side = c.prefill_group(), c.decode_group()
        assert rebuilt is not None and decode_side is not None
        assert rebuilt.key == decode_side.key != group.key

        # A restarted prefill worker (same id, new instance): decode builds it a fresh group.
        await c.prefill_handle.stop(0)
        c.prefill_handle = await start_prefill_worker(
            WorkerOptions(tls=tls_for("prefill"),
                          host="127.0.0.1", port=c.prefill_handle.port, num_blocks=64,
                          worker_id="prefill-t", kv_transport="distributed"),
            loaded=model, **kw)  # type: ignore[arg-type]  # fmt: skip
        await _run_until_reachable(c, "after-prefill-restart")
        assert c.groups_built() == (1, 2) and rebuilt.retired  # a new prefill's first group
        fresh, decode_side = c.prefill_group(), c.decode_group()
        assert fresh is not None and decode_side is not None
        assert fresh.key == decode_side.key != rebuilt.key
        await c.wait_idle()


class BetweenPieces:
    """Once armed, holds prefill's read of a transfer's second piece until released, and tells
    when decode wrote the first: prefill is then between pieces (one delivered, the next not
    announced) while a test acts."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed, self.held = threading.Event(), threading.Event()
        self.written, self.go = threading.Event(), threading.Event()
        read, write = sender_module.read_payload, receiver_module.write_payload

        def held_read(pool, blocks, offset, length):  # type: ignore[no-untyped-def]
            if self.armed.is_set() and offset > 0 and not self.held.is_set():
                self.held.set()
                self.go.wait(10)
            return read(pool, blocks, offset, length)

        def noted_write(kv, block_ids, offset, data):  # type: ignore[no-untyped-def]
            write(kv, block_ids, offset, data)
            if self.armed.is_set():
                self.written.set()

        monkeypatch.setattr(sender_module, "read_payload", held_read)
        monkeypatch.setattr(receiver_module, "write_payload", noted_write)

    async def hold(self, start: Callable[[], object]) -> asyncio.Future[object]:
        """Arm, start the transfer (``start()``: an awaitable), return once it is between its
        first and second pieces."""
        self.armed.set()
        task = asyncio.ensure_future(start())  # type: ignore[arg-type]
        assert await asyncio.to_thread(self.held.wait, 10)
        assert await asyncio.to_thread(self.written.wait, 10)
        return task


async def test_a_decode_worker_dying_between_pieces_breaks_the_group(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Distributed only: decode dies after a piece arrived and before the next is announced, so
    no op of the group fails on prefill's side; the transfer's call ending unavailable is what
    tells prefill the group's peer is gone (it is broken, then retired), and its blocks are
    freed."""
    between = BetweenPieces(monkeypatch)
    async with cluster(model, transport="distributed",
                       prefill_kw={"max_chunk_bytes": 4096}) as c:  # fmt: skip
        _, responses = await c.run("a", prompt_of(40))
        assert responses[-1].finish_reason == "length"
        group = c.prefill_group()
        assert group is not None and not group.broken
        dying = await between.hold(lambda: c.prefill("dying", prompt_of(60)))
        await c.decode_handle.stop(0)
        between.go.set()
        with pytest.raises(grpc.aio.AioRpcError) as died:
            await dying
        assert died.value.code() == grpc.StatusCode.UNAVAILABLE
        assert group.broken and group.retired
        await _prefill_blocks_freed(c)


async def _prefill_blocks_freed(c: Cluster) -> None:
    """Wait (at most 10 s) until the prefill worker holds no KV block."""
    deadline = time.monotonic() + 10
    while (await c.prefill_stub.GetStats(common_pb2.StatsRequest())).kv_blocks_in_use:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def _run_until_reachable(c: Cluster, rid: str) -> None:
    """Run a request, retrying while a restarted worker is not reachable yet (the client
    channels reconnect with a backoff)."""
    deadline = time.monotonic() + 10
    attempt = 0
    while True:
        attempt += 1
        try:
            _, responses = await c.run(f"{rid}-{attempt}", prompt_of(40))
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
            continue
        assert responses[-1].finish_reason == "length"
        return
