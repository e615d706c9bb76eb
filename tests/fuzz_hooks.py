"""Schemathesis hooks for tests/test_gateway_fuzz.py, loaded by the ``schemathesis run`` process
through ``SCHEMATHESIS_HOOKS=tests.fuzz_hooks``.

1. :func:`stream_half_of_completions` (``before_call``): generated bodies seldom carry the optional
   ``stream`` field, so every other positive completion body without it is sent with
   ``"stream": true`` (still a valid body: a subset of what the schema allows).
2. Checks beyond Schemathesis's own (which already validate every response, event by event for
   streams, against the OpenAPI document):

   - :func:`openai_error_contract`: every error is OpenAI's shape with the type and code its status
     implies, ``Retry-After`` on 429, ``Allow`` on 405 (on Anthropic's ``/v1/messages`` routes,
     Anthropic's shape with the type its status implies; a 405 is the router's, OpenAI's);
   - :func:`sse_stream_contract`: a chat or text completion stream read to its end ends with
     exactly one ``[DONE]``, its chunks share one id, ``created`` and model, every choice index
     is below ``n`` and finishes once (unless an error event ended the stream), and
     ``include_usage`` adds a last chunk with usage and no choices;
   - :func:`choices_contract`: a non-streamed completion has exactly ``n`` choices, in order.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import schemathesis
from schemathesis import GenerationMode

_GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
# What every error status means: OpenAI's error type, and a code when the status implies one.
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                404: "invalid_request_error", 405: "invalid_request_error",
                408: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 500: "internal_error", 502: "server_error",
                503: "service_unavailable"}  # fmt: skip
_ERROR_CODES = {405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    404: "not_found_error", 408: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    502: "api_error", 503: "overloaded_error"}  # fmt: skip
_counter = itertools.count()


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    stream_half_of_completions(case)


def stream_half_of_completions(case: Any) -> None:
    if case.operation.path not in _GENERATION_PATHS or case.method.upper() != "POST":
        return
    meta = case.meta
    if meta is None or meta.generation.mode != GenerationMode.POSITIVE:
        return
    body = case.body
    if isinstance(body, dict) and "stream" not in body and next(_counter) % 2 == 0:
        body["stream"] = True


def _header(response: Any, name: str) -> str | None:
    values = response.headers.get(name.lower())
    return values[0] if values else None


@schemathesis.check
def openai_error_contract(ctx: Any, response: Any, case: Any) -> bool | None:
    status = response.status_code
    if status < 400:
        return None
    assert status in _ERROR_TYPES, f"undocumented error status {status}"
    try:
        body = json.loads(response.content)
    except ValueError as exc:
        raise AssertionError(f"error {status} is not JSON: {response.content[:200]!r}") from exc
    if case.operation.path.startswith("/v1/messages") and status != 405:
        assert isinstance(body, dict) and set(body) == {"type", "error"}, body
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == _ANTHROPIC_TYPES[status], body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
        if status == 429:
            assert (_header(response, "Retry-After") or "").isdigit(), "429 without Retry-After"
        return True
    assert isinstance(body, dict) and set(body) == {"error"}, f"not OpenAI's error shape: {body}"
    err = body["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["type"] == _ERROR_TYPES[status], f"{status} with type {err['type']!r}"
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    if status in _ERROR_CODES:
        assert err["code"] == _ERROR_CODES[status], f"{status} with code {err['code']!r}"
    if status == 429:
        retry = _header(response, "Retry-After")
        assert retry is not None and retry.isdigit() and int(retry) >= 1, f"Retry-After {retry!r}"
    if status == 405:
        assert _header(response, "Allow"), "405 without an Allow header"
    return True


def _request_json(case: Any) -> dict[str, Any]:
    return case.body if isinstance(case.body, dict) else {}


def _events(raw: bytes) -> list[Any]:
    events: list[Any] = []
    for block in raw.decode("utf-8").split("\n\n"):
        lines = [line for line in block.split("\n") if line]
        if not lines:
            continue
        assert all(line.startswith("data: ") for line in lines), f"unexpected SSE lines {lines}"
        payload = "\n".join(line[len("data: "):] for line in lines)
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@schemathesis.check
def sse_stream_contract(ctx: Any, response: Any, case: Any) -> bool | None:
    content_type = _header(response, "Content-Type") or ""
    if (response.status_code != 200 or not content_type.startswith("text/event-stream")
            or case.operation.path not in _GENERATION_PATHS):  # fmt: skip
        return None  # the Responses and Messages APIs' typed events: their own tests
    request = _request_json(case)
    n = request.get("n") or 1
    expected_object = ("chat.completion.chunk" if case.operation.path.endswith("chat/completions")
                       else "text_completion")  # fmt: skip
    cut = response.stream_cut_short or not response.content.endswith(b"\n\n")
    raw = response.content if not cut else response.content[: response.content.rfind(b"\n\n") + 2]
    events = _events(raw)
    assert events, "a 200 stream without events"
    done = [i for i, e in enumerate(events) if e == "[DONE]"]
    assert len(done) <= 1 and (not done or done[0] == len(events) - 1), "[DONE] not last / twice"
    chunks = [e for e in events if isinstance(e, dict) and "error" not in e]
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) <= 1, "mixed chunk heads"
    finished: dict[int, int] = {}
    for chunk in chunks:
        assert chunk["object"] == expected_object, chunk["object"]
        for choice in chunk["choices"]:
            assert 0 <= choice["index"] < n, f"choice index {choice['index']} with n={n}"
            if choice["finish_reason"] is not None:
                finished[choice["index"]] = finished.get(choice["index"], 0) + 1
    assert all(count == 1 for count in finished.values()), f"choices finished twice: {finished}"
    if cut:
        return True
    assert done, "a stream read to its end without [DONE]"
    if errors:
        assert len(errors) == 1 and events[-2] is errors[0], "the error event is not the last"
        return True
    assert sorted(finished) == list(range(n)), f"finished choices {sorted(finished)} of n={n}"
    options = request.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        last = events[-2]
        assert last["choices"] == [] and last["usage"]["total_tokens"] >= 1, last
    return True


@schemathesis.check
def choices_contract(ctx: Any, response: Any, case: Any) -> bool | None:
    content_type = _header(response, "Content-Type") or ""
    if (response.status_code != 200 or case.operation.path not in _GENERATION_PATHS
            or not content_type.startswith("application/json")):  # fmt: skip
        return None
    body = json.loads(response.content)
    n = _request_json(case).get("n") or 1
    assert [c["index"] for c in body["choices"]] == list(range(n)), body["choices"]
    assert body["usage"]["total_tokens"] == (
        body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    ), body["usage"]
    return True
