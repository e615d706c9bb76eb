"""What scripts/compose_test.py sends and reads from a running compose stack: chat completions
through the official ``openai`` SDK on the published gateway port, the gateway's ``/ready``, and
each replica's own Prometheus ``/metrics``, the gateway's included (reached from the host by the
replica's address on the compose network; metrics ports are not published).
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from openai import OpenAI

logger = logging.getLogger("compose_test")
MODEL = "SmolLM2-135M-Instruct"


def get_json(url: str, api_key: str = "") -> dict[str, Any]:
    """GET ``url`` as JSON (``/ready``'s 503 carries JSON too), with ``api_key`` if given."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=10) as response:  # fmt: skip
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read())


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text page as ``{"name{labels}": value}``."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def worker_metric(ip: str, port: int, name: str) -> float:
    """One unlabelled metric of the replica (a worker's or the gateway's) at ``ip`` (its metrics
    ``port``)."""
    return scrape(f"http://{ip}:{port}/metrics").get(name, 0.0)


@dataclass
class Outcome:
    """What one streamed completion produced."""

    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = -1
    chunks: int = 0
    error: str | None = None


@dataclass
class Going:
    """Set once ``expected`` streams have each received ``after`` chunks (all are emitting)."""

    expected: int
    after: int = 4
    event: threading.Event = field(default_factory=threading.Event)
    _count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def one_more(self) -> None:
        with self._lock:
            self._count += 1
            if self._count >= self.expected:
                self.event.set()


class Client:
    """The official OpenAI SDK pointed at the gateway's published port."""

    def __init__(self, base_url: str, api_key: str = "") -> None:
        self.base_url = base_url
        self.api_key = ""
        self.sdk = OpenAI(base_url=base_url + "/v1", api_key="none", timeout=300, max_retries=0)
        if api_key:
            self.use_key(api_key)

    def use_key(self, api_key: str) -> None:
        """Send ``api_key`` from now on (compose generates one at the gateway's first start)."""
        self.api_key = api_key
        self.sdk = OpenAI(base_url=self.base_url + "/v1", api_key=api_key, timeout=300,
                          max_retries=0)  # fmt: skip

    def unauthorized(self) -> bool:
        """Whether a request with no key gets 401."""
        request = urllib.request.Request(self.base_url + "/v1/models")
        try:
            with urllib.request.urlopen(request, timeout=10):
                return False
        except urllib.error.HTTPError as err:
            return err.code == 401

    def stream(self, prompt: str, max_tokens: int, going: Going | None = None) -> Outcome:
        """One greedy streamed chat completion of exactly ``max_tokens`` tokens."""
        out = Outcome()
        try:
            chunks = self.sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True,
                temperature=0, max_tokens=max_tokens, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in chunks:
                if chunk.usage is not None:
                    out.completion_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    out.text += choice.delta.content or ""
                    out.finish_reason = choice.finish_reason or out.finish_reason
                    out.chunks += 1
                    if going is not None and out.chunks == going.after:
                        going.one_more()
        except Exception as exc:  # the SDK's errors and a broken stream alike: recorded
            out.error = f"{type(exc).__name__}: {exc}"
        return out

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, int, int]:
        """A greedy, unstreamed turn: ``(text, prompt tokens, prompt tokens served from cache)``."""
        reply = self.sdk.chat.completions.create(  # type: ignore[call-overload]
            model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens)
        usage = reply.usage
        assert usage is not None
        details = usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details is not None else 0
        return reply.choices[0].message.content or "", usage.prompt_tokens, cached

    def ready(self) -> dict[str, Any]:
        return get_json(self.base_url + "/ready", self.api_key)

