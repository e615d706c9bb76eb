"""KV hand-off without sockets: payload chunking and byte copies, wire conversions, and the
sender / receiver state machines over the in-process transport (same code paths as gRPC)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import torch

from services.common.errors import (
    AbortedError,
    DataLossError,
    FailedPreconditionError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)
from services.common.metrics import TandemMetrics
from services.common.pb import common_pb2, decode_pb2
from services.common.prefix_hash import reservation_digest
from services.common.sampling_params import SamplingParams
from services.common.wire import (
    sampling_params_from_proto,
    sampling_params_to_proto,
    token_logprobs_from_proto,
    token_logprobs_to_proto,
)
from services.engine.core import kv_quant
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.runtime.engine_loop import EngineLoop
from services.engine.core.kv_cache import KVLayout, KVPool
from services.engine.kv_transfer import (
    InProcessTransport,
    KVReceiver,
    KVSender,
    PrefilledRequest,
    ReceiveState,
)
from services.engine.kv_transfer.payload import handoff_pool, plan_chunks, read_payload, write_payload
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.core.sampler import TokenLogprobs

Accept = Callable[[], Awaitable[None]] | None
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
DECODE = "decode-0"


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


# ----------------------------------------------------------------------------- pure parts


def test_plan_chunks_whole_blocks_and_split_blocks() -> None:
    plans = plan_chunks(num_blocks=5, block_bytes=100, max_chunk_bytes=250)
    assert [(p.offset, p.length, p.first_block, p.num_blocks) for p in plans] == [
        (0, 200, 0, 2), (200, 200, 2, 2), (400, 100, 4, 1),
    ]
    split = plan_chunks(num_blocks=2, block_bytes=100, max_chunk_bytes=40)
    assert [(p.offset, p.length, p.first_block, p.num_blocks) for p in split] == [
        (0, 40, 0, 1), (40, 40, 0, 1), (80, 20, 0, 1),
        (100, 40, 1, 1), (140, 40, 1, 1), (180, 20, 1, 1),
    ]
    assert plan_chunks(0, 100, 40) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "q8_0"])
def test_payload_roundtrip_whole_and_partial(dtype: str) -> None:
    layout = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    src = KVPool(8, layout)
    if dtype == "q8_0":  # uint8 rows: quants and float16 scales, moved as they are
        src.data.copy_(torch.randint(1, 256, src.data.shape, dtype=torch.uint8))
    else:
        src.data.copy_(torch.randn(src.data.shape))
    dst = KVPool(8, layout)
    src_ids, dst_ids = [5, 1, 6], [0, 7, 3]
    total = len(src_ids) * layout.block_bytes
    for plan in plan_chunks(len(src_ids), layout.block_bytes, max_chunk_bytes=300):
        data = read_payload(src, src_ids, plan.offset, plan.length)
        write_payload(dst, dst_ids, plan.offset, data)
    assert torch.equal(dst.data[dst_ids], src.data[src_ids])
    whole = read_payload(src, src_ids, 0, total)
    assert whole == read_payload(dst, dst_ids, 0, total)
    assert torch.count_nonzero(dst.data[[2, 4, 5, 6]]) == 0  # nothing else was touched
    with pytest.raises(DataLossError):
        read_payload(src, src_ids, 0, total + 1)


def test_sampling_params_wire_roundtrip() -> None:
    params = SamplingParams(
        temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=2**64 - 1, max_tokens=33,
        min_tokens=2, stop=("a", "bc"), stop_token_ids=(3, 4), ignore_eos=True, logprobs=3,
        n=2, skip_special_tokens=False,
    )
    back = sampling_params_from_proto(sampling_params_to_proto(params))
    assert back.seed == -1  # two's complement int64: seeds a generator identically
    assert back == SamplingParams(**{**_fields(params), "seed": -1})
    plain = sampling_params_from_proto(sampling_params_to_proto(SamplingParams()))
    assert plain == SamplingParams()
    lp = TokenLogprobs(7, -0.25, ((7, -0.25), (9, -2.0)))
    assert token_logprobs_from_proto(token_logprobs_to_proto(lp), TokenLogprobs) == lp


def _fields(params: SamplingParams) -> dict[str, object]:
    return {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}


# ----------------------------------------------------------------------------- state machines


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("dummy:tiny")


class Pair:
    """A prefill engine loop + sender and a decode engine loop + receiver, in process."""

    def __init__(
        self, tiny: LoadedModel, *, decode_blocks: int = 64, lease_seconds: float = 30.0,
        park_seconds: float = 30.0, corrupt: Callable[[int, bytes], bytes] | None = None,
        endpoint: object | None = None, max_chunk_bytes: int = 4096,
        kv_cache_dtypes: tuple[str | None, str | None] = (None, None),
    ) -> None:
        self.metrics = TandemMetrics(process_metrics=False)
        prefill_kv, decode_kv = kv_cache_dtypes
        self.prefill = EngineLoop(LLMEngine(tiny, EngineConfig(num_blocks=64, kv_cache_dtype=prefill_kv)),
                                  metrics=self.metrics)
        self.decode = EngineLoop(LLMEngine(tiny, EngineConfig(num_blocks=decode_blocks,
                                                              kv_cache_dtype=decode_kv)))
        self.receiver = KVReceiver(self.decode, park_seconds=park_seconds, reap_interval=0.05)
        self.receives_itself = endpoint is None  # else a stand-in takes the transfers
        transport = InProcessTransport({DECODE: endpoint or self.receiver})  # type: ignore[dict-item]
        self.sender = KVSender(self.prefill, transport, lease_seconds=lease_seconds,
                               lease_interval=0.05, max_chunk_bytes=max_chunk_bytes,
                               metrics=self.metrics, corrupt_chunk=corrupt)

    async def __aenter__(self) -> Pair:
        self.prefill.start()
        self.decode.start()
        self.sender.start()
        self.receiver.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sender.close()
        await self.receiver.close()
        await self.prefill.stop()
        await self.decode.stop()

    async def prefill_and_send(
        self, rid: str, prompt: list[int], wire_params: common_pb2.SamplingParams | None = None,
        *, reserve: bool = True,
    ) -> object:
        """Prefill ``prompt`` and send its KV, after the gateway's reservation on the receiver
        (unless ``reserve`` is False or a stand-in endpoint receives instead)."""
        final = None
        async for out in self.prefill.generate(rid, prompt, GREEDY, prefill_only=True):
            final = out
        assert final is not None and final.finish_reason == "prefilled"
        request = PrefilledRequest(rid, tuple(prompt), GREEDY, final.new_token_ids[0], None,
                                   len(final.block_ids), wire_params=wire_params,
                                   block_ids=tuple(final.block_ids))  # as the prefill worker
        if reserve and self.receives_itself:
            await self.reserve(rid, prompt, wire_params)
        return await self.sender.send(request, DECODE)

    async def reserve(
        self, rid: str, prompt: list[int], wire_params: common_pb2.SamplingParams | None = None
    ) -> None:
        """The gateway's reservation for ``prompt`` (a transfer without one is refused)."""
        salt = wire_params.cache_salt if wire_params is not None else GREEDY.cache_salt
        await self.receiver.reservations.reserve(rid, len(prompt),
                                    prompt_digest=reservation_digest(prompt, salt))

    async def decode_claimed(self, rid: str, timeout: float = 1.0) -> list[int]:
        """Claim ``rid``'s committed KV on the receiver and decode it to the end: its tokens."""
        ready = await self.receiver.claim(rid, timeout)
        tokens: list[int] = []
        async for out in self.decode.generate_prefilled(
            rid, ready.prompt_token_ids, ready.params, first_token_id=ready.first_token_id
        ):
            tokens += out.new_token_ids
        return tokens

    async def idle(self) -> None:
        await wait_until(lambda: self.prefill.stats.num_blocks_in_use == 0
                         and self.decode.stats.num_blocks_in_use == 0)


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 + offset) % 500 + 1 for i in range(n)]


