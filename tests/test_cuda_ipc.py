"""The CUDA IPC KV transport (``services/engine/kv_transfer/cuda_ipc.py``).

On CPU (CI): the offer's wire form, the block copy against the byte-payload reference, the
checks of chunk announcements, and the whole protocol — offer, admission, go-ahead, one
announcement, the placer's copy, commit, ack — through the real sender, receiver, transport and
endpoint, with only torch's two IPC calls replaced by a fake (:class:`FakeIpc`: "mapping" a pool
returns the prefill engine's own pool tensor, which is what a real mapping shows). Over the
in-process transport: the same-GPU path, another GPU (plain go-ahead, bytes in the chunks), an
unmappable pool, bad source blocks, announcements nobody agreed to, a failed copy, an abort
and a lease expiry during a stuck copy — each freeing both sides. Over real gRPC workers: the
go-ahead's advert through gRPC metadata, for one GPU and for two.

The same transfer through a real CUDA IPC mapping is tests/test_cuda_ipc_gpu.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import zlib
from collections.abc import AsyncIterator

import pytest
import torch

from services.common.errors import (
    AbortedError,
    DataLossError,
    InvalidArgumentError,
    UnavailableError,
)
from services.common.grpc_channel import open_channel
from services.common.metrics import TandemMetrics
from services.common.pb import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.common.prefix_hash import reservation_digest
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_to_proto
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.decode.servicer import DecodeServicer
from services.decode.worker import DecodeWorker
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.kv_cache import KVLayout, KVPool
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.kv_transfer import (
    InProcessTransport,
    KVReceiver,
    KVSender,
    PrefilledRequest,
    ReceiveState,
)
from services.engine.kv_transfer import cuda_ipc
from services.engine.kv_transfer.checks import check_chunk
from services.engine.kv_transfer.cuda_ipc import (
    CUDA_IPC_ADVERT,
    CudaIpcEndpoint,
    CudaIpcKVTransport,
    _Transfer,
    copy_blocks,
    has_cuda_ipc_advert,
    pool_problem,
)
from services.engine.kv_transfer.distributed_endpoint import ChannelHost
from services.engine.kv_transfer.grpc_transport import GrpcKVTransport
from services.engine.kv_transfer.pair_group import CHANNEL_KEY, ChannelAdvert
from services.engine.kv_transfer.payload import read_payload, write_payload
from services.engine.kv_transfer.transport import KVStream, KVTransport
from services.engine.runtime.engine_loop import EngineLoop
from services.engine.runtime.worker_options import WorkerOptions
from services.engine.runtime.worker_runtime import RoleParts, WorkerHandle, start_worker
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from services.prefill.servicer import PrefillServicer
from tests.test_kv_transfer import wait_until
from services.prefill.worker import PrefillWorker
from tests.tls_identities import tls_for

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
DECODE = "decode-0"
GPU = "3f1c9a2e-0000-4000-8000-00000000a100"  # a made-up GPU uuid


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 + offset) % 500 + 1 for i in range(n)]


class FakeIpc:
    """torch's two IPC calls on CPU: ``share`` files the pool tensor under a new binary handle,
    ``map`` returns the tensor filed under the handle (the same memory, as a mapping gives)."""

    def __init__(self) -> None:
        self.pools: dict[bytes, torch.Tensor] = {}
        self.mapped = 0
        self.fail = False
        self.blocks: int | None = None  # pretend the shared pool has this many blocks

    def share(self, data: torch.Tensor) -> decode_pb2.CudaIpcPool:
        handle = bytes([0, 255, len(self.pools)]) + b"\x00fake-cudaIpcMemHandle"
        self.pools[handle] = data
        shape = list(data.shape)
        if self.blocks is not None:
            shape[0] = self.blocks
        return decode_pb2.CudaIpcPool(
            device=0, handle=handle, storage_size_bytes=data.numel() * data.element_size(),
            ref_counter_handle=b"/torch_1_fake", event_handle=bytes(64),
            event_sync_required=True, dtype=str(data.dtype).removeprefix("torch."), shape=shape,
        )  # fmt: skip

    def map(self, pool: decode_pb2.CudaIpcPool, device: torch.device) -> torch.Tensor:
        self.mapped += 1
        if self.fail:
            raise RuntimeError("cudaIpcOpenMemHandle: invalid device context (fake)")
        return self.pools[pool.handle][: pool.shape[0]]


# ----------------------------------------------------------------------------- pure parts


def test_the_offer_round_trips_as_plain_fields() -> None:
    pool = decode_pb2.CudaIpcPool(
        device=1, handle=bytes(range(64)), storage_size_bytes=3 << 30, storage_offset_bytes=512,
        ref_counter_handle=b"/torch_4242_123_0", ref_counter_offset=7,
        event_handle=b"\x00\xff" * 32, event_sync_required=True, dtype="bfloat16",
        shape=[2048, 32, 2, 16, 8, 128],
    )  # fmt: skip
    offer = decode_pb2.KVChannelOffer(peer_id="prefill-0", peer_instance="ab12cd34",
                                      device="cuda:1", gpu_uuid=GPU, cuda_ipc=pool,
                                      source_blocks=[7, 3, 2047])  # fmt: skip
    header = decode_pb2.KVHeader(request_id="r", channel=offer)
    back = decode_pb2.KVHeader.FromString(header.SerializeToString()).channel
    assert back == offer and back.HasField("cuda_ipc")
    assert back.cuda_ipc.handle == bytes(range(64))
    assert back.cuda_ipc.event_handle[:2] == b"\x00\xff"
    assert list(back.source_blocks) == [7, 3, 2047] and back.cuda_ipc.storage_size_bytes == 3 << 30
    assert not decode_pb2.KVChannelOffer(peer_id="p").HasField("cuda_ipc")  # a distributed offer


def test_advert_and_pool_checks() -> None:
    assert CUDA_IPC_ADVERT == (CHANNEL_KEY, "cuda-ipc")
    assert has_cuda_ipc_advert((("tandem-kv-accepted", "1"), CUDA_IPC_ADVERT))
    assert has_cuda_ipc_advert(((CHANNEL_KEY, b"cuda-ipc"),))
    assert not has_cuda_ipc_advert((("tandem-kv-accepted", "1"),))
    assert not has_cuda_ipc_advert((ChannelAdvert("gloo", "h:1", "g.1", 3).metadata(),))

    layout = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    kv = KVPool(6, layout)
    fake = FakeIpc()
    good = fake.share(kv.data)
    assert pool_problem(good, kv) == ""
    other = decode_pb2.CudaIpcPool()
    other.CopyFrom(good)
    other.dtype = "float32"
    assert "dtype" in pool_problem(other, kv)
    other.CopyFrom(good)
    other.shape[2] = 3
    assert "shape" in pool_problem(other, kv)
    other.CopyFrom(good)
    other.shape[0] = 1000  # more blocks than the storage holds
    assert "storage" in pool_problem(other, kv)
    other.CopyFrom(good)
    other.ref_counter_offset = 10_000  # torch would write past its counter file
    assert "ref counter" in pool_problem(other, kv)
    other.CopyFrom(good)
    other.ref_counter_handle = b"/../dev/shm/someone_else"
    assert "ref counter" in pool_problem(other, kv)
    other.CopyFrom(good)
    other.event_handle = b"short"
    assert "event" in pool_problem(other, kv)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_copy_blocks_matches_the_byte_payload_reference(dtype: str) -> None:
    layout = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    src = KVPool(8, layout)
    src.data.copy_(torch.randn(src.data.shape))
    src_ids, dst_ids = [5, 1, 6, 2], [0, 7, 3, 4]
    fast, reference = KVPool(8, layout), KVPool(8, layout)
    copy_blocks(src.data, fast.data, src_ids, dst_ids)
    total = len(src_ids) * layout.block_bytes
    write_payload(reference, dst_ids, 0, read_payload(src, src_ids, 0, total))
    assert torch.equal(fast.data, reference.data)
    assert torch.count_nonzero(fast.data[[1, 2, 5, 6]]) == 0  # nothing else was touched


def test_announcements_are_checked_like_chunks_but_the_crc32() -> None:
    announce = decode_pb2.KVChunk(offset=0, first_block=0, num_blocks=2, channel_bytes=200)
    assert check_chunk(announce, 0, 300, 100, on_device=True) == 200  # crc32 0 is not checked
    with pytest.raises(DataLossError, match="did not agree"):
        check_chunk(announce, 0, 300, 100)  # a receiver with no placer
    tail = decode_pb2.KVChunk(offset=200, first_block=2, num_blocks=2, channel_bytes=200)
    with pytest.raises(DataLossError, match="overruns"):
        check_chunk(tail, 200, 300, 100, on_device=True)
    with pytest.raises(DataLossError, match="expected 100"):
        check_chunk(announce, 100, 300, 100, on_device=True)
    wrong = decode_pb2.KVChunk(offset=0, first_block=1, num_blocks=2, channel_bytes=200)
    with pytest.raises(DataLossError, match="wrong blocks"):
        check_chunk(wrong, 0, 300, 100, on_device=True)
    both = decode_pb2.KVChunk(offset=0, first_block=0, num_blocks=1, channel_bytes=100,
                              data=b"x" * 100)  # fmt: skip
    with pytest.raises(DataLossError, match="carries data"):
        check_chunk(both, 0, 300, 100, on_device=True)
    data = decode_pb2.KVChunk(offset=0, first_block=0, num_blocks=1, data=b"y" * 100,
                              crc32=zlib.crc32(b"y" * 100))  # fmt: skip
    assert check_chunk(data, 0, 300, 100, on_device=True) == 100  # bytes still work
    data.crc32 ^= 1
    with pytest.raises(DataLossError, match="crc32"):
        check_chunk(data, 0, 300, 100, on_device=True)


def test_the_placer_copies_whole_blocks_only() -> None:
    layout = KVLayout(num_layers=1, block_size=2, num_kv_heads=1, head_dim=4, dtype="float32")
    prefill, decode = KVPool(6, layout), KVPool(6, layout)
    prefill.data.copy_(torch.randn(prefill.data.shape))
    transfer = _Transfer.__new__(_Transfer)
    transfer.pool, transfer.source = None, [4, 0]
    with pytest.raises(DataLossError, match="did not agree"):
        transfer.place(decode, [1, 2], 0, 2 * layout.block_bytes)
    transfer.pool = prefill.data
    with pytest.raises(DataLossError, match="whole blocks"):
        transfer.place(decode, [1, 2], 0, layout.block_bytes // 2)
    with pytest.raises(DataLossError, match="overruns"):
        transfer.place(decode, [1, 2], layout.block_bytes, 2 * layout.block_bytes)
    transfer.place(decode, [1, 2], layout.block_bytes, layout.block_bytes)  # the second block
    assert torch.equal(decode.data[2], prefill.data[0]) and torch.count_nonzero(decode.data[1]) == 0


async def test_a_distributed_decode_worker_ignores_a_cuda_ipc_offer() -> None:
    host = ChannelHost(host="127.0.0.1", op_timeout=5.0)
    try:
        offer = decode_pb2.KVChannelOffer(peer_id="p", peer_instance="i", device="cuda:0",
                                          gpu_uuid=GPU, cuda_ipc=decode_pb2.CudaIpcPool())
        assert host.admit(offer, "ipv4:127.0.0.1") is None and host.num_built == 0
    finally:
        host.close()


# ----------------------------------------------------------------------------- state machines


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("dummy:tiny")


class Recording:
    """An endpoint wrapper that keeps every message of every transfer."""

    def __init__(self, inner: CudaIpcEndpoint | KVReceiver) -> None:
        self.inner = inner
        self.messages: list[decode_pb2.KVTransferMessage] = []

    async def receive(
        self,
        messages: AsyncIterator[decode_pb2.KVTransferMessage],
        on_accept: object = None,
        *caller: str,
    ) -> decode_pb2.KVTransferAck:
        """The inner endpoint's ``receive``; a channel endpoint's ``caller`` passes through."""
        async def record() -> AsyncIterator[decode_pb2.KVTransferMessage]:
            async for message in messages:
                self.messages.append(message)
                yield message

        return await self.inner.receive(record(), on_accept, *caller)  # type: ignore[arg-type]

    def of(self, kind: str) -> list[decode_pb2.KVTransferMessage]:
        return [m for m in self.messages if m.WhichOneof("kind") == kind]


class IpcPair:
    """A prefill engine loop + sender over CUDA IPC (fake) and a decode engine loop + receiver
    behind the IPC endpoint, in process."""

    def __init__(
        self, tiny: LoadedModel, *, prefill_gpu: str = GPU, decode_gpu: str = GPU,
        ipc: FakeIpc | None = None, lease_seconds: float = 30.0, plain_decode: bool = False,
    ) -> None:
        self.ipc = ipc or FakeIpc()
        self.metrics = TandemMetrics(process_metrics=False)
        self.prefill = EngineLoop(LLMEngine(tiny, EngineConfig(num_blocks=64)),
                                  metrics=self.metrics)  # fmt: skip
        self.decode = EngineLoop(LLMEngine(tiny, EngineConfig(num_blocks=64)))
        self.receiver = KVReceiver(self.decode, reap_interval=0.05)
        self.endpoint = CudaIpcEndpoint(self.receiver, gpu_uuid=decode_gpu, map_pool=self.ipc.map)
        self.recording = Recording(self.receiver if plain_decode else self.endpoint)
        self.transport = self.ipc_transport(prefill_gpu)
        self.sender = KVSender(self.prefill, self.transport, lease_seconds=lease_seconds,
                               lease_interval=0.05, max_chunk_bytes=4096, metrics=self.metrics)

    def ipc_transport(self, gpu: str = GPU, inner: KVTransport | None = None) -> CudaIpcKVTransport:
        return CudaIpcKVTransport(
            self.prefill, peer_id="prefill-0", gpu_uuid=gpu, share=self.ipc.share,
            inner=inner or InProcessTransport({DECODE: self.recording}),  # type: ignore[dict-item]
        )  # fmt: skip

    async def __aenter__(self) -> IpcPair:
        for part in (self.prefill, self.decode, self.sender, self.receiver):
            part.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sender.close()
        await self.receiver.close()
        self.endpoint.close()
        await self.prefill.stop()
        await self.decode.stop()

    async def prefill_and_send(self, rid: str, prompt: list[int]) -> object:
        final = None
        async for out in self.prefill.generate(rid, prompt, GREEDY, prefill_only=True):
            final = out
        assert final is not None and final.finish_reason == "prefilled"
        request = PrefilledRequest(rid, tuple(prompt), GREEDY, final.new_token_ids[0], None,
                                   len(final.block_ids))
        # the gateway's reservation first: the receiver takes no KV without one
        await self.receiver.reservations.reserve(rid, len(prompt),
                                    prompt_digest=reservation_digest(prompt, GREEDY.cache_salt))
        return await self.sender.send(request, DECODE)

    async def decoded(self, rid: str) -> list[int]:
        ready = await self.receiver.claim(rid, 1.0)
        tokens: list[int] = []
        async for out in self.decode.generate_prefilled(
            rid, ready.prompt_token_ids, ready.params, first_token_id=ready.first_token_id
        ):
            tokens += out.new_token_ids
        return tokens

    async def held(self, rid: str) -> list[int]:
        return await self.decode.call(lambda engine: list(self.decode.held_blocks(rid)))

    async def idle(self) -> None:
        await wait_until(lambda: self.prefill.stats.num_blocks_in_use == 0
                         and self.decode.stats.num_blocks_in_use == 0)


async def test_same_gpu_copies_the_blocks_in_one_announcement(tiny: LoadedModel) -> None:
    prompt = prompt_of(37)
    reference = LLMEngine(tiny, EngineConfig(num_blocks=64)).generate([prompt], GREEDY)[0]
    async with IpcPair(tiny) as pair:
        result = await pair.prefill_and_send("r1", prompt)
        assert (result.num_blocks, result.num_chunks) == (3, 1)  # type: ignore[attr-defined]
        assert pair.receiver.state("r1") is ReceiveState.COMMITTED
        (header,) = pair.recording.of("header")
        offer = header.header.channel
        assert offer.gpu_uuid == GPU and offer.HasField("cuda_ipc") and offer.device == "cpu"
        (chunk,) = [m.chunk for m in pair.recording.of("chunk")]
        total = header.header.total_bytes
        assert (chunk.channel_bytes, chunk.data, chunk.crc32, chunk.offset) == (total, b"", 0, 0)
        assert pair.recording.of("commit")[0].commit.num_chunks == 1
        source, dest = list(offer.source_blocks), await pair.held("r1")
        prefill_kv, decode_kv = pair.prefill.engine.kv, pair.decode.engine.kv
        assert torch.equal(decode_kv.data[dest], prefill_kv.data[source])
        assert read_payload(decode_kv, dest, 0, total) == read_payload(prefill_kv, source, 0, total)
        assert await pair.decoded("r1") == reference.new_token_ids
        await pair.idle()

        await pair.prefill_and_send("r2", prompt_of(20, offset=1))
        assert pair.ipc.mapped == pair.endpoint.num_mapped == 1  # mapped once per instance
        await pair.decode.release("r2")
        await pair.idle()

        await pair.sender.transport.close()
        pair.sender.transport = restarted = pair.ipc_transport()  # a new prefill instance
        await pair.prefill_and_send("r3", prompt_of(20, offset=2))
        assert pair.ipc.mapped == 2 and len(pair.ipc.pools) == 2  # the old mapping was dropped
        assert pair.endpoint.num_mapped == 2
        assert restarted.instance != offer.peer_instance
        await pair.decode.release("r3")
        await pair.idle()
        block_bytes = result.num_bytes // 3  # type: ignore[attr-defined]
        sent = pair.metrics.kv_transfer_bytes._value.get()  # type: ignore[attr-defined]
        assert sent == 7 * block_bytes  # 3 + 2 + 2 blocks


@pytest.mark.parametrize("prefill_gpu, decode_gpu", [(GPU, "another-gpu"), ("", GPU)])
async def test_another_gpu_gets_the_plain_go_ahead_and_the_bytes(
    tiny: LoadedModel, prefill_gpu: str, decode_gpu: str
) -> None:
    prompt = prompt_of(37)
    reference = LLMEngine(tiny, EngineConfig(num_blocks=64)).generate([prompt], GREEDY)[0]
    async with IpcPair(tiny, prefill_gpu=prefill_gpu, decode_gpu=decode_gpu) as pair:
        result = await pair.prefill_and_send("far", prompt)
        assert result.num_chunks > 1  # type: ignore[attr-defined]
        (header,) = pair.recording.of("header")
        assert header.header.HasField("channel") == bool(prefill_gpu)  # a CPU pool: no offer
        chunks = [m.chunk for m in pair.recording.of("chunk")]
        assert all(c.data and not c.channel_bytes for c in chunks)
        assert pair.ipc.mapped == 0 and pair.endpoint.pool("prefill-0") is None
        assert await pair.decoded("far") == reference.new_token_ids
        await pair.idle()


async def test_a_pool_that_cannot_be_mapped_is_not_tried_again(tiny: LoadedModel) -> None:
    ipc = FakeIpc()
    ipc.fail = True
    async with IpcPair(tiny, ipc=ipc) as pair:
        for rid in ("m1", "m2"):
            result = await pair.prefill_and_send(rid, prompt_of(30, offset=len(rid)))
            assert result.num_chunks > 1  # type: ignore[attr-defined]  # bytes over the stream
            await pair.decode.release(rid)
        assert ipc.mapped == 1 and pair.endpoint.num_mapped == 0
        await pair.idle()


async def test_source_blocks_outside_the_pool_are_refused(tiny: LoadedModel) -> None:
    ipc = FakeIpc()
    ipc.blocks = 1  # prefill claims a one-block pool: its blocks' ids lie outside it
    async with IpcPair(tiny, ipc=ipc) as pair:
        with pytest.raises(InvalidArgumentError, match="source blocks"):
            await pair.prefill_and_send("oob", prompt_of(40))
        await pair.idle()
        assert pair.receiver.state("oob") is ReceiveState.FAILED


class Insisting(KVStream):
    """A stream that announces chunks whatever the go-ahead said."""

    def __init__(self, inner: KVStream) -> None:
        self.inner = inner

    @property
    def payload_on_device(self) -> bool:
        return True

    async def write(self, message: decode_pb2.KVTransferMessage) -> bool:
        return await self.inner.write(message)

    async def accepted(self) -> bool:
        return await self.inner.accepted()

    async def finish(self) -> decode_pb2.KVTransferAck:
        return await self.inner.finish()

    def cancel(self) -> None:
        self.inner.cancel()


class InsistingTransport(KVTransport):
    def __init__(self, inner: KVTransport) -> None:
        self.inner = inner

    def open(self, address: str) -> KVStream:
        return Insisting(self.inner.open(address))


@pytest.mark.parametrize("plain_decode", [False, True])
async def test_announcements_nobody_agreed_to_are_data_loss(
    tiny: LoadedModel, plain_decode: bool
) -> None:
    """Decode on another GPU (its placer has no pool), or a decode worker with no channel (no
    placer): either way the announcement is refused and both sides free their blocks."""
    async with IpcPair(tiny, decode_gpu="another-gpu", plain_decode=plain_decode) as pair:
        pair.sender.transport = InsistingTransport(pair.transport)
        with pytest.raises(DataLossError, match="did not agree"):
            await pair.prefill_and_send("rogue", prompt_of(40))
        await pair.idle()
        assert pair.receiver.state("rogue") is ReceiveState.FAILED


async def test_a_failed_copy_fails_the_transfer_and_frees_both_sides(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (fake)")

    monkeypatch.setattr(cuda_ipc, "copy_blocks", broken)
    async with IpcPair(tiny) as pair:
        with pytest.raises(UnavailableError, match="CUDA IPC copy"):
            await pair.prefill_and_send("boom", prompt_of(40))
        await pair.idle()
        assert pair.receiver.state("boom") is ReceiveState.FAILED
        assert pair.metrics.kv_transfer_failures.labels(reason="connection")._value.get() == 1


class StuckCopy:
    """``copy_blocks`` that blocks decode's engine thread until released."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args: object) -> None:
        self.started.set()
        self.release.wait(10)
        copy_blocks(*args)  # type: ignore[arg-type]


