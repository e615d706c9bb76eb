"""The distributed KV transport's pair groups without the workers (Gloo on loopback): the
go-ahead's advert, the backend choice, the negotiation between a decode worker's ``ChannelHost``
and a prefill worker's ``DistributedKVTransport`` (reuse, retirement from either side, restarts,
a set-up that fails falling back to gRPC), the decode side's checks of announced pieces; the
rendezvous store over a real mutual-TLS gRPC server (``Decode.KVStore``: torch's store
semantics, namespaces per group and per peer, bounds; a client without a certificate or of
another role cannot touch it); and the ``--kv-transport`` flag. The transfers themselves, over
real workers and every cleanup path, are in ``test_prefill_decode.py`` and
``test_prefill_decode_failures.py``."""

from __future__ import annotations

import asyncio
import datetime
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
import torch.distributed as dist

from services.cli import main as tandem_main
from services.common.cert_authority import issue
from services.common.errors import DataLossError, InvalidArgumentError
from services.common.grpc_channel import open_channel
from services.common.grpc_server import GrpcServerHandle, start_grpc_server
from services.common.internal_tls import InternalTls
from services.common.pb import decode_pb2, decode_pb2_grpc
from services.common.peer_roles import peer_identity
from services.engine.kv_transfer.channel_store import MAX_KEYS, MAX_VALUE_BYTES
from services.engine.kv_transfer.checks import check_chunk
from services.engine.kv_transfer.distributed_endpoint import ChannelHost, _Transfer
from services.engine.kv_transfer.distributed_transport import DistributedKVTransport
from services.engine.kv_transfer.grpc_transport import GrpcKVTransport
from services.engine.kv_transfer.pair_group import (
    CHANNEL_KEY,
    STORE_OVER_GRPC,
    ChannelAdvert,
    pair_backend,
)
from services.engine.kv_transfer.remote_store import RemoteStore
from services.engine.runtime.worker_options import WorkerOptions, resolve_kv_transport
from tests.tls_identities import session_ca, tls_for

Op = decode_pb2.KVStoreRequest


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
    advert = ChannelAdvert("gloo", STORE_OVER_GRPC, "ab12cd34.3", 17)
    assert advert.metadata() == (CHANNEL_KEY, "gloo grpc ab12cd34.3 17")
    metadata = (("tandem-kv-accepted", "1"), advert.metadata())
    assert ChannelAdvert.from_metadata(metadata) == advert
    assert ChannelAdvert.from_metadata((("tandem-kv-accepted", "1"),)) is None
    assert ChannelAdvert.from_metadata(((CHANNEL_KEY, "gloo nonsense"),)) is None
    assert pair_backend("cuda:0", "cuda:1") == "nccl"
    assert pair_backend("cuda:0", "cpu") == pair_backend("cpu", "cpu") == "gloo"


# ----------------------------------------------------------------------------- negotiation


def identity(tls: InternalTls) -> str:
    """How the decode server names a caller with ``tls`` on 127.0.0.1 (``peer_identity``)."""
    return peer_identity("ipv4:127.0.0.1:1", {"x509_pem_cert": [tls.cert_pem]})


PREFILL = identity(tls_for("prefill"))


