"""Prefill and decode workers as real gRPC servers on 127.0.0.1 (both in this process), with the
KV travelling over ``Decode.TransferKV``: parity with the in-process engine, batching, and every
cleanup path (completion, Abort, client cancel, refusal, corruption, foreign layout, lease
expiry) returning KV blocks in use to zero on both sides."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest

from services.common.grpc_channel import open_channel
from services.common.grpc_server import start_grpc_server
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_to_proto
from services.decode.server import start_decode_worker
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.kv_transfer.grpc_transport import ACCEPTED_METADATA
from services.engine.kv_transfer.layout import engine_layout
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.runtime.worker_options import WorkerOptions
from services.engine.runtime.worker_runtime import WorkerHandle
from services.prefill.server import start_prefill_worker

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir))


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

    async def prefill(
        self, rid: str, prompt: list[int], params: SamplingParams = GREEDY, **extra: object
    ) -> prefill_pb2.PrefillResponse:
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
) -> AsyncIterator[Cluster]:
    decode = await start_decode_worker(
        WorkerOptions(host="127.0.0.1", port=0, num_blocks=decode_blocks, worker_id="decode-t",
                      max_num_seqs=decode_max_seqs),
        loaded=model, **(decode_kw or {}),  # type: ignore[arg-type]
    )
    prefill = await start_prefill_worker(
        WorkerOptions(host="127.0.0.1", port=0, num_blocks=prefill_blocks, worker_id="prefill-t"),
        loaded=model, **(prefill_kw or {}),  # type: ignore[arg-type]
    )
    prefill_channel, decode_channel = open_channel(prefill.address), open_channel(decode.address)
    try:
        yield Cluster(prefill, decode, prefill_pb2_grpc.PrefillStub(prefill_channel),
                      decode_pb2_grpc.DecodeStub(decode_channel), decode_address or decode.address)
    finally:
        await prefill_channel.close()
        await decode_channel.close()
        await prefill.stop(0.5)
        await decode.stop(0.5)


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[decode_pb2.GenerateResponse]:
    """The remaining responses of a stream already read with ``call.read()``."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


