"""One streamed request to an OpenAI-compatible server, turned into a :class:`RequestRecord`.

Lifecycle of :meth:`StreamingClient.send`:

1. Build the body: ``stream: true``, ``stream_options: {include_usage: true}``, ``max_tokens``,
   ``temperature``, and ``ignore_eos: true`` unless turned off (vLLM, llama.cpp's server and
   Tandem honour it, so every request produces exactly ``max_tokens`` tokens). A server that
   rejects one of these optional fields is handled once, at warm-up (:meth:`drop_field`).
2. POST it and stamp the send. A 429 is a ``rejected`` record (admission control: its
   ``Retry-After`` and the time to the answer are kept, so an overload run can show that refusals
   are immediate); another non-200 status is an error record (``http_4xx``/``http_5xx``)
   carrying the start of the server's message; a 200 that is not ``text/event-stream`` is a
   ``protocol`` error.
3. Read the events (``sse_stream``): a content chunk is stamped (TTFT, ITL), a ``usage`` chunk
   gives the server's token counts, an ``{"error": ...}`` event is a ``stream_error``,
   ``[DONE]`` ends the stream (E2E).
4. A body that ends or drops before ``[DONE]`` is an ``incomplete_stream`` error, a request over
   ``--timeout`` a ``timeout``, no HTTP answer at all a ``connection`` error, a complete stream
   without content ``empty``. Every failure is a record; nothing is raised or dropped.
5. Output tokens: ``usage.completion_tokens``, or (flagged ``tokenizer``) the tokenizer's count of
   the streamed text when the server sent no usage. Timings: ``token_timing.stream_timing``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from services.loadgen.record import RequestRecord
from services.loadgen.sse_stream import sse_events
from services.loadgen.target import Target, auth_headers
from services.loadgen.token_timing import stream_timing
from services.loadgen.workload import RequestSpec

logger = logging.getLogger(__name__)

OPTIONAL_FIELDS = ("ignore_eos", "stream_options")  # dropped if a server rejects them
_MESSAGE_CHARS = 300


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How every request of a run is sent."""

    endpoint: str = "chat"  # "chat" | "completions"
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 300.0
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # merged into every body


@dataclass(slots=True)
class _Stream:
    """What step 3 collected."""

    stamps: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    done: bool = False
    end: float = 0.0
    retry_after_s: float | None = None


