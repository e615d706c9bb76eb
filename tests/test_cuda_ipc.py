"""The CUDA IPC KV transport (``services/engine/kv_transfer/cuda_ipc.py``).

On CPU (CI): the offer's wire form, the block copy against the byte-payload reference, the
checks of chunk announcements, and the whole protocol — offer, admission, go-ahead, one
announcement, the placer's copy, commit, ack — through the real sender, receiver, transport and
endpoint, with only torch's two IPC calls replaced by a fake (``tests/cuda_ipc_pair.py``). Over
the in-process transport: the same-GPU path, another GPU (plain go-ahead, bytes in the chunks),
an unmappable pool, bad source blocks. Failures (announcements nobody agreed to, a failed copy,
an abort and a lease expiry during a stuck copy) and the real gRPC workers are
tests/test_cuda_ipc_failures.py.

The same transfer through a real CUDA IPC mapping is tests/test_cuda_ipc_gpu.py.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from services.common.errors import DataLossError, InvalidArgumentError
from services.common.pb import decode_pb2
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.kv_cache import KVLayout, KVPool
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.kv_transfer import ReceiveState
from services.engine.kv_transfer.checks import check_chunk
from services.engine.kv_transfer.cuda_ipc import (
    CUDA_IPC_ADVERT,
    _Transfer,
    copy_blocks,
    has_cuda_ipc_advert,
    pool_problem,
)
from services.engine.kv_transfer.distributed_endpoint import ChannelHost
from services.engine.kv_transfer.pair_group import CHANNEL_KEY, ChannelAdvert
from services.engine.kv_transfer.payload import read_payload, write_payload
from tests.cuda_ipc_pair import GPU, GREEDY, FakeIpc, IpcPair, prompt_of


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
