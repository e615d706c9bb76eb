"""The tokenizer as a pool (issue 32, part 5: no single point left), on the real gateway over
real gRPC servers on 127.0.0.1 that fake the services (tests/gateway_fakes.py): calls spread over
the replicas, a replica that dies (between calls or during one) is retried on another, a replica
serving another model is refused, and ``/ready`` asks only for what serving needs: a tokenizer
replica and a decode worker (prefill is optional: decode workers prefill prompts themselves).
DNS names standing for several tokenizer replicas: tests/test_membership.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp

from services.gateway.state import STATE_KEY
from tests.gateway_fakes import DEFAULT_REPLY, MODEL, Stack, StackFactory, post_raw

CHAT = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


async def _ready(url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(url + "/ready") as r:
        return r.status, await r.json()


async def _until(probe: Callable[[], object], what: str, timeout: float = 5.0) -> Any:
    """Poll ``probe`` (a plain function) until it returns something true; that value."""
    for _ in range(int(timeout / 0.02)):
        value = probe()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


async def _serve_each_kind(stack: Stack) -> None:
    """Each gateway call that needs the tokenizer answers: a chat (Tokenize with the template), a
    text completion (Tokenize), a token-id completion (Detokenize) and ``/tokenize``."""
    status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", CHAT)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["message"]["content"] == DEFAULT_REPLY[:3]
    for prompt in ("x", [104, 105]):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
        status, raw, _ = await post_raw(stack.url + "/v1/completions", body)
        assert status == 200, raw
        assert json.loads(raw)["choices"][0]["text"] == DEFAULT_REPLY[:3]
    status, raw, _ = await post_raw(stack.url + "/tokenize", {"prompt": "hey"})
    assert status == 200 and json.loads(raw)["count"] == 3, raw


async def test_calls_spread_over_replicas_and_a_killed_one_is_retried(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(tokenizer=2)
    for _ in range(2):
        await _serve_each_kind(stack)
    assert all(t.requests for t in stack.tokenizers)  # round-robin over healthy replicas
    dead, alive = stack.tokenizers
    await stack.servers[dead.address].stop(0)
    served_before = len(dead.requests)
    for _ in range(3):  # every call that meets the dead replica first is retried on the other
        await _serve_each_kind(stack)
    assert len(dead.requests) == served_before
    pool = stack.app[STATE_KEY].tokenizers
    assert [r.address for r in pool.replicas() if r.down] == [dead.address]
    status, body = await _ready(stack.url)
    assert status == 200 and body["problems"] == [], body
    entries = {t["address"]: t for t in body["tokenizer"]}
    assert entries[alive.address]["healthy"] and "error" not in entries[alive.address]
    assert not entries[dead.address]["healthy"] and entries[dead.address]["error"]
    # the last replica going too: 503 and not ready, naming every replica
    await stack.servers[alive.address].stop(0)
    status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", CHAT)
    assert status == 503 and json.loads(raw)["error"]["type"] == "service_unavailable", raw
    status, body = await _ready(stack.url)
    assert status == 503 and body["problems"][0].startswith("tokenizer: no healthy replica (of 2)")
    assert dead.address in body["problems"][0] and alive.address in body["problems"][0]
    await stack.settled()


async def test_a_replica_dying_during_a_call_is_retried_on_another(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(tokenizer=2)
    for tokenizer in stack.tokenizers:
        tokenizer.delay = 1.0  # the call is in flight when its replica goes
    request = asyncio.ensure_future(post_raw(stack.url + "/v1/chat/completions", CHAT))
    victim = await _until(lambda: next((t for t in stack.tokenizers if t.requests), None),
                          "a tokenizer got the request")  # fmt: skip
    await stack.servers[victim.address].stop(0)
    status, raw, _ = await request
    assert status == 200, raw
    (other,) = [t for t in stack.tokenizers if t is not victim]
    assert len(other.requests) == 1
    await stack.settled()


async def test_a_replica_serving_another_model_is_refused(make_stack: StackFactory) -> None:
    stack = await make_stack(tokenizer=2)
    first, other = stack.tokenizers
    state = stack.app[STATE_KEY]
    # the first replica asked (the start-up's question, the first in turn) fixes the model
    await _until(lambda: state.model_info is not None, "the gateway knows the model")
    assert [r.checked for r in state.tokenizers.replicas()] == [True, False]
    other.model_fingerprint = "bbbbbbbbbbbbbbbb"  # a fine-tune, or another build
    for _ in range(3):
        await _serve_each_kind(stack)
    assert other.requests == [] and first.requests
    status, body = await _ready(stack.url)
    assert status == 200, body
    entries = {t["address"]: t for t in body["tokenizer"]}
    assert not entries[other.address]["healthy"]
    assert "refused" in entries[other.address]["error"]
    assert "bbbbbbbbbbbbbbbb" in entries[other.address]["error"]
    await stack.settled()


async def test_ready_needs_a_tokenizer_and_a_decode_worker_not_prefill(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack()  # every prompt goes to the prefill pool while it is up
    (prefill,) = [a for a, h in stack.servers.items() if h.service_names == ("tandem.v1.Prefill",)]
    router = stack.app[STATE_KEY].router
    # routed first (the gateway refuses every worker until the tokenizer's fingerprint is known,
    # which would satisfy the wait below before the stop is seen)
    await _until(lambda: router.healthy_count("prefill") == 1, "the prefill worker is routed")
    await stack.servers[prefill].stop(0)
    await _until(lambda: router.healthy_count("prefill") == 0, "the prefill worker is down")
    status, body = await _ready(stack.url)
    assert status == 200 and body["status"] == "ready" and body["problems"] == [], body
    assert [w.split(";")[0] for w in body["warnings"]] == ["prefill: no healthy worker"]
    assert not body["prefill"][0]["healthy"] and body["decode"][0]["healthy"]
    assert [t["healthy"] for t in body["tokenizer"]] == [True]
    status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", CHAT)
    assert status == 200, raw  # prefilled by the decode worker itself
    assert len(stack.decodes[0].local_prefills) == 1 and stack.prefills[0].requests == []
    await stack.servers[stack.decodes[0].address].stop(0)
    await _until(lambda: router.healthy_count("decode") == 0, "the decode worker is down")
    status, body = await _ready(stack.url)
    assert status == 503 and body["problems"] == ["decode: no healthy worker"], body
