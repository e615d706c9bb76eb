"""The prefill/decode pair the hand-off tests run: a prefill and a decode worker as real gRPC
servers on 127.0.0.1 (both in this process) over a chosen ``--kv-transport`` (``grpc`` or
``distributed``), their stubs, and the helpers the tests share (the in-process engine's greedy
reference, reading a stream, waiting until both sides have freed their KV). Used by
``test_prefill_decode.py``, ``test_prefill_decode_failures.py`` and the other hand-off tests."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest

from services.common.grpc_channel import open_channel
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.common.prefix_hash import reservation_digest
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_to_proto
from services.decode.server import start_decode_worker
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.kv_transfer.distributed_transport import DistributedKVTransport
from services.engine.kv_transfer.pair_group import PairGroup
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.runtime.worker_options import WorkerOptions
from services.engine.runtime.worker_runtime import WorkerHandle
from services.prefill.server import start_prefill_worker
from tests.tls_identities import tls_for

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir))


@pytest.fixture(params=["grpc", "distributed"])
def transport(request: pytest.FixtureRequest) -> str:
    """``--kv-transport`` of both workers of a test's cluster."""
    return str(request.param)


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(5 * i + 11 + offset) % 250 + 3 for i in range(n)]


def reference(model: LoadedModel, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    engine = LLMEngine(model, EngineConfig(num_blocks=128))
    return [out.new_token_ids for out in engine.generate(prompts, params)]


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


@dataclass
class Cluster:
    prefill_handle: WorkerHandle
    decode_handle: WorkerHandle
    prefill_stub: prefill_pb2_grpc.PrefillStub
    decode_stub: decode_pb2_grpc.DecodeStub
    decode_target: str  # where prefill ships KV (the decode worker unless a test says otherwise)

    def generate(self, rid: str, wait: float = 10.0) -> grpc.aio.UnaryStreamCall:
        request = decode_pb2.GenerateRequest(request_id=rid, wait_for_kv_seconds=wait)
        return self.decode_stub.Generate(request)

    async def reserve(
        self, rid: str, prompt: list[int], params: SamplingParams = GREEDY,
        lease_seconds: float = 0.0,
    ) -> decode_pb2.ReserveResponse:
        """What the gateway does before a remote prefill: reserve the decode worker's room for
        this prompt and salt (a transfer without it is refused)."""
        return await self.decode_stub.Reserve(decode_pb2.ReserveRequest(
            request_id=rid, num_tokens=len(prompt), lease_seconds=lease_seconds,
            prompt_digest=reservation_digest(prompt, params.cache_salt)))

    async def prefill(
        self, rid: str, prompt: list[int], params: SamplingParams = GREEDY, *,
        reserve: bool = True, **extra: object,
    ) -> prefill_pb2.PrefillResponse:
        """Prefill ``prompt`` towards the decode target, reserving its room there first (as the
        gateway does) unless ``reserve`` is False or the target is not this cluster's decode
        worker."""
        if reserve and self.decode_target == self.decode_handle.address:
            await self.reserve(rid, prompt, params)
        return await self.prefill_stub.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, token_ids=prompt, params=sampling_params_to_proto(params),
            decode_address=self.decode_target, **extra,
        ))

    async def run(
        self, rid: str, prompt: list[int], params: SamplingParams = GREEDY
    ) -> tuple[prefill_pb2.PrefillResponse, list[decode_pb2.GenerateResponse]]:
        """What the gateway does: open Generate, Prefill (KV goes to decode), read the stream."""
        call = self.generate(rid)
        response = await self.prefill(rid, prompt, params)
        return response, [message async for message in call]

    async def stats(self) -> tuple[common_pb2.WorkerStats, common_pb2.WorkerStats]:
        request = common_pb2.StatsRequest()
        return (await self.prefill_stub.GetStats(request),
                await self.decode_stub.GetStats(request))

    def prefill_group(self) -> PairGroup | None:
        """The prefill worker's pair group with the decode target (distributed only)."""
        transport = self.prefill_handle.worker.sender.transport  # type: ignore[attr-defined]
        return transport.group(self.decode_target) if isinstance(
            transport, DistributedKVTransport) else None

    def decode_group(self) -> PairGroup | None:
        """The decode worker's pair group with the prefill worker (distributed only)."""
        channel = self.decode_handle.worker.channel  # type: ignore[attr-defined]
        return None if channel is None else channel.host.group("prefill-t")

    def groups_built(self) -> tuple[int, int]:
        """Pair groups the prefill and the decode worker built so far (distributed only)."""
        transport = self.prefill_handle.worker.sender.transport  # type: ignore[attr-defined]
        return (transport.num_built,
                self.decode_handle.worker.channel.host.num_built)  # type: ignore[attr-defined]

    async def wait_idle(self) -> None:
        """Poll GetStats on both workers until no KV block is in use."""
        deadline = time.monotonic() + 10
        while True:
            pre, dec = await self.stats()
            if pre.kv_blocks_in_use == 0 and dec.kv_blocks_in_use == 0 and dec.num_running == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"KV still in use: prefill {pre}, decode {dec}")
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def cluster(
    model: LoadedModel,
    *,
    prefill_blocks: int = 64,
    decode_blocks: int = 64,
    prefill_kw: dict[str, object] | None = None,
    decode_kw: dict[str, object] | None = None,
    decode_address: str | None = None,
    decode_max_seqs: int = 64,
    transport: str = "grpc",
    decode_transport: str | None = None,
) -> AsyncIterator[Cluster]:
    decode = await start_decode_worker(
        WorkerOptions(tls=tls_for("decode"),
                      host="127.0.0.1", port=0, num_blocks=decode_blocks, worker_id="decode-t",
                      max_num_seqs=decode_max_seqs, kv_transport=decode_transport or transport),
        loaded=model, **(decode_kw or {}),  # type: ignore[arg-type]
    )
    prefill = await start_prefill_worker(
        WorkerOptions(tls=tls_for("prefill"),
                      host="127.0.0.1", port=0, num_blocks=prefill_blocks, worker_id="prefill-t",
                      kv_transport=transport),
        loaded=model, **(prefill_kw or {}),  # type: ignore[arg-type]
    )
    prefill_channel = open_channel(prefill.address, tls=tls_for("gateway"))
    decode_channel = open_channel(decode.address, tls=tls_for("gateway"))
    c = Cluster(prefill, decode, prefill_pb2_grpc.PrefillStub(prefill_channel),
                decode_pb2_grpc.DecodeStub(decode_channel), decode_address or decode.address)
    try:
        yield c
    finally:
        await prefill_channel.close()
        await decode_channel.close()
        await c.prefill_handle.stop(0.5)  # the current workers: a test may have replaced them
        await c.decode_handle.stop(0.5)


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[decode_pb2.GenerateResponse]:
    """The remaining responses of a stream already read with ``call.read()``."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


def tokens_of(responses: list[decode_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]
