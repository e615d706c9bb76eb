"""Reserve before compute, the gateway's side (services/gateway/decode_admission.py), over fake
gRPC services (tests/gateway_fakes.py): a remote-prefill choice reserves room on a decode worker
before any prefill starts, goes to another worker when one is full, waits when all are full
(then 503 ``decode_capacity``), and leaves nothing reserved when its client goes away. The
decode worker's own side is in test_kv_reservation.py."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.gateway_fakes import DEFAULT_REPLY, MODEL, StackFactory, post_raw
from tests.tls_identities import tls_flags

BODY = {"model": MODEL, "prompt": "Say hello", "max_tokens": 5}


async def wait_for(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_a_full_decode_worker_refuses_and_another_one_serves(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(decode=2)
    full, roomy = stack.decodes
    full.capacity = 0
    client = stack.client()
    for _ in range(6):  # until the router has preferred the full worker at least once
        resp = await client.completions.create(model=MODEL, prompt="Say", max_tokens=4)
        assert resp.choices[0].text == DEFAULT_REPLY[:4]
        if full.refused:
            break
    assert full.refused and not full.generate_ids  # refused at once, never used
    prefilled_for = {r.decode_address for r in stack.prefills[0].requests}
    assert prefilled_for == {roomy.address}  # no prefill ever ran for the full worker
    assert set(roomy.reserve_ids) == set(roomy.generate_ids)  # each choice reserved first
    assert await stack.metric("tandem:decode_admission_waits_total") == 0
    await stack.settled()


async def test_every_decode_worker_full_waits_then_503(make_stack: StackFactory) -> None:
    stack = await make_stack(decode=2, decode_admission_timeout_s=0.4)
    for decode in stack.decodes:
        decode.capacity = 0
    started = time.monotonic()
    status, raw, headers = await post_raw(stack.url + "/v1/completions", BODY)
    waited = time.monotonic() - started
    error = json.loads(raw)["error"]
    assert status == 503 and error["code"] == "decode_capacity", raw
    assert error["type"] == "service_unavailable" and "retry" in error["message"]
    assert headers["Retry-After"] == "1"
    assert 0.4 <= waited < 3.0
    assert all(len(d.refused) >= 2 for d in stack.decodes)  # asked again while waiting
    assert stack.prefills[0].requests == []  # no prefill work was spent
    assert await stack.metric("tandem:decode_admission_waits_total") == 1
    assert await stack.metric("tandem:decode_admission_timeouts_total") == 1
    await stack.settled()


async def test_room_freed_while_waiting_lets_the_request_through(make_stack: StackFactory) -> None:
    stack = await make_stack(decode_admission_timeout_s=10.0)
    decode = stack.decodes[0]
    decode.capacity = 0
    request = asyncio.create_task(post_raw(stack.url + "/v1/completions", BODY))
    await wait_for(lambda: len(decode.refused) >= 2)
    assert stack.prefills[0].requests == []
    decode.capacity = None  # a running request finished: room again
    status, raw, _ = await request
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["text"] == DEFAULT_REPLY[:5]
    assert len(stack.prefills[0].requests) == 1
    assert await stack.metric("tandem:decode_admission_waits_total") == 1
    assert await stack.metric("tandem:decode_admission_timeouts_total") == 0
    await stack.settled()


async def test_a_client_leaving_while_waiting_leaves_nothing_reserved(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(decode_admission_timeout_s=10.0)
    decode = stack.decodes[0]
    # 1. Waiting in the admission queue (the worker is full), the client goes away.
    decode.capacity = 0
    request = asyncio.create_task(post_raw(stack.url + "/v1/completions", BODY))
    await wait_for(lambda: len(decode.refused) >= 2)
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    await asyncio.sleep(0.3)
    asked = len(decode.reserve_ids)
    decode.capacity = None
    await asyncio.sleep(1.2)  # longer than the longest pause between two rounds
    assert len(decode.reserve_ids) == asked  # it stopped asking
    # 2. The client goes away while a Reserve is in flight (granted, answer not yet back).
    decode.reserve_delay = 1.0
    request = asyncio.create_task(post_raw(stack.url + "/v1/completions", BODY))
    await wait_for(lambda: decode.blocks_in_use > 0)
    rid = decode.reserve_ids[-1]
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    await wait_for(lambda: rid in decode.aborted)  # the gateway aborted what may be granted
    await stack.settled()
    assert stack.prefills[0].requests == [] and decode.generate_ids == []


async def test_a_decode_worker_without_reserve_is_served_as_before(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack()
    decode = stack.decodes[0]
    decode.reserve_supported = False  # an older worker: UNIMPLEMENTED
    resp = await stack.client().completions.create(model=MODEL, prompt="Say", max_tokens=4)
    assert resp.choices[0].text == DEFAULT_REPLY[:4]
    assert decode.reserve_ids == [] and len(stack.prefills[0].requests) == 1
    await stack.settled()


async def test_local_prefill_reserves_nothing(make_stack: StackFactory) -> None:
    stack = await make_stack(prefill=0)
    async with aiohttp.ClientSession() as s, s.post(stack.url + "/v1/completions",
                                                    json=BODY) as r:  # fmt: skip
        assert r.status == 200
    assert stack.decodes[0].reserve_ids == [] and stack.decodes[0].local_prefills
    await stack.settled()


async def test_a_reservation_is_renewed_while_its_prompt_waits_for_prefill(
    make_stack: StackFactory,
) -> None:
    """A prompt queued behind long prefills can wait longer than a reservation's lease: the
    gateway renews it (first after 1 s, then every third of the lease granted) until the prefill
    answers, and not after."""
    stack = await make_stack()
    decode, prefill = stack.decodes[0], stack.prefills[0]
    decode.lease_seconds = 0.6  # renewals every 0.2 s after the first
    prefill.delay = 1.7
    resp = await stack.client().completions.create(model=MODEL, prompt="Say", max_tokens=4)
    assert resp.choices[0].text == DEFAULT_REPLY[:4]
    (rid,) = decode.reserve_ids
    renewed = [at for r, at in decode.renewals if r == rid]
    assert 3 <= len(renewed) <= 5, renewed  # at ~1.0, 1.2, 1.4, 1.6 s
    assert all(b - a >= 0.15 for a, b in zip(renewed, renewed[1:]))
    count = len(decode.renewals)
    prefill.delay = 0.005  # a prompt prefilled at once is never renewed
    await stack.client().completions.create(model=MODEL, prompt="Say", max_tokens=4)
    await asyncio.sleep(1.2)
    assert len(decode.renewals) == count
    await stack.settled()


def test_the_admission_timeout_flag() -> None:
    from services.cli import build_parser
    from services.common.errors import InvalidArgumentError
    from services.gateway.main import config_from_args

    def config(*extra: str):  # type: ignore[no-untyped-def]
        argv = ["serve", "gateway", "--tokenizer", "tok:1", "--decode", "d:5", *extra,
                *tls_flags("gateway")]
        return config_from_args(build_parser(argv).parse_args(argv))

    assert config().decode_admission_timeout_s == 30.0
    assert config("--decode-admission-timeout", "2.5").decode_admission_timeout_s == 2.5
    assert config("--decode-admission-timeout", "0").decode_admission_timeout_s == 0.0
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(InvalidArgumentError) as err:
            config("--decode-admission-timeout", bad)
        assert err.value.param == "decode_admission_timeout"
