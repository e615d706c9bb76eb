"""Reserve before compute on a real decode worker (gRPC on 127.0.0.1, the tiny model):
``Decode.Reserve`` holds a request's destination blocks before its prefill starts, refuses at
once when there is no room, and its lease, an Abort or the transfer's header end the
reservation exactly once (services/engine/kv_transfer/receiver.py, state RESERVED). A transfer
needs a reservation for its own prompt and ``cache_salt``: without one, or for another prompt
or salt, it is refused with PERMISSION_DENIED and the reservation stays for the real sender.
The gateway's side (trying another decode worker, waiting, 503) is in
test_gateway_decode_admission.py."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import grpc
import grpc.aio
import pytest

from services.common.pb import common_pb2, decode_pb2
from services.common.prefix_hash import reservation_digest
from services.common.sampling_params import SamplingParams
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.kv_transfer import ReceiveState
from services.engine.kv_transfer.reservations import MAX_RESERVATION_LEASE_SECONDS
from services.engine.kv_transfer.reservation_quota import ReservationQuota
from tests.prefill_decode_cluster import Cluster, cluster, prompt_of, reference, tokens_of, wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir))


async def reserve(
    c: Cluster, rid: str, num_tokens: int, lease_seconds: float = 0.0,
    digest: bytes | None = None,
) -> decode_pb2.ReserveResponse:
    """Reserve ``num_tokens`` for the prompt ``prompt_of(num_tokens)`` with no salt (or for
    ``digest``)."""
    if digest is None:
        digest = reservation_digest(prompt_of(num_tokens), "")
    return await c.decode_stub.Reserve(decode_pb2.ReserveRequest(
        request_id=rid, num_tokens=num_tokens, lease_seconds=lease_seconds,
        prompt_digest=digest))


async def held(c: Cluster, rid: str) -> list[int]:
    """The block ids the decode worker holds for ``rid`` outside any sequence."""
    loop = c.decode_handle.engine_loop
    return await loop.call(lambda engine: list(loop.held_blocks(rid)))


async def in_use(c: Cluster) -> int:
    return (await c.stats())[1].kv_blocks_in_use


def reservations(c: Cluster, outcome: str) -> float:
    counter = c.decode_handle.metrics.kv_reservations.labels(outcome=outcome)
    return counter._value.get()  # type: ignore[attr-defined]


async def test_the_transfer_lands_in_the_reserved_blocks(model: LoadedModel) -> None:
    prompt = prompt_of(40)
    expected = reference(model, [prompt], GREEDY)[0]
    async with cluster(model) as c:
        grant = await reserve(c, "r1", len(prompt))
        assert (grant.request_id, grant.num_blocks, grant.lease_seconds) == ("r1", 3, 30.0)
        assert grant.kv_blocks_free == 64 - 3
        _, dec = await c.stats()
        assert dec.kv_blocks_in_use == 3 and dec.num_waiting == 1  # reserved counts as in use
        assert c.decode_handle.worker.receiver.state("r1") is ReceiveState.RESERVED
        blocks = await held(c, "r1")
        await c.prefill("r1", prompt, GREEDY, reserve=False)  # returns with the ack: KV parked
        assert c.decode_handle.worker.receiver.state("r1") is ReceiveState.COMMITTED
        assert await held(c, "r1") == blocks and await in_use(c) == 3  # no second allocation
        assert tokens_of([m async for m in c.generate("r1")]) == expected
        await c.wait_idle()
        assert reservations(c, "granted") == 1
        assert reservations(c, "refused") == reservations(c, "expired") == 0


async def test_a_header_for_another_prompt_or_salt_is_refused_and_the_reservation_kept(
    model: LoadedModel,
) -> None:
    prompt = prompt_of(40)
    expected = reference(model, [prompt], GREEDY)[0]
    salted = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, cache_salt="other")
    async with cluster(model) as c:
        await reserve(c, "bound", 40)
        blocks = await held(c, "bound")
        receiver = c.decode_handle.worker.receiver
        for other, params in ((prompt_of(40, offset=1), GREEDY),  # same length, other tokens
                              (prompt_of(20), GREEDY),  # another length
                              (prompt, salted)):  # the same prompt under another salt
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.prefill("bound", other, params, reserve=False)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "another prompt or cache_salt" in (err.value.details() or "")
            assert receiver.state("bound") is ReceiveState.RESERVED  # kept for the real one
            assert await held(c, "bound") == blocks
        deadline = time.monotonic() + 10  # prefill frees its KV once the refused transfer ends
        while c.prefill_handle.engine_loop.stats.num_blocks_in_use and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert c.prefill_handle.engine_loop.stats.num_blocks_in_use == 0
        # the real sender still gets the reservation, and the request decodes as it should
        await c.prefill("bound", prompt, GREEDY, reserve=False)
        assert tokens_of([m async for m in c.generate("bound")]) == expected
        await c.wait_idle()


async def test_no_room_is_refused_at_once_and_nothing_is_held(model: LoadedModel) -> None:
    no_quota = ReservationQuota(total_fraction=1.0, caller_fraction=1.0)  # the pool's own bound
    async with cluster(model, decode_blocks=8, decode_kw={"reservation_quota": no_quota}) as c:
        await reserve(c, "fits", 16 * 6)  # 6 of 8 blocks
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await reserve(c, "full", 16 * 3)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - started < 1.0
        assert c.decode_handle.worker.receiver.state("full") is None
        assert await in_use(c) == 6
        assert reservations(c, "refused") == 1 and reservations(c, "granted") == 1
        await c.decode_stub.Abort(common_pb2.AbortRequest(request_id="fits"))
        await c.wait_idle()
        assert (await reserve(c, "now-fits", 16 * 3)).num_blocks == 3  # the room came back
        await c.decode_stub.Abort(common_pb2.AbortRequest(request_id="now-fits"))
        await c.wait_idle()


async def test_an_expired_lease_frees_the_blocks_and_a_late_header_is_refused(
    model: LoadedModel,
) -> None:
    kw: dict[str, object] = {"reservation_lease_seconds": 0.3, "reap_interval": 0.05}
    async with cluster(model, decode_kw=kw) as c:
        receiver = c.decode_handle.worker.receiver
        grant = await reserve(c, "slow", 30)
        assert grant.lease_seconds == 0.3 and await in_use(c) == 2
        short = await reserve(c, "short", 30, lease_seconds=0.1)  # the caller's own lease
        assert short.lease_seconds == 0.1
        await wait_until(lambda: c.decode_handle.engine_loop.stats.num_blocks_in_use == 0)
        assert receiver.state("slow") is None and receiver.state("short") is None  # no tombstone
        assert reservations(c, "expired") == 2
        # The header that arrives too late finds no reservation: refused, both sides free.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill("slow", prompt_of(30), GREEDY, reserve=False)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        await c.wait_idle()
        # a caller never holds the blocks longer than the worker's own lease
        capped = await reserve(c, "long", 30, lease_seconds=MAX_RESERVATION_LEASE_SECONDS)
        assert capped.lease_seconds == 0.3
        await c.decode_stub.Abort(common_pb2.AbortRequest(request_id="long"))
        await c.wait_idle()


async def test_its_holder_renews_a_reservation_and_nobody_else_does(model: LoadedModel) -> None:
    kw: dict[str, object] = {"reservation_lease_seconds": 0.6, "reap_interval": 0.05}
    async with cluster(model, decode_kw=kw) as c:
        receiver = c.decode_handle.worker.receiver

        async def renew(rid: str, num_tokens: int, digest: bytes | None = None) -> float:
            digest = digest or reservation_digest(prompt_of(num_tokens), "")
            reply = await c.decode_stub.Reserve(decode_pb2.ReserveRequest(
                request_id=rid, num_tokens=num_tokens, prompt_digest=digest, renew=True))
            return reply.lease_seconds

        await reserve(c, "queued", 40)
        for _ in range(6):  # 1.8 s in all, three leases: each renewal moves the deadline
            await asyncio.sleep(0.3)
            assert await renew("queued", 40) == 0.6
        assert receiver.state("queued") is ReceiveState.RESERVED and await in_use(c) == 3
        assert reservations(c, "renewed") == 6 and reservations(c, "expired") == 0
        # Another prompt, another size, or no reservation at all: NOT_FOUND, nothing allocated.
        for rid, tokens, digest in (("queued", 40, reservation_digest(prompt_of(41), "")),
                                    ("queued", 20, None), ("nobody", 40, None)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await renew(rid, tokens, digest)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert receiver.state("nobody") is None and await in_use(c) == 3
        # The header takes it over: nothing left to renew; the transfer and decode go on.
        expected = reference(model, [prompt_of(40)], GREEDY)[0]
        await c.prefill("queued", prompt_of(40), GREEDY, reserve=False)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await renew("queued", 40)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert tokens_of([m async for m in c.generate("queued")]) == expected
        # Left alone, a reservation still expires.
        await reserve(c, "left", 40)
        await wait_until(lambda: receiver.state("left") is None)
        assert reservations(c, "expired") == 1
        await c.wait_idle()


async def test_abort_frees_a_reservation_and_refuses_what_follows(model: LoadedModel) -> None:
    async with cluster(model) as c:
        await reserve(c, "gone", 40)
        waiting = c.generate("gone", wait=5.0)  # Generate waits on a reserved request
        reply = await c.decode_stub.Abort(common_pb2.AbortRequest(request_id="gone", reason="t"))
        assert reply.found
        await c.wait_idle()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in waiting:
                pass
        assert err.value.code() == grpc.StatusCode.ABORTED
        for attempt in (reserve(c, "gone", 40), c.prefill("gone", prompt_of(40), reserve=False)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await attempt
            assert err.value.code() == grpc.StatusCode.ABORTED
        await c.wait_idle()
        assert reservations(c, "expired") == 0


async def test_a_transfer_without_a_reservation_is_refused(model: LoadedModel) -> None:
    prompt = prompt_of(25)
    async with cluster(model) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill("plain", prompt, GREEDY, reserve=False)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "holds no KV reservation" in (err.value.details() or "")
        assert dict(err.value.trailing_metadata() or ()).get("tandem-error-code") is not None
        assert c.decode_handle.worker.receiver.state("plain") is None  # nothing was kept
        failures = c.decode_handle.metrics.kv_transfer_failures.labels(reason="refused")
        assert failures._value.get() == 1  # type: ignore[attr-defined]
        await c.wait_idle()
        # the same prompt, reserved first, is served
        _, messages = await c.run("reserved", prompt, GREEDY)
        assert tokens_of(messages) == reference(model, [prompt], GREEDY)[0]
        await c.wait_idle()


@pytest.mark.parametrize(
    ("rid", "num_tokens", "lease", "digest", "param"),
    [
        ("", 10, 0.0, None, "request_id"),
        ("r", 0, 0.0, None, "num_tokens"),
        ("r", 512, 0.0, None, "num_tokens"),  # + the first generated token exceeds the context
        ("r", 10, -1.0, None, "lease_seconds"),
        ("r", 10, math.nan, None, "lease_seconds"),
        ("r", 10, 0.0, b"", "prompt_digest"),  # a reservation that binds no prompt
        ("r", 10, 0.0, b"\0" * 31, "prompt_digest"),
    ],
)
async def test_bad_reservations_are_invalid_arguments(
    model: LoadedModel, rid: str, num_tokens: int, lease: float, digest: bytes | None,
    param: str,
) -> None:
    async with cluster(model) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await reserve(c, rid, num_tokens, lease, digest)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        metadata = dict(err.value.trailing_metadata() or ())
        assert metadata.get("tandem-error-param") == param
        assert await in_use(c) == 0


async def test_a_duplicate_reservation_is_refused(model: LoadedModel) -> None:
    async with cluster(model) as c:
        await reserve(c, "twice", 40)
        for tokens in (40, 20):  # same size or not: one id, one reservation
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await reserve(c, "twice", tokens)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await in_use(c) == 3
        # the transfer takes it: a Reserve now is refused, and so is a second transfer for the id
        await c.prefill("twice", prompt_of(40), reserve=False)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await reserve(c, "twice", 40)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.prefill("twice", prompt_of(40), reserve=False)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [m async for m in c.generate("twice")][-1].finish_reason
        await c.wait_idle()


async def test_a_reserve_cancelled_by_its_client_holds_nothing(model: LoadedModel) -> None:
    async with cluster(model) as c:
        loop = c.decode_handle.engine_loop
        # Hold the engine thread so the allocation is still queued when the client leaves.
        blocker = asyncio.ensure_future(loop.call(lambda engine: time.sleep(0.3)))
        call = c.decode_stub.Reserve(decode_pb2.ReserveRequest(
            request_id="gone", num_tokens=40, prompt_digest=reservation_digest(prompt_of(40), "")))
        await asyncio.sleep(0.1)
        call.cancel()
        await blocker
        await c.wait_idle()
        assert c.decode_handle.worker.receiver.state("gone") is None


def test_the_reservation_lease_flag() -> None:
    from services.cli import build_parser
    from services.common.errors import InvalidArgumentError
    from services.decode.options import check_reservation_lease

    argv = ["serve", "decode", "--reservation-lease-seconds", "5"]
    assert build_parser(argv).parse_args(argv).reservation_lease_seconds == 5.0
    default = ["serve", "decode"]
    assert build_parser(default).parse_args(default).reservation_lease_seconds == 30.0
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(InvalidArgumentError) as err:
            check_reservation_lease(bad)
        assert err.value.param == "reservation_lease_seconds"