def tokens_of(responses: list[decode_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def test_prefill_to_decode_matches_the_engine_and_frees_everything(model: LoadedModel) -> None:
    prompt = prompt_of(40)
    expected = reference(model, [prompt], GREEDY)[0]
    async with cluster(model) as c:
        pre, responses = await c.run("one", prompt)
        assert tokens_of(responses) == expected
        assert pre.first_token_id == expected[0]
        assert responses[0].token_ids[0] == pre.first_token_id
        assert responses[-1].finish_reason == "length"
        assert responses[-1].completion_tokens == GREEDY.max_tokens
        assert all(not r.finish_reason for r in responses[:-1])
        block_bytes = c.prefill_handle.engine_loop.engine.layout.block_bytes
        assert (pre.num_prompt_tokens, pre.num_blocks, pre.kv_bytes) == (40, 3, 3 * block_bytes)
        assert pre.num_cached_tokens == 0 and pre.transfer_seconds > 0 and pre.prefill_seconds > 0
        await c.wait_idle()
        # The prefill worker's prefix cache serves the two full blocks the second time.
        again, responses = await c.run("two", prompt)
        assert again.num_cached_tokens == 32
        assert tokens_of(responses) == expected
        assert [r.num_cached_tokens for r in responses] == [32] * len(responses)  # decode knows too
        await c.wait_idle()
        pre_stats, dec_stats = await c.stats()
        assert (pre_stats.role, dec_stats.role) == ("prefill", "decode")
        assert dec_stats.worker_id == "decode-t" and dec_stats.address == c.decode_handle.address
        assert dec_stats.kv_blocks_total == 64 and dec_stats.block_size == 16
        metrics = c.prefill_handle.metrics
        assert metrics.kv_transfer_bytes._value.get() == 2 * pre.kv_bytes  # type: ignore[attr-defined]
        assert metrics.kv_transfer_seconds._sum.get() > 0  # type: ignore[attr-defined]


async def test_concurrent_requests_are_batched_in_decode(model: LoadedModel) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [prompt_of(20 + 3 * i, offset=i) for i in range(4)]
    expected = reference(model, prompts, params)
    async with cluster(model) as c:
        results = await asyncio.gather(*(c.run(f"b{i}", p, params) for i, p in enumerate(prompts)))
        assert [tokens_of(responses) for _, responses in results] == expected
        assert c.decode_handle.engine_loop.stats.max_batch_size > 1
        await c.wait_idle()


async def test_decode_seat_limit_queues_hand_offs(model: LoadedModel) -> None:
    """--max-num-seqs 1: hand-offs wait for the seat, keep their KV, and give the same tokens;
    a client that gives up while its request waits frees that request's blocks."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [prompt_of(20 + 3 * i, offset=i) for i in range(3)]
    expected = reference(model, prompts, params)
    async with cluster(model, decode_max_seqs=1) as c:
        results = await asyncio.gather(*(c.run(f"q{i}", p, params) for i, p in enumerate(prompts)))
        assert [tokens_of(responses) for _, responses in results] == expected
        assert c.decode_handle.engine_loop.stats.max_batch_size == 1
        await c.wait_idle()
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        seated = c.generate("seated")
        await c.prefill("seated", prompt_of(30), long)
        await seated.read()
        queued = c.generate("queued")
        await c.prefill("queued", prompt_of(25, offset=7), long)
        deadline = time.monotonic() + 10
        while (dec := (await c.stats())[1]).num_waiting < 1:  # until Generate hands it over
            assert time.monotonic() < deadline, dec
            await asyncio.sleep(0.02)
        assert dec.num_running == 1
        queued.cancel()
        seated.cancel()
        await c.wait_idle()


async def test_abort_on_decode_ends_the_stream_and_frees_blocks(model: LoadedModel) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    async with cluster(model) as c:
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


async def test_client_cancelling_generate_frees_blocks(model: LoadedModel) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    async with cluster(model) as c:
        call = c.generate("cx")
        await c.prefill("cx", prompt_of(30), long)
        await call.read()
        await call.read()
        call.cancel()
        await c.wait_idle()


async def test_abort_after_transfer_before_generate_frees_blocks(model: LoadedModel) -> None:
    async with cluster(model) as c:
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


async def test_decode_without_room_refuses_and_both_sides_free(model: LoadedModel) -> None:
    async with cluster(model, decode_blocks=2) as c:
        call = c.generate("big", wait=5.0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill("big", prompt_of(60))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AioRpcError) as gen_err:
            async for _ in call:
                pass
        assert gen_err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await c.wait_idle()
        # A prompt that fits still goes through.
        _, responses = await c.run("small", prompt_of(10))
        assert responses[-1].finish_reason == "length"
        await c.wait_idle()


async def test_prompt_larger_than_the_prefill_pool_is_refused(model: LoadedModel) -> None:
    async with cluster(model, prefill_blocks=2) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill("huge", prompt_of(60))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await c.wait_idle()


async def test_corrupted_chunk_fails_with_data_loss(model: LoadedModel) -> None:
    def flip(index: int, data: bytes) -> bytes:
        return bytes([data[0] ^ 0x01]) + data[1:]

    # Small chunks so the transfer has several and the second is corrupted mid-way.
    kw = {"corrupt_chunk": lambda i, d: flip(i, d) if i == 1 else d, "max_chunk_bytes": 8192}
    async with cluster(model, prefill_kw=kw) as c:
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


async def test_header_from_another_model_is_refused(model: LoadedModel) -> None:
    async with cluster(model) as c:
        layout = engine_layout(c.decode_handle.engine_loop.engine)
        layout.model_fingerprint = "0123456789abcdef"
        header = decode_pb2.KVHeader(
            request_id="foreign", layout=layout, num_tokens=16, num_blocks=1,
            total_bytes=c.decode_handle.engine_loop.engine.layout.block_bytes,
            prompt_token_ids=list(range(3, 19)), num_prompt_tokens=16,
            params=sampling_params_to_proto(GREEDY),
        )
        call = c.decode_stub.TransferKV()
        await call.write(decode_pb2.KVTransferMessage(header=header))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "model_fingerprint" in (err.value.details() or "")
        await c.wait_idle()
        layout_failures = c.decode_handle.metrics.kv_transfer_failures.labels(reason="layout")
        assert layout_failures._value.get() == 1


async def test_logprobs_travel_with_the_first_token(model: LoadedModel) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    async with cluster(model) as c:
        pre, responses = await c.run("lp", prompt_of(25), params)
        assert pre.HasField("first_logprob") and pre.first_logprob.token_id == pre.first_token_id
        logprobs = [lp for r in responses for lp in r.logprobs]
        assert [lp.token_id for lp in logprobs] == tokens_of(responses)
        assert logprobs[0] == pre.first_logprob
        assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in logprobs)
        assert logprobs[1].top[0].token_id == logprobs[1].token_id  # greedy picks the top one
        await c.wait_idle()


class SilentDecode(decode_pb2_grpc.DecodeServicer):
    """Reads a whole transfer and never answers (a hung decode worker)."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def TransferKV(self, request_iterator, context):  # type: ignore[no-untyped-def]
        await context.send_initial_metadata(ACCEPTED_METADATA)
        async for _ in request_iterator:
            pass
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_lease_expires_when_decode_never_acknowledges(model: LoadedModel) -> None:
    silent = SilentDecode()
    server = await start_grpc_server(
        [(decode_pb2_grpc.add_DecodeServicer_to_server, silent, "tandem.v1.Decode")],
        host="127.0.0.1", port=0,
    )
    kw = {"lease_seconds": 0.4, "lease_interval": 0.05}
    try:
        async with cluster(model, prefill_kw=kw, decode_address=server.address) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.prefill("hung", prompt_of(30))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "lease" in (err.value.details() or "")
            await asyncio.wait_for(silent.cancelled.wait(), 5)
            await c.wait_idle()
            assert c.prefill_handle.metrics.kv_transfer_leases_expired._value.get() == 1  # type: ignore[attr-defined]
    finally:
        await server.stop(0)


async def test_prefill_abort_and_deadline(model: LoadedModel) -> None:
    async with cluster(model) as c:
        await c.prefill_stub.Abort(common_pb2.AbortRequest(request_id="early"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill("early", prompt_of(20))
        assert err.value.code() == grpc.StatusCode.ABORTED
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await c.prefill("late", prompt_of(20), deadline_unix=time.time() - 1)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await c.prefill("bad", [])
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