async def test_transfer_then_generate_matches_engine(tiny: LoadedModel) -> None:
    prompt = prompt_of(37)
    reference = LLMEngine(tiny, EngineConfig(num_blocks=64)).generate([prompt], GREEDY)[0]
    async with Pair(tiny) as pair:
        result = await pair.prefill_and_send("r1", prompt)
        assert result.num_blocks == 3 and result.num_chunks > 1  # type: ignore[attr-defined]
        assert pair.receiver.state("r1") is ReceiveState.COMMITTED
        assert await pair.decode_claimed("r1") == reference.new_token_ids
        await pair.idle()
        assert pair.metrics.kv_transfer_bytes._value.get() == result.num_bytes  # type: ignore[attr-defined]


async def test_the_header_forwards_the_params_as_they_arrived(tiny: LoadedModel) -> None:
    """Parameters travel once: prefill forwards the gateway's message, it does not rebuild it
    from its own copy (here they differ on purpose, which never happens in service)."""
    wire = sampling_params_to_proto(GREEDY)
    wire.max_tokens, wire.stop[:] = 5, ["end"]
    async with Pair(tiny) as pair:
        await pair.prefill_and_send("w1", prompt_of(20), wire_params=wire)
        ready = await pair.receiver.claim("w1", 1.0)
        assert ready.params.max_tokens == 5 and ready.params.stop == ("end",)
        assert ready.params == sampling_params_from_proto(wire)
        assert await pair.decode.release("w1")  # the claimed blocks, held for Generate
        await pair.idle()


