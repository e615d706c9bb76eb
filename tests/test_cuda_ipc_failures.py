"""The CUDA IPC KV transport when things go wrong, and over real gRPC workers.

Over the in-process pair of ``tests/cuda_ipc_pair.py`` (torch's IPC calls faked on CPU):
announcements nobody agreed to are data loss, a failed copy fails the transfer, and an abort or
a lease expiry during a stuck copy frees both sides. Over real gRPC workers: the go-ahead's
advert travels in gRPC metadata, for one GPU and for two.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from services.common.errors import AbortedError, DataLossError, UnavailableError
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
from services.common.wire import sampling_params_to_proto
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.decode.servicer import DecodeServicer
from services.decode.worker import DecodeWorker
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.kv_transfer import KVReceiver, KVSender, ReceiveState
from services.engine.kv_transfer import cuda_ipc
from services.engine.kv_transfer.cuda_ipc import CudaIpcEndpoint, CudaIpcKVTransport, copy_blocks
from services.engine.kv_transfer.grpc_transport import GrpcKVTransport
from services.engine.kv_transfer.transport import KVStream, KVTransport
from services.engine.runtime.engine_loop import EngineLoop
from services.engine.runtime.worker_options import WorkerOptions
from services.engine.runtime.worker_runtime import RoleParts, WorkerHandle, start_worker
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from services.prefill.servicer import PrefillServicer
from services.prefill.worker import PrefillWorker
from tests.cuda_ipc_pair import GPU, GREEDY, FakeIpc, IpcPair, prompt_of
from tests.test_kv_transfer import wait_until
from tests.tls_identities import tls_for


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("dummy:tiny")


# ----------------------------------------------------------------------------- in process


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