class StoreServicer(decode_pb2_grpc.DecodeServicer):
    """A decode server that serves only ``KVStore``, from a ``ChannelHost`` (as the worker's
    servicer does: ``DecodeWorker.serve_store``)."""

    def __init__(self, host: ChannelHost) -> None:
        self.host = host

    async def KVStore(
        self, request: decode_pb2.KVStoreRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.KVStoreResponse:
        return await self.host.store.serve(
            request, peer_identity(context.peer(), context.auth_context()))


@dataclass
class Decode:
    host: ChannelHost
    server: GrpcServerHandle

    @property
    def address(self) -> str:  # prefill keys its groups by decode's gRPC address
        return self.server.address


@pytest.fixture
async def decode() -> AsyncIterator[Decode]:
    host = ChannelHost(host="127.0.0.1", op_timeout=5.0, setup_timeout=2.0)
    spec = (decode_pb2_grpc.add_DecodeServicer_to_server, StoreServicer(host), "tandem.v1.Decode")
    server = await start_grpc_server([spec], tls=tls_for("decode"), host="127.0.0.1", port=0,
                                     grace=0.1)  # fmt: skip
    yield Decode(host, server)
    host.close()
    await server.stop(0)


@pytest.fixture
def host(decode: Decode) -> ChannelHost:
    return decode.host


async def one_transfer(decode: Decode, prefill: DistributedKVTransport, payload: bytes) -> str:
    """What one TransferKV does for the channel: offer, admit, join, one piece. Returns the key
    of the group both sides used."""
    offer = prefill.offer(decode.address)
    assert offer is not None
    admitted = decode.host.admit(offer, PREFILL)
    assert admitted is not None
    receiving, advert = admitted
    sending = await prefill.join(decode.address, advert)
    assert sending is not None and sending.key == receiving.key == advert.group
    try:
        received, _ = await asyncio.gather(receiving.recv(len(payload), advert.tag),
                                           sending.send(payload, advert.tag))
        assert received == payload
    finally:
        sending.release()
        receiving.release()
    return advert.group


async def test_one_group_per_pair_reused_then_rebuilt_from_either_side(decode: Decode) -> None:
    host, address = decode.host, decode.address
    prefill = DistributedKVTransport(peer_id="prefill-0", host="127.0.0.1", op_timeout=5.0,
                                     grpc=GrpcKVTransport(tls_for("prefill")))
    try:
        key = await one_transfer(decode, prefill, b"first")
        assert await one_transfer(decode, prefill, bytes(range(256)) * 64) == key
        assert (host.num_built, prefill.num_built) == (1, 1)
        first = prefill.group(address)
        assert first is not None and first.num_bytes == 5 + 256 * 64

        first.broken = True  # prefill saw an op fail: its next offer names the group retired
        offer = prefill.offer(address)
        assert offer is not None and offer.retired_group == key and first.retired
        assert prefill.group(address) is None
        second = await one_transfer(decode, prefill, b"second")
        assert second != key and (host.num_built, prefill.num_built) == (2, 2)

        decode_side = host.group("prefill-0")
        assert decode_side is not None
        decode_side.broken = True  # decode saw one fail: it advertises a new group, prefill follows
        third = await one_transfer(decode, prefill, b"third")
        assert third not in (key, second) and decode_side.retired
        assert (host.num_built, prefill.num_built) == (3, 3)
        assert len(host.store) == 1  # retired groups' store namespaces are gone with them
    finally:
        await prefill.close()

    restarted = DistributedKVTransport(peer_id="prefill-0", host="127.0.0.1", op_timeout=5.0,
                                     grpc=GrpcKVTransport(tls_for("prefill")))
    try:  # same id, new instance: the old group is retired, the new instance gets its own
        old = host.group("prefill-0")
        assert await one_transfer(decode, restarted, b"again") not in (key, second, third)
        assert old is not None and old.retired and host.num_built == 4
    finally:
        await restarted.close()


async def test_a_failed_set_up_falls_back_to_grpc_for_a_while() -> None:
    prefill = DistributedKVTransport(peer_id="prefill-0", host="127.0.0.1", op_timeout=5.0,
                                     grpc=GrpcKVTransport(tls_for("prefill")),
                                     setup_timeout=0.1)  # fmt: skip
    try:
        with socket.socket() as sock:  # a port nothing listens on: its store cannot be reached
            sock.bind(("127.0.0.1", 0))
            nobody = f"127.0.0.1:{sock.getsockname()[1]}"
        assert prefill.offer(nobody) is not None
        advert = ChannelAdvert("gloo", STORE_OVER_GRPC, "gone.1", 1)
        assert await prefill.join(nobody, advert) is None
        assert prefill.offer(nobody) is None  # not offered again before RETRY_SECONDS
        other = "decode-1:50051"
        assert await prefill.join(other, ChannelAdvert("nccl", STORE_OVER_GRPC, "gpu.1", 1)) is None
        assert prefill.offer(other) is None and prefill.num_built == 1  # nothing built for nccl
        older = "decode-2:50051"  # an older decode worker's unauthenticated TCPStore: never joined
        tcp_store = ChannelAdvert("gloo", "10.0.0.7:29500", "old.1", 1)
        assert await prefill.join(older, tcp_store) is None
        assert prefill.offer(older) is None and prefill.num_built == 1
    finally:
        await prefill.close()


# ----------------------------------------------------------------------------- the store


async def test_the_store_over_grpc_behaves_as_torch_s_stores_do(decode: Decode) -> None:
    """``RemoteStore`` (prefill) on one group's namespace of decode's ``ChannelStore``: every
    op torch's Store has, through a ``PrefixStore`` as the pair groups use it; decode's own
    rank sees the same keys in-process; a wait that runs out raises torch's DistStoreError."""
    local = decode.host.store.open("g.1", PREFILL)
    tls = GrpcKVTransport(tls_for("prefill"))
    stub = tls.stub(decode.address)

    async def call(request: decode_pb2.KVStoreRequest,
                   deadline: float) -> decode_pb2.KVStoreResponse:  # fmt: skip
        return await stub.KVStore(request, timeout=deadline)

    remote = RemoteStore(call, "g.1", asyncio.get_running_loop(), timeout=1.0)

    def ops() -> None:
        store = dist.PrefixStore("g.1", remote)
        store.set("rank0", b"\x00addr")
        assert store.get("rank0") == b"\x00addr"
        assert local.get("g.1/rank0") == b"\x00addr"  # decode's rank reads it locally
        assert store.add("count", 2) == 2 and store.add("count", 3) == 5
        assert store.check(["rank0", "count"]) and not store.check(["rank1"])
        assert store.compare_set("cas", "", "first") == b"first"
        assert store.compare_set("cas", "wrong", "second") == b"first"
        assert store.num_keys() == 3
        assert store.delete_key("cas") and not store.delete_key("cas")
        store.wait(["rank0"])
        with pytest.raises(dist.DistStoreError, match="UNAVAILABLE|not set within"):
            store.wait(["rank1"], datetime.timedelta(seconds=0.2))

    await asyncio.to_thread(ops)
    waited = asyncio.ensure_future(asyncio.to_thread(lambda: remote.get("g.1/later")))
    await asyncio.sleep(0.1)
    local.set("g.1/later", b"now")  # decode's rank sets a key prefill is waiting for
    assert await waited == b"now"
    await tls.close()


async def test_only_the_prefill_peer_a_group_was_advertised_to_may_touch_its_store(
    decode: Decode,
) -> None:
    """A client without a certificate is refused at the handshake, one of another role by the
    role check, another prefill certificate (another peer) finds no such group; the owner's
    calls are bounded in value size and key count."""
    local = decode.host.store.open("g.1", PREFILL)
    address = decode.address
    request = decode_pb2.KVStoreRequest(group="g.1", op=Op.SET, keys=["rank0"], value=b"x")

    async def code_of(channel: grpc.aio.Channel, req: decode_pb2.KVStoreRequest = request
                      ) -> grpc.StatusCode:  # fmt: skip
        async with channel:
            try:
                await decode_pb2_grpc.DecodeStub(channel).KVStore(req, timeout=5)
            except grpc.aio.AioRpcError as err:
                return err.code()
        return grpc.StatusCode.OK

    no_certificate = grpc.aio.secure_channel(
        address, grpc.ssl_channel_credentials(root_certificates=session_ca().cert_pem),
        options=[("grpc.ssl_target_name_override", "decode.tandem.internal")])
    assert await code_of(grpc.aio.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE
    assert await code_of(no_certificate) == grpc.StatusCode.UNAVAILABLE
    for role in ("gateway", "tokenizer", "decode", "operator"):
        channel = open_channel(address, tls=tls_for(role), server_role="decode")
        assert await code_of(channel) == grpc.StatusCode.PERMISSION_DENIED, role
    other = issue(session_ca(), "prefill")  # a valid prefill certificate of another worker
    other_tls = InternalTls.from_pem(other.cert_pem, other.key_pem, session_ca().cert_pem)
    channel = open_channel(address, tls=other_tls, server_role="decode")
    assert await code_of(channel) == grpc.StatusCode.NOT_FOUND
    assert local.num_keys() == 0  # nobody but its peer set anything

    owner = tls_for("prefill")
    owned = await code_of(open_channel(address, tls=owner, server_role="decode"))
    assert owned == grpc.StatusCode.OK
    assert local.get("rank0") == b"x"
    unknown = decode_pb2.KVStoreRequest(group="g.2", op=Op.GET, keys=["rank0"])
    assert await code_of(open_channel(address, tls=owner, server_role="decode"),
                         unknown) == grpc.StatusCode.NOT_FOUND  # fmt: skip
    big = decode_pb2.KVStoreRequest(group="g.1", op=Op.SET, keys=["big"],
                                    value=bytes(MAX_VALUE_BYTES + 1))  # fmt: skip
    assert await code_of(open_channel(address, tls=owner, server_role="decode"),
                         big) == grpc.StatusCode.RESOURCE_EXHAUSTED  # fmt: skip
    store = decode.host.store.open("g.3", PREFILL)
    for n in range(MAX_KEYS):
        store.set(f"k{n}", b"")
    one_more = decode_pb2.KVStoreRequest(group="g.3", op=Op.ADD, keys=["k-extra"], amount=1)
    assert await code_of(open_channel(address, tls=owner, server_role="decode"),
                         one_more) == grpc.StatusCode.RESOURCE_EXHAUSTED  # fmt: skip


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

    not_agreed = _Transfer(host, PREFILL)  # no offer, no advert: nothing may come over the channel
    pieces = not_agreed.messages(stream(decode_pb2.KVTransferMessage(header=header),
                                        decode_pb2.KVTransferMessage(chunk=announce)))
    assert (await anext(pieces)).HasField("header")
    with pytest.raises(DataLossError, match="did not agree"):
        await anext(pieces)

    agreed = _Transfer(host, PREFILL)
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