async def test_claim_waits_for_a_late_transfer(tiny: LoadedModel) -> None:
    async with Pair(tiny) as pair:
        claim = asyncio.create_task(pair.receiver.claim("late", 5.0))
        await asyncio.sleep(0.05)
        await pair.prefill_and_send("late", prompt_of(20))
        ready = await claim
        assert ready.num_blocks == 2
        with pytest.raises(NotFoundError):
            await pair.receiver.claim("never", 0.05)
        await pair.decode.release("late")
        await pair.idle()


async def test_layout_mismatch_is_refused_before_allocating(tiny: LoadedModel) -> None:
    async with Pair(tiny) as pair:
        pair.receiver.layout.model_fingerprint = "another-model"
        with pytest.raises(FailedPreconditionError, match="model_fingerprint"):
            # (checked before the reservation: none needed to see it)
            await pair.prefill_and_send("fp", prompt_of(20), reserve=False)
        await pair.idle()
        assert pair.receiver.state("fp") is None
        failures = pair.metrics.kv_transfer_failures.labels(reason="layout")._value.get()
        assert failures == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_a_16bit_cache_moves_half_the_bytes_and_decodes_as_one_engine(
    tiny: LoadedModel, dtype: str
) -> None:
    """A 16-bit pool hands over its own bytes (half a float32 pool's), exactly: decode then
    continues as a single engine with that cache does."""
    prompt = prompt_of(37)
    reference = LLMEngine(tiny, EngineConfig(num_blocks=64, kv_cache_dtype=dtype)).generate(
        [prompt], GREEDY)[0]  # fmt: skip
    sent = {}
    for kv_dtype in ("float32", dtype):
        async with Pair(tiny, kv_cache_dtypes=(kv_dtype, kv_dtype)) as pair:
            assert pair.decode.engine.kv.data.dtype == getattr(torch, kv_dtype)
            sent[kv_dtype] = await pair.prefill_and_send("h1", prompt)
            ready = await pair.receiver.claim("h1", 1.0)
            tokens: list[int] = []
            async for out in pair.decode.generate_prefilled(
                "h1", ready.prompt_token_ids, ready.params, first_token_id=ready.first_token_id
            ):
                tokens += out.new_token_ids
            if kv_dtype == dtype:
                assert tokens == reference.new_token_ids
            await pair.idle()
    assert sent[dtype].num_bytes * 2 == sent["float32"].num_bytes  # type: ignore[attr-defined]
    assert sent[dtype].num_blocks == sent["float32"].num_blocks  # type: ignore[attr-defined]


