"""The record of one HTTP request: its single structured log line and its Prometheus samples.

Every request to a completions endpoint gets one :class:`RequestRecord`, created on arrival and
closed in the handler's ``finally`` with :meth:`RequestRecord.close`, whatever happened (success,
a 4xx before any compute, a worker failure, a client disconnect). Closing:

1. logs one line ``request finished`` with the request id, endpoint, model, HTTP status, outcome,
   token counts and the phase timings (queue, tokenize, prefill, transfer, ttft, e2e) as
   ``extra`` fields (see ``services.common.logging_setup``);
2. records the gateway's metrics (docs/metrics.md) for requests that reached the workers: TTFT, TPOT,
   inter-token latency, end-to-end latency, queue / tokenize / prefill time, prompt and generation
   tokens, one ``request_success_total`` sample per choice by finish reason (``error`` for a
   failed request, ``abort`` for a client that went away), and one output-stage
   ``safety_blocks_total`` sample per choice the output filter stopped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from services.common.metrics import TandemMetrics
from services.gateway.choice import ChoiceStats

logger = logging.getLogger(__name__)

OUTCOME_OK = "ok"
OUTCOME_REJECTED = "rejected"  # a 4xx before any compute
OUTCOME_ERROR = "error"
OUTCOME_DISCONNECTED = "client_disconnected"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


@dataclass(slots=True)
class RequestRecord:
    """Mutable facts about one request, filled in as it progresses."""

    request_id: str
    endpoint: str
    arrived_at: float = field(default_factory=time.monotonic)
    model: str = ""
    api_key: str = ""
    stream: bool = False
    status: int = 200
    outcome: str = OUTCOME_OK
    error: str | None = None
    prompt_tokens: int = 0
    dropped_messages: int = 0
    tokenize_s: float | None = None
    dispatched: bool = False
    choices: list[ChoiceStats] = field(default_factory=list)

    def fail(self, status: int, message: str, *, before_compute: bool) -> None:
        self.status = status
        self.error = message
        self.outcome = OUTCOME_REJECTED if before_compute and status < 500 else OUTCOME_ERROR

    def close(self, metrics: TandemMetrics) -> None:
        """Log the request's line and record its metrics (call exactly once)."""
        now = time.monotonic()
        e2e = now - self.arrived_at
        firsts = [c.first_token_at for c in self.choices if c.first_token_at is not None]
        ttft = (min(firsts) - self.arrived_at) if firsts else None
        lead = self.choices[0] if self.choices else None
        completion = sum(c.completion_tokens for c in self.choices)
        cached = min((c.cached_tokens for c in self.choices), default=0)
        extra: dict[str, object] = {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "model": self.model,
            "api_key": self.api_key,
            "stream": self.stream,
            "status": self.status,
            "outcome": self.outcome,
            "n": len(self.choices),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "cached_tokens": cached,
            "finish_reasons": ",".join(c.finish_reason or "-" for c in self.choices),
            "queue_ms": _ms(lead.queue_s if lead else None),
            "tokenize_ms": _ms(self.tokenize_s),
            "prefill_ms": _ms(lead.prefill_s if lead else None),
            "transfer_ms": _ms(lead.transfer_s if lead else None),
            "ttft_ms": _ms(ttft),
            "e2e_ms": _ms(e2e),
        }
        if lead is not None:
            extra["prefill_worker"] = lead.prefill_worker
            extra["decode_worker"] = lead.decode_worker
        if self.dropped_messages:
            extra["dropped_messages"] = self.dropped_messages
        if self.error:
            extra["error"] = self.error
        level = logging.WARNING if self.status >= 500 else logging.INFO
        logger.log(level, "request finished", extra=extra)
        if self.dispatched:
            self._record(metrics, e2e, ttft)

    def _record(self, m: TandemMetrics, e2e: float, ttft: float | None) -> None:
        if self.tokenize_s is not None:
            m.request_tokenize_time.observe(self.tokenize_s)
        m.prompt_tokens.inc(self.prompt_tokens)
        if ttft is not None:
            m.time_to_first_token.observe(ttft)
        for c in self.choices:
            m.generation_tokens.inc(c.completion_tokens)
            if c.queue_s is not None:
                m.request_queue_time.observe(c.queue_s)
            if c.prefill_s is not None:
                m.request_prefill_time.observe(c.prefill_s)
            for gap in c.token_gaps:
                m.inter_token_latency.observe(gap)
            if (
                c.first_token_at is not None
                and c.finished_at is not None
                and c.completion_tokens > 1
            ):
                tpot = (c.finished_at - c.first_token_at) / (c.completion_tokens - 1)
                m.time_per_output_token.observe(tpot)
            reason = c.finish_reason
            if reason == "content_filter":
                m.safety_blocks.labels(stage="output").inc()
            if self.outcome == OUTCOME_DISCONNECTED and reason is None:
                reason = "abort"
            elif reason is None:
                reason = "error"
            m.request_success.labels(finished_reason=reason).inc()
        if self.outcome == OUTCOME_OK:
            m.e2e_request_latency.observe(e2e)
