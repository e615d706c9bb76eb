"""The gateway's admission and input checks over the fake services (tests/gateway_fakes.py):
``/ready``'s details behind a key, auth, the body limit and rate limits, the in-flight caps (a
429 without queueing; one key cannot take every slot), and malformed bodies answered with
OpenAI's error shape. The rest of the application: test_gateway_app.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest

from services.gateway.config import DEFAULT_MAX_IN_FLIGHT_PER_CLIENT
from services.gateway.state import STATE_KEY
from tests.gateway_fakes import (
    DEFAULT_REPLY,
    MODEL,
    Stack,
    StackFactory,
    post_raw,
)


async def test_ready_details_need_a_key_when_keys_are_configured(make_stack: StackFactory) -> None:
    """With API keys on, ``/ready`` tells an anonymous probe only its status (no internal
    address, worker error or cache statistic); a valid key sees the details, a wrong one 401."""
    stack = await make_stack(keys=("sk-ready-key-123456",))
    async with aiohttp.ClientSession() as s:
        async with s.get(stack.url + "/ready") as r:
            assert r.status == 200 and await r.json() == {"status": "ready"}
            assert stack.decodes[0].address not in await r.text()
        async with s.get(stack.url + "/ready",
                         headers={"Authorization": "Bearer wrong-key-000000"}) as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "invalid_api_key"
        async with s.get(stack.url + "/ready",
                         headers={"Authorization": "Bearer sk-ready-key-123456"}) as r:
            body = await r.json()
            assert r.status == 200 and body["decode"][0]["address"] == stack.decodes[0].address
    await stack.servers[stack.decodes[0].address].stop(0)
    await asyncio.sleep(0.5)  # a poll or two
    async with aiohttp.ClientSession() as s, s.get(stack.url + "/ready") as r:
        assert r.status == 503 and await r.json() == {"status": "not_ready"}


async def test_auth_body_limit_and_rate_limits(make_stack: StackFactory) -> None:
    stack = await make_stack(
        keys=("sk-good-key-123456",), max_body_bytes=2048, rate_limit_rpm=60, rate_limit_burst=2
    )
    url = stack.url + "/v1/completions"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    status, raw, _ = await post_raw(url, body)
    assert status == 401 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    status, raw, _ = await post_raw(url, body, {"Authorization": "Bearer wrong-key-000000"})
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        await stack.client("nope").models.list()
    good = {"Authorization": "Bearer sk-good-key-123456"}
    status, raw, _ = await post_raw(url, {**body, "prompt": "x" * 5000}, good)
    assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"
    status, _, _ = await post_raw(url, body, good)
    assert status == 200
    status, raw, headers = await post_raw(url, body, good)
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert json.loads(raw)["error"]["type"] == "rate_limit_error"
    assert _throttled(stack, "rate_limit_exceeded") == 1
    assert _throttled(stack, "server_overloaded") == 0


def _throttled(stack: Stack, code: str) -> float | None:
    """``tandem:requests_throttled_total{code}`` as the gateway's registry holds it."""
    return stack.metrics.registry.get_sample_value(
        "tandem:requests_throttled_total", {"code": code}
    )


async def test_max_in_flight_rejects_without_queueing(make_stack: StackFactory) -> None:
    stack = await make_stack(max_in_flight=1)
    stack.decodes[0].token_delay = 0.05
    client = stack.client()
    slow = asyncio.create_task(client.completions.create(model=MODEL, prompt="x", max_tokens=10))
    while not stack.decodes[0].streaming.is_set():
        await asyncio.sleep(0.01)
    status, raw, headers = await post_raw(
        stack.url + "/v1/completions", {"model": MODEL, "prompt": "y"}
    )
    assert status == 429 and headers["Retry-After"] == "1"
    assert json.loads(raw)["error"]["code"] == "server_overloaded"
    assert _throttled(stack, "server_overloaded") == 1
    assert len(stack.prefills[0].requests) == 1  # nothing was queued
    assert (await slow).choices[0].text == DEFAULT_REPLY[:10]



async def test_one_key_cannot_take_every_slot(make_stack: StackFactory) -> None:
    """With API keys, one key holds at most its per-client share of the in-flight slots (429
    client_concurrency past it) while another key is still served; without keys, no such cap."""
    stack = await make_stack(keys=("key-one", "key-two"), max_in_flight_per_client=1)
    stack.decodes[0].token_delay = 0.05
    slow = asyncio.create_task(stack.client("key-one").completions.create(
        model=MODEL, prompt="x", max_tokens=10))  # fmt: skip
    while not stack.decodes[0].streaming.is_set():
        await asyncio.sleep(0.01)
    body = {"model": MODEL, "prompt": "y", "max_tokens": 2}
    status, raw, headers = await post_raw(stack.url + "/v1/completions", body,
                                          {"Authorization": "Bearer key-one"})  # fmt: skip
    assert status == 429 and headers["Retry-After"] == "1"
    assert json.loads(raw)["error"]["code"] == "client_concurrency"
    assert _throttled(stack, "client_concurrency") == 1
    status, raw, _ = await post_raw(stack.url + "/v1/completions", body,
                                    {"Authorization": "Bearer key-two"})  # fmt: skip
    assert status == 200, raw
    assert (await slow).choices[0].text == DEFAULT_REPLY[:10]
    open_stack = await make_stack()  # no keys: the default sets no per-client cap
    assert open_stack.app[STATE_KEY].admission.per_client is None
    keyed = await make_stack(keys=("key-one",))
    assert keyed.app[STATE_KEY].admission.per_client == DEFAULT_MAX_IN_FLIGHT_PER_CLIENT

MALFORMED = [
    (b"{not json", 400, None),
    (b"\xff\xfe", 400, None),
    ([1, 2], 400, None),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400,
     "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400,
     "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": "2"}, 400, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": 3}, 400, "stop"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 2100}]}, 400, "messages"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "param"), MALFORMED)
async def test_malformed_chat_bodies(
    make_stack: StackFactory, body: Any, status: int, param: str | None
) -> None:
    stack = await make_stack()
    got, raw, _ = await post_raw(stack.url + "/v1/chat/completions", body)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert stack.prefills[0].requests == []


async def test_malformed_completion_prompts(make_stack: StackFactory) -> None:
    stack = await make_stack()
    url = stack.url + "/v1/completions"
    for prompt, param in ((None, "prompt"), ("", "prompt"), ([0x110000], "prompt"),
                          ([1] * 2100, "prompt")):  # fmt: skip
        got, raw, _ = await post_raw(url, {"model": MODEL, "prompt": prompt})
        assert got == 400, raw
        assert json.loads(raw)["error"]["param"] == param
    got, raw, _ = await post_raw(stack.url + "/v1/nothing", {})
    assert got == 404 and "Invalid URL" in json.loads(raw)["error"]["message"]
    assert stack.prefills[0].requests == []