async def test_a_q8_0_cache_ships_its_blocks_as_stored_and_decodes_as_one_engine(
    tiny: LoadedModel,
) -> None:
    """A ``q8_0`` pool hands over its quantized blocks as they are (int8 quants and float16
    scales: about half a float16 pool's bytes), and decode goes on exactly as one engine with
    that cache does."""
    prompt = prompt_of(37)
    reference = LLMEngine(tiny, EngineConfig(num_blocks=64, kv_cache_dtype="q8_0")).generate(
        [prompt], GREEDY)[0]  # fmt: skip
    sent = {}
    for kv_dtype in ("float16", "q8_0"):
        async with Pair(tiny, kv_cache_dtypes=(kv_dtype, kv_dtype)) as pair:
            sent[kv_dtype] = await pair.prefill_and_send("q1", prompt)
            ready = await pair.receiver.claim("q1", 1.0)
            tokens: list[int] = []
            async for out in pair.decode.generate_prefilled(
                "q1", ready.prompt_token_ids, ready.params, first_token_id=ready.first_token_id
            ):
                tokens += out.new_token_ids
            if kv_dtype == "q8_0":
                assert pair.decode.engine.kv.data.dtype == torch.uint8
                assert tokens == reference.new_token_ids
            await pair.idle()
    head_dim = tiny.config.head_dim
    q8, f16 = sent["q8_0"].num_bytes, sent["float16"].num_bytes  # type: ignore[attr-defined]
    assert q8 * 2 * head_dim == f16 * kv_quant.row_bytes(head_dim)
    assert sent["q8_0"].num_blocks == sent["float16"].num_blocks  # type: ignore[attr-defined]


@pytest.mark.parametrize(("prefill", "decode"), [("bfloat16", "float32"), ("q8_0", "float16")])
async def test_a_kv_cache_dtype_mismatch_is_refused(
    tiny: LoadedModel, prefill: str, decode: str
) -> None:
    async with Pair(tiny, kv_cache_dtypes=(prefill, decode)) as pair:
        with pytest.raises(FailedPreconditionError,
                           match=f"dtype '{prefill}' is not this worker's.*--kv-cache-dtype") as err:
            await pair.prefill_and_send("mm", prompt_of(20), reserve=False)
        assert decode not in err.value.message  # the receiver's own layout is not echoed
        await pair.idle()
        assert pair.receiver.state("mm") is None


async def test_no_room_on_decode_is_refused_cleanly(tiny: LoadedModel) -> None:
    async with Pair(tiny, decode_blocks=2) as pair:
        with pytest.raises(ResourceExhaustedError):  # the reservation finds no room
            await pair.reserve("big", prompt_of(60))
        assert pair.receiver.state("big") is None  # nothing held
        with pytest.raises(PermissionDeniedError, match="no KV reservation"):  # KV sent anyway
            await pair.prefill_and_send("big", prompt_of(60), reserve=False)
        await pair.idle()
        assert pair.receiver.state("big") is None
        failures = pair.metrics.kv_transfer_failures.labels(reason="refused")
        assert failures._value.get() == 1  # type: ignore[attr-defined]


async def test_a_transfer_is_refused_without_its_reservation(tiny: LoadedModel) -> None:
    salted = sampling_params_to_proto(SamplingParams(temperature=0.0, max_tokens=12,
                                                     ignore_eos=True, cache_salt="tenant-b"))
    async with Pair(tiny) as pair:
        prompt = prompt_of(40)
        with pytest.raises(PermissionDeniedError, match="no KV reservation"):
            await pair.prefill_and_send("none", prompt, reserve=False)
        await pair.reserve("bound", prompt)  # reserved for the prompt with no salt
        for other, params in ((prompt_of(40, offset=1), None), (prompt, salted)):
            with pytest.raises(PermissionDeniedError, match="another prompt or cache_salt"):
                await pair.prefill_and_send("bound", other, params, reserve=False)
            assert pair.receiver.state("bound") is ReceiveState.RESERVED  # kept
        await pair.prefill_and_send("bound", prompt, reserve=False)  # the reserved one lands
        ready = await pair.receiver.claim("bound", 1.0)
        assert ready.prompt_token_ids == tuple(prompt)
        await pair.decode.release("bound")
        await pair.idle()


async def test_corrupt_chunk_fails_with_data_loss_and_frees_both_sides(tiny: LoadedModel) -> None:
    def flip(index: int, data: bytes) -> bytes:
        return data if index != 1 else data[:10] + bytes([data[10] ^ 0xFF]) + data[11:]

    async with Pair(tiny, corrupt=flip) as pair:
        with pytest.raises(DataLossError, match="crc32"):
            await pair.prefill_and_send("bad", prompt_of(40))
        await pair.idle()
        with pytest.raises(DataLossError):  # a waiting Generate learns why at once
            await pair.receiver.claim("bad", 1.0)


