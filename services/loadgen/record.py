"""One request's outcome as the load generator measured it: a plain, JSON-ready record.

Failed requests keep a record too (``ok`` False, ``error_kind`` and the server's message): they
are counted in every summary and excluded only from the latency statistics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

ErrorKind = Literal[
    "rejected",  # the server answered 429 (overload / rate limit): admission control at work
    "http_4xx",  # the server answered another 4xx (bad request, unknown model, ...)
    "http_5xx",  # the server answered 5xx
    "stream_error",  # an in-stream ``data: {"error": ...}`` event
    "incomplete_stream",  # the stream ended or dropped before ``data: [DONE]``
    "timeout",  # no complete answer within ``--timeout`` seconds
    "connection",  # no HTTP answer at all (refused, reset before the status line)
    "protocol",  # a 200 that is not an OpenAI event stream, or a chunk that is not JSON
    "empty",  # a complete stream without one content token
]
ERROR_KINDS: tuple[str, ...] = get_args(ErrorKind)

TokenSource = Literal["usage", "tokenizer", "workload"]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one streamed request did. Times are seconds; ``sent_s`` counts from the level start.

    Attributes:
        index: position of the request in its level.
        ok: a complete stream with at least one content token.
        error_kind / error: why not (see :data:`ErrorKind`), with the server's first message.
        sent_s: when the request was sent, after the level started.
        ttft_s: send → first chunk carrying content.
        e2e_s: send → end of the stream (``[DONE]``), or → the failure.
        tpot_s: (E2E − TTFT) / (output tokens − 1); None with fewer than two tokens.
        itl_s: inter-token latencies, output tokens − 1 of them (rule in ``token_timing.py``).
        output_tokens / output_tokens_from: the count and where it came from: the server's
            ``usage``, or (flagged) the tokenizer's count of the streamed text.
        prompt_tokens / prompt_tokens_from: the server's ``usage.prompt_tokens``, or the
            workload's own count of the prompt text when the server sent no usage.
        input_tokens: the workload's count of the prompt text (for chat: the message contents).
        max_tokens: the ``max_tokens`` sent.
        content_chunks: stream chunks that carried content.
        retry_after_s: a 429's ``Retry-After`` (seconds); None without one (or without a 429).
    """

    index: int
    ok: bool
    sent_s: float
    max_tokens: int
    input_tokens: int
    error_kind: str | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: tuple[float, ...] = field(default_factory=tuple)
    output_tokens: int = 0
    output_tokens_from: TokenSource = "usage"
    prompt_tokens: int | None = None
    prompt_tokens_from: TokenSource = "usage"
    content_chunks: int = 0
    retry_after_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["itl_s"] = list(self.itl_s)
        return out
