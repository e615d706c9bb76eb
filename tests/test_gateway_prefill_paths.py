"""Where a prompt is prefilled and what happens when a decode worker dies, on the gateway over
fake gRPC services (tests/gateway_fakes.py): conditional disaggregation
(services/gateway/prefill_policy.py: short prompts prefilled by their decode worker, a busy or
dead prefill pool, colocated mode with no pool) and migration of a stream whose decode worker
dies mid-stream (services/gateway/choice.py). Real-model checks of both paths are in
test_gateway_e2e.py and test_launcher.py.
"""

from __future__ import annotations

import asyncio

import aiohttp

from services.gateway.prefill_policy import PrefillPolicy
from tests.gateway_fakes import (
    DEFAULT_REPLY,
    FRANCE_REPLY,
    MODEL,
    StackFactory,
    leave_mid_stream,
)


# ---- conditional disaggregation (services/gateway/prefill_policy.py) ---------------------------


async def test_short_prompts_are_prefilled_by_their_decode_worker(make_stack: StackFactory) -> None:
    stack = await make_stack(prefill_policy=PrefillPolicy(remote_min_tokens=40))
    client = stack.client()
    short = await client.completions.create(model=MODEL, prompt="Say", max_tokens=6)
    assert short.choices[0].text == DEFAULT_REPLY[:6]
    assert short.usage.prompt_tokens == 3 and short.usage.completion_tokens == 6
    assert stack.prefills[0].requests == [] and len(stack.decodes[0].local_prefills) == 1
    long_prompt = "France " * 6  # 42 characters = 42 fake tokens
    long = await client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=9)
    assert long.choices[0].text == FRANCE_REPLY[:9]
    assert len(stack.prefills[0].requests) == 1 and len(stack.decodes[0].local_prefills) == 1
    assert await stack.metric('tandem:prefill_path_total{path="local"}') == 1
    assert await stack.metric('tandem:prefill_path_total{path="remote"}') == 1
    await stack.settled()


async def test_a_busy_prefill_pool_sends_prompts_to_decode(make_stack: StackFactory) -> None:
    stack = await make_stack(prefill_policy=PrefillPolicy(remote_min_tokens=0,
                                                          max_prefill_queue=1))  # fmt: skip
    stack.prefills[0].delay = 0.5
    client = stack.client()
    first = asyncio.create_task(client.completions.create(model=MODEL, prompt="a", max_tokens=3))
    await asyncio.sleep(0.1)  # the first prompt is now being prefilled remotely
    second = await client.completions.create(model=MODEL, prompt="b", max_tokens=3)
    assert second.choices[0].text == DEFAULT_REPLY[:3]
    assert (await first).choices[0].text == DEFAULT_REPLY[:3]
    assert len(stack.prefills[0].requests) == 1 and len(stack.decodes[0].local_prefills) == 1
    await stack.settled()


async def test_colocated_gateway_without_prefill_pool(make_stack: StackFactory) -> None:
    stack = await make_stack(prefill=0)
    async with aiohttp.ClientSession() as s, s.get(stack.url + "/ready") as r:
        body = await r.json()
        assert r.status == 200, body
        assert body["prefill"] == []
    stream = await stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "France?"}], max_tokens=12, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == FRANCE_REPLY[:12]
    assert len(stack.decodes[0].local_prefills) == 1
    await stack.settled()


async def test_prefill_pool_down_falls_back_to_local_prefill(make_stack: StackFactory) -> None:
    stack = await make_stack()
    prefill_address = next(
        a for a, h in stack.servers.items() if "tandem.v1.Prefill" in h.service_names
    )
    await stack.servers[prefill_address].stop(0)
    resp = await stack.client().completions.create(model=MODEL, prompt="Say", max_tokens=5)
    assert resp.choices[0].text == DEFAULT_REPLY[:5]
    assert len(stack.decodes[0].local_prefills) == 1
    await stack.settled()


async def test_client_leaving_a_local_prefill_frees_it(make_stack: StackFactory) -> None:
    stack = await make_stack(prefill=0)
    decode = stack.decodes[0]
    await leave_mid_stream(stack)
    await stack.settled(timeout=3.0)
    rid = decode.local_prefills[0]
    for _ in range(100):
        if rid in decode.aborted and rid in decode.cancelled:
            break
        await asyncio.sleep(0.02)
    assert rid in decode.aborted and rid in decode.cancelled


# ---- migration: a decode worker that dies mid-stream ----------------------------------------


async def test_a_stream_migrates_when_its_decode_worker_dies(make_stack: StackFactory) -> None:
    stack = await make_stack(decode=2)
    first, second = stack.decodes
    first.die_after = second.die_after = 10  # whichever serves it dies at token 10
    stream = await stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "France?"}], max_tokens=40,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == FRANCE_REPLY[:40]  # one uninterrupted stream
    assert chunks[-1].usage.completion_tokens == 40
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len(first.generate_ids) == len(second.generate_ids) == 1
    resumed = (second if first.local_prefills == [] else first).local_prefills
    assert resumed and resumed[0].endswith("-r1")
    assert await stack.metric("tandem:migrations_total") == 1
    await stack.settled()


async def test_without_migrations_a_dead_decode_worker_ends_the_stream(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(decode=2, max_migrations=0)
    for decode in stack.decodes:
        decode.die_after = 5
    body = {"model": MODEL, "stream": True, "max_tokens": 30,
            "messages": [{"role": "user", "content": "France?"}]}  # fmt: skip
    async with aiohttp.ClientSession() as s, s.post(stack.url + "/v1/chat/completions",
                                                    json=body) as r:  # fmt: skip
        assert r.status == 200
        raw = (await r.read()).decode()
    assert '"error"' in raw and "Socket closed" in raw
    assert await stack.metric("tandem:migrations_total") == 0
    await stack.settled()
