"""Prefill and decode workers as real gRPC servers on 127.0.0.1 (both in this process), with the
KV travelling over ``Decode.TransferKV``: parity with the in-process engine, batching, and every
cleanup path (completion, Abort, client cancel, refusal, corruption, foreign layout, lease
expiry) returning KV blocks in use to zero on both sides — each over both transports
(``transport``: the payload in the gRPC chunks, or over a Gloo pair group with the control on
gRPC), plus the pair group's own life (reuse, a peer dying mid-transfer, restarts)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest

from services.common.cert_authority import issue
from services.common.grpc_channel import open_channel
from services.common.grpc_server import start_grpc_server
from services.common.internal_tls import InternalTls
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.common.peer_roles import peer_identity
from services.common.prefix_hash import reservation_digest
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_to_proto
from services.decode.server import start_decode_worker
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.kv_transfer.distributed_endpoint import ChannelHost
from services.engine.kv_transfer.distributed_transport import DistributedKVTransport
from services.engine.kv_transfer.grpc_transport import ACCEPTED_METADATA
from services.engine.kv_transfer import receiver as receiver_module
from services.engine.kv_transfer.pair_group import PairGroup
from services.engine.kv_transfer.layout import engine_layout
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.runtime.worker_options import WorkerOptions
from services.engine.runtime.worker_runtime import WorkerHandle
from services.prefill.server import start_prefill_worker
from tests.tls_identities import session_ca, tls_for

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


async def test_prefill_to_decode_matches_the_engine_and_frees_everything(
    model: LoadedModel, transport: str
) -> None:
    prompt = prompt_of(40)
    expected = reference(model, [prompt], GREEDY)[0]
    async with cluster(model, transport=transport) as c:
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
        if transport == "distributed":  # both payloads went over one pair group, both ways seen
            sent, received = c.prefill_group(), c.decode_group()
            assert sent is not None and received is not None and sent.key == received.key
            assert sent.num_bytes == received.num_bytes == 2 * pre.kv_bytes


@pytest.mark.parametrize("prefill_side, decode_side", [("distributed", "grpc"),
                                                      ("grpc", "distributed")])
async def test_the_channel_needs_both_ends_else_the_payload_stays_on_grpc(
    model: LoadedModel, prefill_side: str, decode_side: str
) -> None:
    prompt = prompt_of(40)
    expected = reference(model, [prompt], GREEDY)[0]
    async with cluster(model, transport=prefill_side, decode_transport=decode_side) as c:
        _, responses = await c.run("mixed", prompt)
        assert tokens_of(responses) == expected
        assert c.prefill_group() is None and c.decode_group() is None  # never set up
        await c.wait_idle()


async def test_the_channel_store_answers_only_the_prefill_worker_it_was_advertised_to(
    model: LoadedModel,
) -> None:
    """The pair's rendezvous store is ``Decode.KVStore`` on the decode worker's mTLS port: a
    client without a certificate, a gateway's (the wrong role) and another prefill worker's
    (not the peer the group was advertised to) cannot read or write the live group's keys, and
    the pair goes on using its group."""
    async with cluster(model, transport="distributed") as c:
        await c.run("before", prompt_of(40))
        group = c.decode_group()
        assert group is not None
        address = c.decode_handle.address
        probe = decode_pb2.KVStoreRequest(group=group.key, op=decode_pb2.KVStoreRequest.GET,
                                          keys=[f"{group.key}/0"], timeout_seconds=0.1)  # fmt: skip
        other = issue(session_ca(), "prefill")
        other_prefill = InternalTls.from_pem(other.cert_pem, other.key_pem, session_ca().cert_pem)
        clients = {
            "no certificate": (grpc.aio.insecure_channel(address), grpc.StatusCode.UNAVAILABLE),
            "a gateway": (open_channel(address, tls=tls_for("gateway"), server_role="decode"),
                          grpc.StatusCode.PERMISSION_DENIED),
            "another prefill worker": (open_channel(address, tls=other_prefill,
                                                    server_role="decode"),
                                       grpc.StatusCode.NOT_FOUND),
        }  # fmt: skip
        for who, (channel, expected) in clients.items():
            async with channel:
                for request in (probe, decode_pb2.KVStoreRequest(
                        group=group.key, op=decode_pb2.KVStoreRequest.SET,
                        keys=[f"{group.key}/0"], value=b"attacker:1")):  # fmt: skip
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await decode_pb2_grpc.DecodeStub(channel).KVStore(request, timeout=5)
                    assert refused.value.code() == expected, who
        _, responses = await c.run("after", prompt_of(40))
        assert responses[-1].finish_reason == "length"
        assert c.decode_group() is group and not group.broken and c.groups_built() == (1, 1)
        await c.wait_idle()


async def test_concurrent_requests_are_batched_in_decode(
    model: LoadedModel, transport: str
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [prompt_of(20 + 3 * i, offset=i) for i in range(4)]
    expected = reference(model, prompts, params)
    async with cluster(model, transport=transport) as c:
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


async def test_logprobs_travel_with_the_first_token(model: LoadedModel, transport: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    async with cluster(model, transport=transport) as c:
        pre, responses = await c.run("lp", prompt_of(25), params)
        assert pre.HasField("first_logprob") and pre.first_logprob.token_id == pre.first_token_id
        logprobs = [lp for r in responses for lp in r.logprobs]
        assert [lp.token_id for lp in logprobs] == tokens_of(responses)
        assert logprobs[0] == pre.first_logprob
        assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in logprobs)
        assert logprobs[1].top[0].token_id == logprobs[1].token_id  # greedy picks the top one
        await c.wait_idle()


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
        deadline = time.monotonic() + 10
        while (await c.prefill_stub.GetStats(common_pb2.StatsRequest())).kv_blocks_in_use:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)

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
