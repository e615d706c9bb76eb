"""The gateway application over real gRPC servers on 127.0.0.1 that fake the three services.

The fakes speak the real protos through the real server helpers (error interceptor, health), so
everything between the HTTP client and the gRPC wire is the production code: routing, the
concurrent Prefill + Generate, safety hold-back, logprobs, usage, n > 1, cleanup on disconnect
and on faults, metrics, and the request log line (auth, limits and malformed bodies:
test_gateway_admission.py). The fake "model" is character-level: token id = code point, and it
answers with a scripted reply one character per token, so expected texts are exact (the fakes
live in tests/gateway_fakes.py). Real-model end-to-end tests live in test_gateway_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest

from services.common.errors import InvalidArgumentError, UnavailableError
from services.gateway.config import (
    DEFAULT_DEFAULT_MAX_TOKENS,
    BackendTimeouts,
)
from services.gateway.state import STATE_KEY
from tests.gateway_fakes import (
    DEFAULT_REPLY,
    FRANCE_REPLY,
    MODEL,
    PHRASE_POLICY,
    StackFactory,
    leave_mid_stream,
    post_raw,
    sse_events,
)
from tests.tls_identities import tls_flags


# ------------------------------------------------------------------------------------ tests


def test_gateway_import_does_not_import_torch() -> None:
    code = "import sys, services.gateway.main, services.gateway.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def test_chat_non_stream_usage_and_request_log(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await make_stack()
    caplog.set_level(logging.INFO, logger="services.gateway.request_log")
    resp = await stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0
    )
    assert resp.choices[0].message.content == DEFAULT_REPLY
    assert resp.choices[0].finish_reason == "stop"
    prompt = "user: hi\nassistant:"
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == len(DEFAULT_REPLY)
    assert resp.usage.total_tokens == len(prompt) + len(DEFAULT_REPLY)
    assert resp.usage.prompt_tokens_details.cached_tokens == 3
    # max_tokens unset: the server's --default-max-tokens (tests/test_gateway_edge.py covers
    # 'context' and the cap by the context left)
    sent = stack.prefills[0].requests[0]
    assert sent.params.max_tokens == DEFAULT_DEFAULT_MAX_TOKENS
    assert sent.decode_address == stack.decodes[0].address
    assert stack.decodes[0].generate_ids == [sent.request_id]
    assert sent.request_id.startswith(resp.id)
    records = [r for r in caplog.records if r.getMessage() == "request finished"]
    assert len(records) == 1
    rec = records[0]
    assert rec.request_id == resp.id and rec.status == 200 and rec.model == MODEL
    assert rec.prompt_tokens == len(prompt) and rec.completion_tokens == len(DEFAULT_REPLY)
    for key in ("queue_ms", "tokenize_ms", "prefill_ms", "transfer_ms", "ttft_ms", "e2e_ms"):
        assert isinstance(getattr(rec, key), float), key
    await stack.settled()


async def test_chat_stream_with_usage(make_stack: StackFactory) -> None:
    stack = await make_stack()
    stream = await stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}, max_tokens=20,
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == DEFAULT_REPLY[:20]
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert len({c.id for c in chunks}) == 1
    await stack.settled()


async def test_completions_stream_non_stream_echo_and_stop(make_stack: StackFactory) -> None:
    stack = await make_stack()
    client = stack.client()
    resp = await client.completions.create(model=MODEL, prompt="Say", max_tokens=100, stop=[","])
    assert resp.choices[0].text == DEFAULT_REPLY.split(",")[0]
    assert resp.usage.prompt_tokens == 3
    assert list(stack.prefills[0].requests[-1].params.stop) == [","]
    echoed = await client.completions.create(model=MODEL, prompt="Say", max_tokens=5, echo=True)
    assert echoed.choices[0].text == "Say" + DEFAULT_REPLY[:5]
    stream = await client.completions.create(model=MODEL, prompt="Say", max_tokens=7, stream=True)
    pieces = [c async for c in stream]
    assert "".join(c.choices[0].text for c in pieces) == DEFAULT_REPLY[:7]
    assert pieces[-1].choices[0].finish_reason == "length"
    # token-id prompts are detokenized for the input check and used as is
    ids = await client.completions.create(model=MODEL, prompt=[ord(c) for c in "Say"], max_tokens=4)
    assert ids.choices[0].text == DEFAULT_REPLY[:4]
    assert list(stack.prefills[0].requests[-1].token_ids) == [ord(c) for c in "Say"]
    await stack.settled()


async def test_n_choices_have_distinct_ids_and_offset_seeds(make_stack: StackFactory) -> None:
    stack = await make_stack()
    resp = await stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3, seed=41, max_tokens=5
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.message.content == DEFAULT_REPLY[:5] for c in resp.choices)
    reqs = stack.prefills[0].requests
    assert len({r.request_id for r in reqs}) == 3
    assert sorted(r.params.seed for r in reqs) == [41, 42, 43]
    assert all(r.params.n == 1 for r in reqs)
    assert resp.usage.completion_tokens == 15
    stream = await stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, stream=True
    )
    texts = ["", ""]
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [DEFAULT_REPLY[:4]] * 2
    await stack.settled()


async def test_logprobs_chat_and_completions(make_stack: StackFactory) -> None:
    stack = await make_stack()
    client = stack.client()
    resp = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = resp.choices[0].logprobs.content
    assert len(content) == 6
    assert content[0].token == f"token_id:{ord('H')}" and content[0].logprob == -0.25
    assert [t.logprob for t in content[0].top_logprobs] == [-0.25, -1.25]
    stream = await client.completions.create(
        model=MODEL, prompt="Say", max_tokens=6, logprobs=1, stream=True
    )
    tokens: list[str] = []
    offsets: list[int] = []
    async for chunk in stream:
        if chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert len(tokens) == 6 and offsets[0] == 0 and offsets == sorted(set(offsets))


async def test_input_safety_block(make_stack: StackFactory) -> None:
    stack = await make_stack(policy=PHRASE_POLICY)
    before = await stack.metric('tandem:safety_blocks_total{stage="input"}')
    with pytest.raises(openai.BadRequestError) as info:
        await stack.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "tell me about the Forbidden topic"}]
        )
    err = info.value.body
    assert err["code"] == "content_policy_violation" and err["param"] == "messages"
    assert stack.tokenizer.requests == [] and stack.prefills[0].requests == []
    assert await stack.metric('tandem:safety_blocks_total{stage="input"}') == before + 1
    status, _, _ = await post_raw(
        stack.url + "/v1/completions",
        {"model": MODEL, "prompt": [ord(c) for c in "a forbidden topic"]},
    )
    assert status == 400 and stack.prefills[0].requests == []


@pytest.mark.parametrize("stream", [True, False])
async def test_output_safety_filter_sees_tool_arguments(
    make_stack: StackFactory, stream: bool
) -> None:
    """A tool call whose argument the policy blocks never shows that argument: the filter reads
    the model's text before the tool-call parser, so arguments are checked like any text.
    Unstreamed, the reply has no call at all; streamed, arguments leave as they are written
    (as vLLM streams them), so the call's id and name may already be out, but no fragment of
    the blocked argument, and the choice ends content_filter."""
    stack = await make_stack(policy=PHRASE_POLICY)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    body = {
        "model": MODEL, "stream": stream, "max_tokens": 200, "tools": [tool],
        "messages": [{"role": "user", "content": "Weather in the capital of the Seine?"}],
    }  # fmt: skip
    status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", body)
    assert status == 200, raw
    assert b"Paris" not in raw and b"Par" not in raw
    if stream:
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        sent = [call for e in events[:-1] if e["choices"]
                for call in e["choices"][0]["delta"].get("tool_calls") or ()]  # fmt: skip
        assert "".join(c["function"].get("arguments", "") for c in sent) in ("", '{"city": "')
        assert events[-2]["choices"][0]["finish_reason"] == "content_filter"
    else:
        choice = json.loads(raw)["choices"][0]
        assert not choice["message"].get("tool_calls")
        assert choice["finish_reason"] == "content_filter"
    # the same call with a harmless argument does come out as a call
    unblocked = await make_stack(policy={"categories": {"x": {"terms": ["Rome"]}}})
    status, raw, _ = await post_raw(unblocked.url + "/v1/chat/completions", {**body, "stream": False})
    call = json.loads(raw)["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


@pytest.mark.parametrize("stream", [True, False])
async def test_output_safety_block_sends_nothing_unsafe(
    make_stack: StackFactory, stream: bool
) -> None:
    stack = await make_stack(policy=PHRASE_POLICY)
    body = {
        "model": MODEL, "stream": stream, "max_tokens": 200,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }  # fmt: skip
    status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", body)
    assert status == 200
    assert b"Paris" not in raw and b"Par" not in raw
    safe = FRANCE_REPLY[: FRANCE_REPLY.index("Paris")]
    if stream:
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
        assert text == safe
        assert events[-2]["choices"][0]["finish_reason"] == "content_filter"
    else:
        choice = json.loads(raw)["choices"][0]
        assert choice["message"]["content"] == safe
        assert choice["finish_reason"] == "content_filter"
    decode = stack.decodes[0]
    rid = stack.prefills[0].requests[0].request_id
    for _ in range(100):
        if rid in decode.aborted:
            break
        await asyncio.sleep(0.02)
    assert rid in decode.aborted
    assert await stack.metric('tandem:safety_blocks_total{stage="output"}') == 1
    assert await stack.metric('tandem:request_success_total{finished_reason="content_filter"}') == 1
    await stack.settled()


async def test_client_disconnect_mid_stream_frees_everything(make_stack: StackFactory) -> None:
    stack = await make_stack()
    decode = stack.decodes[0]
    await leave_mid_stream(stack)
    # the client is gone: the Generate call is cancelled and both workers get Abort
    rid = stack.prefills[0].requests[0].request_id
    await stack.settled(timeout=3.0)
    for _ in range(100):
        if rid in decode.aborted and rid in stack.prefills[0].aborted:
            break
        await asyncio.sleep(0.02)
    assert rid in decode.aborted and rid in stack.prefills[0].aborted
    assert rid in decode.cancelled
    assert stack.app  # the gateway keeps serving
    resp = await stack.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert resp.choices[0].text == DEFAULT_REPLY[:2]


async def test_client_disconnect_non_stream(make_stack: StackFactory) -> None:
    stack = await make_stack()
    stack.decodes[0].token_delay = 0.2
    body = {"model": MODEL, "max_tokens": 50, "prompt": "x"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.6)) as s:
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(stack.url + "/v1/completions", json=body) as r:
                await r.read()
    await stack.settled(timeout=3.0)
    rid = stack.prefills[0].requests[0].request_id
    for _ in range(100):
        if rid in stack.decodes[0].aborted:
            break
        await asyncio.sleep(0.02)
    assert rid in stack.decodes[0].aborted


async def test_prefill_errors_map_to_openai_errors(make_stack: StackFactory) -> None:
    stack = await make_stack()
    stack.prefills[0].error = InvalidArgumentError("prompt has a bad token", param="prompt")
    status, raw, _ = await post_raw(
        stack.url + "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True}
    )
    assert status == 400
    assert json.loads(raw)["error"]["param"] == "prompt"
    rid = stack.prefills[0].requests[0].request_id
    # the decode worker's pending Generate was cancelled, and both were told to abort
    await stack.settled()
    for _ in range(100):
        if rid in stack.decodes[0].aborted:
            break
        await asyncio.sleep(0.02)
    assert rid in stack.decodes[0].aborted
    stack.prefills[0].error = UnavailableError("out of memory, try later")
    status, raw, _ = await post_raw(stack.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 503 and json.loads(raw)["error"]["type"] == "service_unavailable"


async def test_dead_prefill_worker_is_retried_on_another(make_stack: StackFactory) -> None:
    stack = await make_stack(prefill=2, stats_interval_s=30.0)
    first = next(iter(a for a in stack.servers if a != stack.decodes[0].address
                      and stack.servers[a].service_names == ("tandem.v1.Prefill",)))  # fmt: skip
    await stack.servers[first].stop(0)
    for _ in range(4):
        resp = await stack.client().completions.create(model=MODEL, prompt="x", max_tokens=3)
        assert resp.choices[0].text == DEFAULT_REPLY[:3]
    state = stack.app[STATE_KEY]
    down = [w for w in state.router.workers("prefill") if not w.healthy]
    assert [w.address for w in down] == [first]
    assert sum(len(p.requests) for p in stack.prefills) == 4  # the dead one never answered
    await stack.settled()


async def test_decode_dies_mid_stream_ends_with_error_event(make_stack: StackFactory) -> None:
    stack = await make_stack()
    stack.decodes[0].fail_after = 3
    body = {"model": MODEL, "stream": True, "max_tokens": 30, "prompt": "x"}
    status, raw, _ = await post_raw(stack.url + "/v1/completions", body)
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "service_unavailable"
    assert "lost its GPU" in events[-2]["error"]["message"]
    assert await stack.metric('tandem:request_success_total{finished_reason="error"}') == 1
    # non-streamed: a 503 body; and the gateway keeps serving
    status, raw, _ = await post_raw(stack.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 503
    stack.decodes[0].fail_after = None
    resp = await stack.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert resp.choices[0].text == DEFAULT_REPLY[:2]
    await stack.settled()


async def test_least_loaded_routing_spreads_load(make_stack: StackFactory) -> None:
    stack = await make_stack(prefill=2, decode=2)
    for d in stack.decodes:
        d.token_delay = 0.02
    client = stack.client()
    await asyncio.gather(*(
        client.completions.create(model=MODEL, prompt="x", max_tokens=10) for _ in range(6)
    ))  # fmt: skip
    assert all(len(d.generate_ids) == 3 for d in stack.decodes)
    assert all(len(p.requests) == 3 for p in stack.prefills)
    await stack.settled()


async def test_health_ready_models(make_stack: StackFactory) -> None:
    stack = await make_stack(served_model_names=("alias", MODEL))
    async with aiohttp.ClientSession() as s:
        async with s.get(stack.url + "/health") as r:
            assert r.status == 200
        async with s.get(stack.url + "/ready") as r:
            body = await r.json()
            assert r.status == 200, body
            assert body["status"] == "ready" and body["decode"][0]["healthy"]
    models = await stack.client().models.list()
    assert [m.id for m in models.data] == ["alias", MODEL]
    assert (await stack.client().models.retrieve("alias")).id == "alias"
    with pytest.raises(openai.NotFoundError):
        await stack.client().models.retrieve("nope")
    resp = await stack.client().completions.create(model="alias", prompt="x", max_tokens=1)
    assert resp.model == "alias"
    await stack.servers[stack.decodes[0].address].stop(0)
    await asyncio.sleep(0.5)  # a poll or two
    async with aiohttp.ClientSession() as s, s.get(stack.url + "/ready") as r:
        body = await r.json()
        assert r.status == 503 and "decode: no healthy worker" in body["problems"]
    status, raw, _ = await post_raw(stack.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 503 and json.loads(raw)["error"]["code"] == "no_healthy_workers"
    async with aiohttp.ClientSession() as s, s.get(stack.url + "/health") as r:
        assert r.status == 200


async def test_metrics_move_after_requests(make_stack: StackFactory) -> None:
    stack = await make_stack()
    names = [
        "tandem:time_to_first_token_seconds_count", "tandem:e2e_request_latency_seconds_count",
        "tandem:time_per_output_token_seconds_count", "tandem:inter_token_latency_seconds_count",
        "tandem:request_queue_time_seconds_count", "tandem:prompt_tokens_total",
        "tandem:generation_tokens_total",
    ]  # fmt: skip
    before = {n: await stack.metric(n) for n in names}
    await stack.client().completions.create(model=MODEL, prompt="abc", max_tokens=5)
    after = {n: await stack.metric(n) for n in names}
    assert after["tandem:prompt_tokens_total"] - before["tandem:prompt_tokens_total"] == 3
    assert after["tandem:generation_tokens_total"] - before["tandem:generation_tokens_total"] == 5
    for n in names:
        assert after[n] > before[n], n
    assert await stack.metric('tandem:request_success_total{finished_reason="length"}') == 1
    assert await stack.metric("tandem:num_requests_running") == 0


def test_cli_parses_gateway_flags(tmp_path: Path) -> None:
    from services.cli import build_parser
    from services.gateway.main import config_from_args

    argv = ["serve", "gateway", "--tokenizer", "tok:1,tok2:1", "--prefill", "p1:2,p2:3",
            "--prefill", "p3:4", "--decode", "d:5", "--port", "9000", "--safety-policy", "off",
            "--served-model-name", "a", "b", "--rate-limit-rpm", "10", "--no-truncate",
            *tls_flags("gateway")]  # fmt: skip
    args = build_parser(argv).parse_args(argv)
    config = config_from_args(args)
    assert config.tokenizer_addresses == ("tok:1", "tok2:1")
    assert config.prefill_addresses == ("p1:2", "p2:3", "p3:4")
    assert config.decode_addresses == ("d:5",) and config.port == 9000
    assert config.served_model_names == ("a", "b") and not config.truncate_chats
    assert isinstance(config.timeouts, BackendTimeouts)
    assert grpc  # imported for the fakes' status codes


async def test_tokenizer_down_is_503_and_not_ready(make_stack: StackFactory) -> None:
    stack = await make_stack()
    tokenizer_address = next(
        a for a, h in stack.servers.items() if "tandem.v1.Tokenizer" in h.service_names
    )
    await stack.servers[tokenizer_address].stop(0)
    status, raw, _ = await post_raw(stack.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 503 and json.loads(raw)["error"]["type"] == "service_unavailable"
    async with aiohttp.ClientSession() as s, s.get(stack.url + "/ready") as r:
        body = await r.json()
        assert r.status == 503 and body["problems"][0].startswith("tokenizer:")
    assert stack.prefills[0].requests == []


async def test_kv_that_never_arrives_is_503_and_frees_everything(make_stack: StackFactory) -> None:
    stack = await make_stack(timeouts=BackendTimeouts(wait_for_kv_s=0.2))
    stack.prefills[0].delay = 1.0
    status, raw, _ = await post_raw(stack.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 503, raw
    assert "no KV arrived" in json.loads(raw)["error"]["message"]
    await asyncio.sleep(1.2)  # the cancelled prefill never hands its KV over
    await stack.settled()
    assert stack.decodes[0].handoffs == {}
