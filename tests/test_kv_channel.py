"""The distributed KV transport's pair groups without gRPC (Gloo on loopback): the go-ahead's
advert, the backend choice, the negotiation between a decode worker's ``ChannelHost`` and a
prefill worker's ``DistributedKVTransport`` (reuse, retirement from either side, restarts, a
set-up that fails falling back to gRPC), the decode side's checks of announced pieces; and the
``--kv-transport`` / ``--kv-dist-port`` flags. The transfers themselves, over real workers and
every cleanup path, are in ``test_prefill_decode.py``."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from services.cli import main as tandem_main
from services.common.errors import DataLossError, InvalidArgumentError
from services.common.pb import decode_pb2
from services.decode.options import check_kv_dist_port
from services.engine.kv_transfer.checks import check_chunk
from services.engine.kv_transfer.distributed_endpoint import ChannelHost, _Transfer
from services.engine.kv_transfer.distributed_transport import DistributedKVTransport
from services.engine.kv_transfer.grpc_transport import GrpcKVTransport
from services.engine.kv_transfer.pair_group import CHANNEL_KEY, ChannelAdvert, pair_backend
from services.engine.runtime.worker_options import WorkerOptions, resolve_kv_transport
from tests.tls_identities import tls_for

DECODE = "decode-0:50051"  # the decode worker's gRPC address: prefill keys its groups by it


# ----------------------------------------------------------------------------- flags


def test_kv_transport_choices_resolve_per_device() -> None:
    assert resolve_kv_transport("auto", "cpu") == "grpc"
    # CUDA IPC on CUDA workers: decode falls back to gRPC per transfer across GPUs
    assert resolve_kv_transport("auto", "cuda:0") == "cuda-ipc"
    assert resolve_kv_transport("cuda-ipc", "cuda:1") == "cuda-ipc"
    assert resolve_kv_transport("grpc", "cuda") == "grpc"
    assert resolve_kv_transport("distributed", "cpu") == "distributed"
    assert resolve_kv_transport("distributed", "cuda") == "distributed"
    with pytest.raises(InvalidArgumentError, match="--kv-transport cuda-ipc needs CUDA") as err:
        resolve_kv_transport("cuda-ipc", "cpu")
    assert err.value.param == "kv_transport"
    with pytest.raises(InvalidArgumentError, match="must be one of"):
        resolve_kv_transport("nccl", "cpu")
    assert WorkerOptions(host="127.0.0.1").reachable_host() == "127.0.0.1"  # where peers meet it
    assert WorkerOptions(host="0.0.0.0").reachable_host() is None  # the machine's name
    assert WorkerOptions(advertise_address="[::1]:50071").reachable_host() == "::1"
    assert check_kv_dist_port(0) == 0 and check_kv_dist_port(29500) == 29500
    with pytest.raises(InvalidArgumentError, match="--kv-dist-port") as port_err:
        check_kv_dist_port(70000)
    assert port_err.value.param == "kv_dist_port"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_cuda_ipc_on_a_cpu_worker_fails_at_start_up_naming_the_flag(
    role: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line, before any model is loaded (the model named here does not exist)."""
    argv = ["serve", role, "--kv-transport", "cuda-ipc", "--device", "cpu",
            "--model", "/nonexistent/model.gguf", "--metrics-port", "-1"]  # fmt: skip
    assert tandem_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: --kv-transport cuda-ipc needs CUDA workers")
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- wire


def test_advert_metadata_roundtrip_and_backend_choice() -> None:
    advert = ChannelAdvert("gloo", "10.0.0.7:29500", "ab12cd34.3", 17)
    assert advert.metadata() == (CHANNEL_KEY, "gloo 10.0.0.7:29500 ab12cd34.3 17")
    metadata = (("tandem-kv-accepted", "1"), advert.metadata())
    assert ChannelAdvert.from_metadata(metadata) == advert
    assert ChannelAdvert.from_metadata((("tandem-kv-accepted", "1"),)) is None
    assert ChannelAdvert.from_metadata(((CHANNEL_KEY, "gloo nonsense"),)) is None
    assert pair_backend("cuda:0", "cuda:1") == "nccl"
    assert pair_backend("cuda:0", "cpu") == pair_backend("cpu", "cpu") == "gloo"


# ----------------------------------------------------------------------------- negotiation


@pytest.fixture
async def host() -> AsyncIterator[ChannelHost]:
    channel = ChannelHost(bind_host="127.0.0.1", host="127.0.0.1", op_timeout=5.0)
    channel.start()
    yield channel
    channel.close()