async def test_abort_during_the_copy_frees_both_sides(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    stuck = StuckCopy()
    monkeypatch.setattr(cuda_ipc, "copy_blocks", stuck)
    async with IpcPair(tiny) as pair:
        send = asyncio.create_task(pair.prefill_and_send("ab", prompt_of(60)))
        await asyncio.to_thread(stuck.started.wait, 5)
        assert pair.sender.abort("ab")
        assert pair.receiver.abort("ab")
        stuck.release.set()
        await pair.decode.abort("ab")
        with pytest.raises(AbortedError):
            await send
        await pair.idle()
        assert pair.receiver.state("ab") is ReceiveState.FAILED


async def test_lease_expiry_during_a_stuck_copy_frees_both_sides(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    stuck = StuckCopy()
    monkeypatch.setattr(cuda_ipc, "copy_blocks", stuck)
    async with IpcPair(tiny, lease_seconds=0.3) as pair:
        with pytest.raises(UnavailableError, match="lease"):
            await pair.prefill_and_send("slow", prompt_of(40))
        await wait_until(lambda: pair.prefill.stats.num_blocks_in_use == 0)  # prefill freed
        stuck.release.set()  # the copy ends; its result is dropped and decode frees the blocks
        await pair.idle()
        assert pair.receiver.state("slow") is ReceiveState.FAILED
        assert pair.metrics.kv_transfer_leases_expired._value.get() == 1


# ----------------------------------------------------------------------------- real gRPC


async def start_ipc_workers(
    model: LoadedModel, ipc: FakeIpc, prefill_gpu: str, decode_gpu: str
) -> tuple[WorkerHandle, WorkerHandle]:
    """The servers' roles with the fake IPC calls (start_*_worker build the real ones)."""

    def decode_role(engine_loop: EngineLoop, metrics: TandemMetrics) -> RoleParts:
        receiver = KVReceiver(engine_loop, metrics=metrics)
        channel = CudaIpcEndpoint(receiver, gpu_uuid=decode_gpu, map_pool=ipc.map)
        worker = DecodeWorker(engine_loop, receiver, channel=channel)
        servicer = DecodeServicer(worker, worker_id="decode-t")
        return worker, servicer, decode_pb2_grpc.add_DecodeServicer_to_server, DECODE_SERVICE

    def prefill_role(engine_loop: EngineLoop, metrics: TandemMetrics) -> RoleParts:
        transport = CudaIpcKVTransport(engine_loop, peer_id="prefill-t", gpu_uuid=prefill_gpu,
                                       share=ipc.share,
                                       inner=GrpcKVTransport(tls_for("prefill")))  # fmt: skip
        worker = PrefillWorker(engine_loop, KVSender(engine_loop, transport, metrics=metrics))
        servicer = PrefillServicer(worker, worker_id="prefill-t")
        return worker, servicer, prefill_pb2_grpc.add_PrefillServicer_to_server, PREFILL_SERVICE

    options = WorkerOptions(tls=tls_for("decode"),
                            host="127.0.0.1", port=0, num_blocks=64, kv_transport="grpc")
    decode = await start_worker("decode", options, decode_role, loaded=model, with_text=True)
    prefill_options = dataclasses.replace(options, tls=tls_for("prefill"))
    prefill = await start_worker("prefill", prefill_options, prefill_role, loaded=model)
    return prefill, decode


@pytest.mark.parametrize("decode_gpu", [GPU, "another-gpu"])
async def test_over_grpc_the_advert_travels_in_the_go_ahead(
    tiny: LoadedModel, decode_gpu: str
) -> None:
    ipc = FakeIpc()
    prompt = prompt_of(40)
    expected = LLMEngine(tiny, EngineConfig(num_blocks=64)).generate([prompt], GREEDY)[0]
    prefill, decode = await start_ipc_workers(tiny, ipc, GPU, decode_gpu)
    prefill_channel = open_channel(prefill.address, tls=tls_for("gateway"))
    decode_channel = open_channel(decode.address, tls=tls_for("gateway"))
    try:
        prefill_stub = prefill_pb2_grpc.PrefillStub(prefill_channel)
        decode_stub = decode_pb2_grpc.DecodeStub(decode_channel)
        await decode_stub.Reserve(decode_pb2.ReserveRequest(  # what the gateway does first
            request_id="g", num_tokens=len(prompt),
            prompt_digest=reservation_digest(prompt, GREEDY.cache_salt)))
        call = decode_stub.Generate(decode_pb2.GenerateRequest(request_id="g",
                                                               wait_for_kv_seconds=10))
        response = await prefill_stub.Prefill(prefill_pb2.PrefillRequest(
            request_id="g", token_ids=prompt, params=sampling_params_to_proto(GREEDY),
            decode_address=decode.address,
        ))
        assert [t async for message in call for t in message.token_ids] == expected.new_token_ids
        assert response.num_blocks == 3
        endpoint = decode.worker.channel  # type: ignore[attr-defined]
        assert endpoint.num_mapped == ipc.mapped == (1 if decode_gpu == GPU else 0)
        for stub in (prefill_stub, decode_stub):
            deadline = time.monotonic() + 10
            while (await stub.GetStats(common_pb2.StatsRequest())).kv_blocks_in_use:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
    finally:
        await prefill_channel.close()
        await decode_channel.close()
        await prefill.stop(0.5)
        await decode.stop(0.5)
