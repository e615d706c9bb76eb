"""Where the engine thread delivers one request's outputs, and the per-request timings it records.

A sink is created by the asyncio side (:class:`~services.engine.runtime.engine_loop.EngineLoop`) and used
by the engine thread: outputs go onto ``queue`` through ``loop.call_soon_threadsafe``. Timings
are taken on the engine thread when a token is produced, not when a consumer reads it, so a slow
client does not distort them. Which histogram a first token feeds depends on the request's kind:

  1. ``"full"``    — prefilled and decoded here: time to first token, then inter-token latency.
  2. ``"prefill"`` — a prefill-only request: prefill time (arrival to first token).
  3. ``"decode"``  — admitted with its KV from a prefill worker: inter-token latency from
     admission on, and decode time (admission to last token) when it finishes.

Only tokens this engine sampled count as generated tokens (a decode worker's first token was
sampled by prefill and is counted there).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Literal

from services.common.metrics import TandemMetrics
from services.engine.core.engine import RequestOutput

SinkKind = Literal["full", "prefill", "decode"]


@dataclass(slots=True, eq=False)
class RequestSink:
    """One request's output queue (mutable; engine-thread fields are touched by it only)."""

    kind: SinkKind
    created: float
    queue: asyncio.Queue[object] = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop | None = None
    last_token: float | None = None

    @classmethod
    def create(cls, kind: SinkKind) -> RequestSink:
        return cls(kind=kind, created=time.monotonic())

    def record(self, metrics: TandemMetrics, out: RequestOutput, *, sampled_here: bool) -> None:
        """Update token counters and latency histograms for one output (engine thread)."""
        now = time.monotonic()
        new_tokens = len(out.new_token_ids)
        if new_tokens and sampled_here:
            metrics.generation_tokens.inc(new_tokens)
            if self.last_token is not None:
                metrics.inter_token_latency.observe(now - self.last_token)
            elif self.kind == "full":
                metrics.time_to_first_token.observe(now - self.created)
            elif self.kind == "prefill":
                metrics.request_prefill_time.observe(now - self.created)
        if new_tokens:
            self.last_token = now
        if out.finished and self.kind == "decode":
            metrics.request_decode_time.observe(now - self.created)