class SilentDecode:
    """Reads the whole transfer, then never acknowledges."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def receive(
        self, messages: AsyncIterator[decode_pb2.KVTransferMessage], on_accept: Accept = None
    ) -> object:
        if on_accept is not None:
            await on_accept()
        async for _ in messages:
            pass
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_lease_expires_when_decode_never_acknowledges(tiny: LoadedModel) -> None:
    silent = SilentDecode()
    async with Pair(tiny, lease_seconds=0.3, endpoint=silent) as pair:
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="lease"):
            await pair.prefill_and_send("quiet", prompt_of(30))
        assert 0.25 < time.monotonic() - started < 5
        assert silent.cancelled.is_set()
        await pair.idle()
        assert pair.metrics.kv_transfer_leases_expired._value.get() == 1
        assert pair.metrics.kv_transfer_failures.labels(reason="timeout")._value.get() == 1


async def test_a_slow_transfer_that_makes_progress_outlives_its_lease(tiny: LoadedModel) -> None:
    """The lease bounds a stall, not a transfer: each chunk the receiver takes renews it (a
    4k-token prompt's KV into a busy decode worker can take longer than the lease in all)."""

    class Slow:
        def __init__(self, inner: KVReceiver) -> None:
            self.inner = inner
            self.chunks = 0

        async def receive(
            self, messages: AsyncIterator[decode_pb2.KVTransferMessage], on_accept: Accept = None
        ) -> object:
            async def slow() -> AsyncIterator[decode_pb2.KVTransferMessage]:
                async for message in messages:
                    if message.WhichOneof("kind") == "chunk":
                        self.chunks += 1
                        await asyncio.sleep(0.04)  # 13 chunks: longer than the lease in all
                    yield message

            return await self.inner.receive(slow(), on_accept)

    prompt = prompt_of(200)
    reference = LLMEngine(tiny, EngineConfig(num_blocks=64)).generate([prompt], GREEDY)[0]
    async with Pair(tiny, lease_seconds=0.3) as pair:
        pair.sender.max_chunk_bytes = handoff_pool(pair.prefill.engine).layout.block_bytes
        slow = Slow(pair.receiver)
        pair.sender.transport.endpoints[DECODE] = slow  # type: ignore[attr-defined]
        started = time.monotonic()
        await pair.prefill_and_send("slow", prompt)
        assert slow.chunks == 13 and time.monotonic() - started > 0.4  # longer than the lease
        assert pair.metrics.kv_transfer_leases_expired._value.get() == 0
        assert await pair.decode_claimed("slow", 5.0) == reference.new_token_ids
        await pair.idle()


async def test_committed_kv_nobody_claims_is_freed(tiny: LoadedModel) -> None:
    async with Pair(tiny, park_seconds=0.2) as pair:
        await pair.prefill_and_send("orphan", prompt_of(30))
        assert pair.decode.stats.num_held_requests == 1 or pair.receiver.num_pending == 1
        await pair.idle()
        with pytest.raises(UnavailableError, match="no Generate"):
            await pair.receiver.claim("orphan", 0.1)


async def test_abort_mid_transfer_frees_both_sides(tiny: LoadedModel) -> None:
    gate = asyncio.Event()

    class Gated:
        def __init__(self, inner: KVReceiver) -> None:
            self.inner = inner

        async def receive(
            self, messages: AsyncIterator[decode_pb2.KVTransferMessage], on_accept: Accept = None
        ) -> object:
            async def slow() -> AsyncIterator[decode_pb2.KVTransferMessage]:
                async for message in messages:
                    if message.WhichOneof("kind") == "chunk":
                        gate.set()
                        await asyncio.sleep(0.05)
                    yield message

            return await self.inner.receive(slow(), on_accept)

    async with Pair(tiny) as pair:
        pair.sender.transport.endpoints[DECODE] = Gated(pair.receiver)  # type: ignore[attr-defined]
        send = asyncio.create_task(pair.prefill_and_send("ab", prompt_of(60)))
        await gate.wait()
        assert pair.sender.abort("ab")
        assert pair.receiver.abort("ab")
        await pair.decode.abort("ab")
        with pytest.raises(AbortedError):
            await send
        await pair.idle()
        assert pair.receiver.state("ab") is ReceiveState.FAILED