class _Failure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class StreamingClient:
    """Sends :class:`RequestSpec` s to one target and measures each stream."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        target: Target,
        options: ClientOptions,
        count_tokens: Callable[[str], int],
    ) -> None:
        self._session = session
        self._target = target
        self._options = options
        self._count = count_tokens
        self._url = target.url(options.endpoint)
        self._headers = {"Content-Type": "application/json", **auth_headers(options.api_key)}
        self.dropped: set[str] = set()

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        """The JSON body of one request (step 1)."""
        body: dict[str, Any] = {"model": self._target.model}
        if self._options.endpoint == "chat":
            body["messages"] = spec.chat_messages()
        else:  # the CLI refuses chat messages for the completions endpoint
            body["prompt"] = spec.prompt or ""
        body.update(
            max_tokens=spec.max_tokens,
            temperature=self._options.temperature,
            stream=True,
            stream_options={"include_usage": True},
        )
        if self._options.ignore_eos:
            body["ignore_eos"] = True
        body.update(self._options.extra_body)
        for name in self.dropped:
            body.pop(name, None)
        return body

    def drop_field(self, record: RequestRecord) -> str | None:
        """After a 4xx naming an optional field (``ignore_eos``, ``stream_options``), leave that
        field out of every later request and return its name; None when nothing applies."""
        if record.error_kind != "http_4xx" or not record.error:
            return None
        for name in OPTIONAL_FIELDS:
            if name in record.error and name not in self.dropped:
                if name == "ignore_eos" and not self._options.ignore_eos:
                    continue
                self.dropped.add(name)
                return name
        return None

    async def send(self, spec: RequestSpec) -> RequestRecord:
        """One request, measured (steps 2-5); ``sent_s`` is the absolute ``perf_counter``."""
        sent = time.perf_counter()
        base = RequestRecord(index=0, ok=False, sent_s=sent, max_tokens=spec.max_tokens,
                             input_tokens=spec.input_tokens)  # fmt: skip
        stream = _Stream()
        try:
            await self._exchange(self.body(spec), sent, stream)
        except _Failure as failure:
            return _failed(base, failure.kind, failure.message, time.perf_counter() - sent, stream)
        return self._measured(base, stream)

    async def _exchange(self, body: dict[str, Any], sent: float, stream: _Stream) -> None:
        timeout = aiohttp.ClientTimeout(total=self._options.timeout_s)
        answered = False
        try:
            async with self._session.post(
                self._url, json=body, headers=self._headers, timeout=timeout
            ) as response:
                answered = True
                await self._read(response, sent, stream)
        except TimeoutError as exc:  # before ClientError: aiohttp's timeouts are both
            message = f"no complete answer in {self._options.timeout_s:g} s"
            raise _Failure("timeout", message) from exc
        except ValueError as exc:  # an over-long line, undecodable bytes
            raise _Failure("protocol", f"{type(exc).__name__}: {exc}") from exc
        except aiohttp.ClientError as exc:
            if not answered:
                raise _Failure("connection", f"{type(exc).__name__}: {exc}") from exc
            raise _Failure(
                "incomplete_stream",
                f"the stream broke after {len(stream.stamps)} content chunk(s): "
                f"{type(exc).__name__}: {exc}",
            ) from exc

    async def _read(self, response: aiohttp.ClientResponse, sent: float, stream: _Stream) -> None:
        if response.status != 200:
            text = (await response.text(errors="replace")).strip()
            kind = {4: "http_4xx", 5: "http_5xx"}.get(response.status // 100, "protocol")
            if response.status == 429:
                kind = "rejected"
                stream.retry_after_s = _seconds(response.headers.get("Retry-After"))
            raise _Failure(kind, f"HTTP {response.status}: {_server_message(text)}")
        if not response.content_type.startswith("text/event-stream"):
            text = (await response.text(errors="replace")).strip()
            raise _Failure(
                "protocol",
                f"expected text/event-stream, got {response.content_type}: {text[:_MESSAGE_CHARS]}",
            )
        async for stamp, data in sse_events(response.content):
            if stream.done:  # read to the end so the connection can be reused
                continue
            if data.strip() == "[DONE]":
                stream.done, stream.end = True, stamp - sent
                continue
            try:
                chunk = json.loads(data)
            except ValueError as exc:
                raise _Failure("protocol", f"a chunk is not JSON: {data[:_MESSAGE_CHARS]}") from exc
            if not isinstance(chunk, dict):
                raise _Failure("protocol", f"a chunk is not a JSON object: {data[:_MESSAGE_CHARS]}")
            if chunk.get("error") is not None:
                raise _Failure("stream_error", _error_message(chunk, data))
            text = _chunk_text(chunk)
            if text:
                stream.stamps.append(stamp - sent)
                stream.texts.append(text)
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                if isinstance(usage.get("completion_tokens"), int):
                    stream.completion_tokens = usage["completion_tokens"]
                if isinstance(usage.get("prompt_tokens"), int):
                    stream.prompt_tokens = usage["prompt_tokens"]
        if not stream.done:
            chunks = len(stream.stamps)
            message = f"the stream ended without data: [DONE] after {chunks} content chunk(s)"
            raise _Failure("incomplete_stream", message)

    def _measured(self, base: RequestRecord, stream: _Stream) -> RequestRecord:
        if stream.completion_tokens is not None:
            tokens, tokens_from = stream.completion_tokens, "usage"
        else:
            tokens, tokens_from = self._count("".join(stream.texts)), "tokenizer"
        if stream.prompt_tokens is not None:
            prompt_tokens, prompt_from = stream.prompt_tokens, "usage"
        else:
            prompt_tokens, prompt_from = base.input_tokens, "workload"
        common: dict[str, Any] = dict(
            e2e_s=stream.end, output_tokens=tokens, output_tokens_from=tokens_from,
            prompt_tokens=prompt_tokens, prompt_tokens_from=prompt_from,
            content_chunks=len(stream.stamps),
        )  # fmt: skip
        if not stream.stamps:
            message = f"a complete stream without content ({tokens} tokens)"
            return replace(base, error_kind="empty", error=message, **common)
        weights = [max(1, self._count(text)) for text in stream.texts]
        timing = stream_timing(stream.stamps, weights, stream.end, tokens)
        return replace(base, ok=True, ttft_s=timing.ttft_s, tpot_s=timing.tpot_s,
                        itl_s=timing.itl_s, **common)  # fmt: skip


def _failed(
    base: RequestRecord, kind: str, message: str, elapsed: float, stream: _Stream
) -> RequestRecord:
    return replace(base, error_kind=kind, error=message, e2e_s=elapsed,
                    ttft_s=stream.stamps[0] if stream.stamps else None,
                    content_chunks=len(stream.stamps),
                    retry_after_s=stream.retry_after_s)  # fmt: skip


def _seconds(value: str | None) -> float | None:
    """A ``Retry-After`` given in seconds (the HTTP-date form is not used by these servers)."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _chunk_text(chunk: dict[str, Any]) -> str:
    """The content a chunk carries: chat ``delta.content`` (+ ``reasoning_content``), or a text
    completion's ``text``; first choice only (the load generator sends n = 1)."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        parts = (delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning"))
        return "".join(p for p in parts if isinstance(p, str))
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _server_message(text: str) -> str:
    """The ``error.message`` of an OpenAI error body when there is one, else the raw text."""
    try:
        obj = json.loads(text)
    except ValueError:
        return text[:_MESSAGE_CHARS]
    return _error_message(obj, text)


def _error_message(obj: Any, text: str) -> str:
    """``obj["error"]["message"]`` (or a string ``obj["error"]``), else ``text``, shortened."""
    error = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"][:_MESSAGE_CHARS]
    if isinstance(error, str):
        return error[:_MESSAGE_CHARS]
    return text[:_MESSAGE_CHARS]