async def one_transfer(host: ChannelHost, prefill: DistributedKVTransport, payload: bytes) -> str:
    """What one TransferKV does for the channel: offer, admit, join, one piece. Returns the key
    of the group both sides used."""
    offer = prefill.offer(DECODE)
    assert offer is not None
    admitted = host.admit(offer)
    assert admitted is not None
    receiving, advert = admitted
    sending = await prefill.join(DECODE, advert)
    assert sending is not None and sending.key == receiving.key == advert.group
    try:
        received, _ = await asyncio.gather(receiving.recv(len(payload), advert.tag),
                                           sending.send(payload, advert.tag))
        assert received == payload
    finally:
        sending.release()
        receiving.release()
    return advert.group


async def test_one_group_per_pair_reused_then_rebuilt_from_either_side(host: ChannelHost) -> None:
    prefill = DistributedKVTransport(peer_id="prefill-0", host="127.0.0.1", op_timeout=5.0,
                                     grpc=GrpcKVTransport(tls_for("prefill")))
    try:
        key = await one_transfer(host, prefill, b"first")
        assert await one_transfer(host, prefill, bytes(range(256)) * 64) == key
        assert (host.num_built, prefill.num_built) == (1, 1)
        first = prefill.group(DECODE)
        assert first is not None and first.num_bytes == 5 + 256 * 64

        first.broken = True  # prefill saw an op fail: its next offer names the group retired
        offer = prefill.offer(DECODE)
        assert offer is not None and offer.retired_group == key and first.retired
        assert prefill.group(DECODE) is None
        second = await one_transfer(host, prefill, b"second")
        assert second != key and (host.num_built, prefill.num_built) == (2, 2)

        decode_side = host.group("prefill-0")
        assert decode_side is not None
        decode_side.broken = True  # decode saw one fail: it advertises a new group, prefill follows
        third = await one_transfer(host, prefill, b"third")
        assert third not in (key, second) and decode_side.retired
        assert (host.num_built, prefill.num_built) == (3, 3)
    finally:
        await prefill.close()

    restarted = DistributedKVTransport(peer_id="prefill-0", host="127.0.0.1", op_timeout=5.0,
                                     grpc=GrpcKVTransport(tls_for("prefill")))
    try:  # same id, new instance: the old group is retired, the new instance gets its own
        old = host.group("prefill-0")
        assert await one_transfer(host, restarted, b"again") not in (key, second, third)
        assert old is not None and old.retired and host.num_built == 4
    finally:
        await restarted.close()


async def test_a_failed_set_up_falls_back_to_grpc_for_a_while() -> None:
    prefill = DistributedKVTransport(peer_id="prefill-0", host="127.0.0.1", op_timeout=5.0,
                                     grpc=GrpcKVTransport(tls_for("prefill")),
                                     setup_timeout=0.1)  # fmt: skip
    try:
        with socket.socket() as sock:  # a port nothing listens on
            sock.bind(("127.0.0.1", 0))
            nobody = f"127.0.0.1:{sock.getsockname()[1]}"
        assert prefill.offer(DECODE) is not None
        assert await prefill.join(DECODE, ChannelAdvert("gloo", nobody, "gone.1", 1)) is None
        assert prefill.offer(DECODE) is None  # not offered again before RETRY_SECONDS
        other = "decode-1:50051"
        assert await prefill.join(other, ChannelAdvert("nccl", nobody, "gpu.1", 1)) is None
        assert prefill.offer(other) is None and prefill.num_built == 1  # nothing built for nccl
    finally:
        await prefill.close()


async def test_announced_pieces_are_checked_before_anything_is_received(
    host: ChannelHost,
) -> None:
    header = decode_pb2.KVHeader(request_id="r", total_bytes=100)
    announce = decode_pb2.KVChunk(offset=0, crc32=1, first_block=0, num_blocks=1,
                                  channel_bytes=50)  # fmt: skip

    async def stream(*messages: decode_pb2.KVTransferMessage
                     ) -> AsyncIterator[decode_pb2.KVTransferMessage]:
        for message in messages:
            yield message

    not_agreed = _Transfer(host)  # no offer, no advert: nothing may come over the channel
    pieces = not_agreed.messages(stream(decode_pb2.KVTransferMessage(header=header),
                                        decode_pb2.KVTransferMessage(chunk=announce)))
    assert (await anext(pieces)).HasField("header")
    with pytest.raises(DataLossError, match="did not agree"):
        await anext(pieces)

    agreed = _Transfer(host)
    header.channel.CopyFrom(decode_pb2.KVChannelOffer(peer_id="p", peer_instance="i"))
    announce.channel_bytes = 101  # more than the header's payload
    pieces = agreed.messages(stream(decode_pb2.KVTransferMessage(header=header),
                                    decode_pb2.KVTransferMessage(chunk=announce)))
    await anext(pieces)
    assert agreed.admit()  # the go-ahead carries an advert
    with pytest.raises(DataLossError, match="overruns"):
        await anext(pieces)
    agreed.release()
    with pytest.raises(DataLossError, match="did not agree"):  # a plain receiver refuses it too
        check_chunk(announce, 0, 100, 50)
