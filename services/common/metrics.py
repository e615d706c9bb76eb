"""Tandem's Prometheus metrics (docs/metrics.md), named like vLLM's so dashboards adapt easily.

Each process builds one :class:`TandemMetrics` at start-up, on its own ``CollectorRegistry``
(nothing is registered at import time, so tests and several in-process servers never collide),
and exposes it on ``GET /metrics`` on a port of its own (:func:`serve_metrics_http`; the gateway
too, on ``--metrics-port``, never on the API's port). Each process has its own registry and port, so
its own metrics carry no ``role`` label; Prometheus' ``job`` / ``instance`` labels tell processes apart.

Who records what:
  1. gateway: end-to-end latency, TTFT, TPOT, inter-token latency, queue time, tokenize time,
     prompt / generation tokens, finished requests by reason, safety blocks by stage, 429s by
     code, and per worker (``role`` / ``worker`` labels, from its polls and prefix feed) the
     prefix-cache hit rate and the cached blocks the router knows of;
  2. prefill: prefill time, prefix-cache hits/queries, KV transfers (bytes, seconds, failures,
     expired leases), running/waiting, KV blocks;
  3. decode: decode time, preemptions, running/waiting, KV blocks, KV transfer failures seen on
     the receiving side, KV reservations by outcome (the gateway: requests that waited for one).

Units follow Prometheus conventions: seconds, bytes, ``_total`` for counters. Prefix-cache hits
and queries count tokens (as vLLM v1 does), so ``hits / queries`` is the token hit rate.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from services.common.errors import UnavailableError

logger = logging.getLogger(__name__)

# Latency buckets in seconds. TTFT spans a cached short prompt on a GPU (ms) to a long prompt on a
# CPU under load (minutes); per-token latencies are tighter; whole requests are longer.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip
TRANSFER_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

# Label values used across services, kept here so recorders and dashboards agree.
FINISHED_REASONS = ("stop", "length", "abort", "content_filter", "error")
SAFETY_STAGES = ("input", "output")
PREFILL_PATHS = ("remote", "local")
KV_TRANSFER_FAILURE_REASONS = ("checksum", "layout", "timeout", "connection", "refused", "other")
KV_RESERVATION_OUTCOMES = ("granted", "renewed", "refused", "expired")
THROTTLE_CODES = ("rate_limit_exceeded", "server_overloaded", "client_concurrency",
                  "client_body_budget", "other")


class TandemMetrics:
    """Every Tandem metric, registered on one registry. Attributes are prometheus_client metrics.

    Args:
        registry: where to register; a fresh ``CollectorRegistry`` when None.
        process_metrics: also export ``process_*`` / ``python_*`` (CPU, memory, fds, GC), only
            when the registry is fresh (registering them twice on one registry fails).
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, process_metrics: bool = True
    ) -> None:
        fresh = registry is None
        self.registry = CollectorRegistry() if registry is None else registry
        if fresh and process_metrics:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)
        r = self.registry

        # Request latencies (gateway).
        self.time_to_first_token = Histogram(
            "tandem:time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.time_per_output_token = Histogram(
            "tandem:time_per_output_token_seconds",
            "Mean time per output token after the first, per request ((e2e - ttft) / (n - 1)).",
            buckets=TOKEN_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            "tandem:inter_token_latency_seconds",
            "Time between consecutive streamed token deltas.",
            buckets=TOKEN_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e_request_latency = Histogram(
            "tandem:e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=REQUEST_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.request_queue_time = Histogram(
            "tandem:request_queue_time_seconds",
            "Time a request waited for admission (gateway) or scheduling (workers).",
            buckets=REQUEST_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.request_tokenize_time = Histogram(
            "tandem:request_tokenize_time_seconds",
            "Time spent templating and tokenizing a request's prompt.",
            buckets=TRANSFER_BUCKETS, registry=r,
        )  # fmt: skip
        self.request_prefill_time = Histogram(
            "tandem:request_prefill_time_seconds",
            "Time from scheduling a prompt to its first token (prefill compute).",
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.request_decode_time = Histogram(
            "tandem:request_decode_time_seconds",
            "Time from a request's admission into the decode batch to its last token.",
            buckets=REQUEST_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip

        # Load and KV cache (workers).
        self.num_requests_running = Gauge(
            "tandem:num_requests_running", "Requests in the running batch.", registry=r
        )
        self.num_requests_waiting = Gauge(
            "tandem:num_requests_waiting", "Requests waiting to be scheduled.", registry=r
        )
        self.kv_cache_usage_perc = Gauge(
            "tandem:kv_cache_usage_perc",
            "Fraction of KV blocks in use, in [0, 1] (1 = full).",
            registry=r,
        )
        self.kv_blocks_in_use = Gauge(
            "tandem:kv_blocks_in_use",
            "KV blocks held by live requests or leases; returns to its idle value after any load.",
            registry=r,
        )
        self.kv_blocks_total = Gauge(
            "tandem:kv_blocks_total", "KV blocks in the paged cache.", registry=r
        )
        self.prefix_cache_hits = Counter(
            "tandem:prefix_cache_hits_total",
            "Prompt tokens served from the prefix cache.",
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "tandem:prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            registry=r,
        )
        self.num_preemptions = Counter(
            "tandem:num_preemptions_total",
            "Sequences preempted because KV blocks ran out.",
            registry=r,
        )
        # Speculative decoding (vLLM's spec_decode_* names; services/engine/core/speculative.py).
        self.spec_decode_num_drafts = Counter(
            "tandem:spec_decode_num_drafts_total",
            "Verifications of at least one draft token.", registry=r,
        )  # fmt: skip
        self.spec_decode_num_draft_tokens = Counter(
            "tandem:spec_decode_num_draft_tokens_total", "Draft tokens scored.", registry=r,
        )  # fmt: skip
        self.spec_decode_num_accepted_tokens = Counter(
            "tandem:spec_decode_num_accepted_tokens_total",
            "Draft tokens accepted (each a token without a step of its own).", registry=r,
        )  # fmt: skip
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "tandem:spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted, by draft position (0 = the first draft).", ["position"],
            registry=r,
        )  # fmt: skip

        # KV hand-off (docs/kv-handoff.md).
        self.kv_transfer_bytes = Counter(
            "tandem:kv_transfer_bytes_total", "KV bytes moved between workers.", registry=r
        )
        self.kv_transfer_seconds = Histogram(
            "tandem:kv_transfer_seconds",
            "Duration of one request's KV transfer (first chunk to acknowledgement).",
            buckets=TRANSFER_BUCKETS, registry=r,
        )  # fmt: skip
        self.kv_transfer_failures = Counter(
            "tandem:kv_transfer_failures_total",
            "KV transfers that failed, by reason (" + ", ".join(KV_TRANSFER_FAILURE_REASONS) + ").",
            ["reason"],
            registry=r,
        )
        self.kv_transfer_leases_expired = Counter(
            "tandem:kv_transfer_leases_expired_total",
            "Prefill KV leases freed because decode never acknowledged or aborted in time.",
            registry=r,
        )

        # Reserve before compute (docs/kv-handoff.md): decode room is reserved before prefill.
        self.kv_reservations = Counter(
            "tandem:kv_reservations_total",
            "Decode KV reservations by outcome (granted; refused: no room, nothing allocated; "
            "renewed: its holder extended the lease while the prefill was queued; "
            "expired: no KV header arrived within the lease, blocks freed).",
            ["outcome"],
            registry=r,
        )
        for outcome in KV_RESERVATION_OUTCOMES:
            self.kv_reservations.labels(outcome=outcome)
        self.decode_admission_waits = Counter(
            "tandem:decode_admission_waits_total",
            "Requests the gateway held back because every decode worker refused to reserve room.",
            registry=r,
        )
        self.decode_admission_timeouts = Counter(
            "tandem:decode_admission_timeouts_total",
            "Requests answered 503 decode_capacity: no decode room within "
            "--decode-admission-timeout.",
            registry=r,
        )

        # Tokens and outcomes (gateway).
        self.prompt_tokens = Counter(
            "tandem:prompt_tokens_total", "Prompt tokens processed.", registry=r
        )
        self.generation_tokens = Counter(
            "tandem:generation_tokens_total", "Tokens generated.", registry=r
        )
        self.request_success = Counter(
            "tandem:request_success_total",
            "Finished requests by finish reason (" + ", ".join(FINISHED_REASONS) + ").",
            ["finished_reason"],
            registry=r,
        )
        self.prefill_path = Counter(
            "tandem:prefill_path_total",
            "Prompts by where they were prefilled: remote (a prefill worker, KV handed off) or "
            "local (the decode worker itself; conditional disaggregation, colocated mode).",
            ["path"],
            registry=r,
        )
        self.migrations = Counter(
            "tandem:migrations_total",
            "Streams moved to another decode worker after theirs died mid-stream.",
            registry=r,
        )
        self.worker_prefix_cache_hit_rate = Gauge(
            "tandem:worker_prefix_cache_hit_rate",
            "Per worker, as the gateway polls it: prompt tokens served from its prefix cache / "
            "prompt tokens looked up, since the worker started.",
            ["role", "worker"],
            registry=r,
        )
        self.worker_prefix_cache_blocks = Gauge(
            "tandem:worker_prefix_cache_blocks",
            "Per worker: cached prefix blocks the gateway's KV-aware router knows of (its "
            "PrefixCache feed).",
            ["role", "worker"],
            registry=r,
        )
        self.safety_blocks = Counter(
            "tandem:safety_blocks_total",
            "Requests or streams stopped by the safety filter, by stage (input, output).",
            ["stage"],
            registry=r,
        )
        self.requests_throttled = Counter(
            "tandem:requests_throttled_total",
            "Requests the gateway answered HTTP 429, by error code (rate_limit_exceeded: the API "
            "key's rate limit; server_overloaded: --max-in-flight reached; client_concurrency: "
            "the client's share of the admission slots; client_body_budget: the client's share "
            "of the request-body memory; other: a worker out of room).",
            ["code"],
            registry=r,
        )

        self._engine_phases = _EnginePhases()
        r.register(self._engine_phases)

        # Known label values start at 0, so rate() and dashboards see them before the first event.
        for reason in FINISHED_REASONS:
            self.request_success.labels(finished_reason=reason)
        for stage in SAFETY_STAGES:
            self.safety_blocks.labels(stage=stage)
        for code in THROTTLE_CODES:
            self.requests_throttled.labels(code=code)
        for path in PREFILL_PATHS:
            self.prefill_path.labels(path=path)
        for reason in KV_TRANSFER_FAILURE_REASONS:
            self.kv_transfer_failures.labels(reason=reason)

    def watch_engine_phases(
        self, read: Callable[[], tuple[Mapping[str, float], int]] | None
    ) -> None:
        """Export ``tandem:engine_thread_seconds_total{phase}`` and
        ``tandem:engine_steps_total`` from ``read()`` (the engine thread's
        :class:`~services.engine.core.step_phases.StepPhases`) at every scrape; ``None`` stops."""
        self._engine_phases.read = read

    def record_throttled(self, code: str | None) -> None:
        """Count one HTTP 429 answer; codes outside :data:`THROTTLE_CODES` count as ``other``."""
        self.requests_throttled.labels(code=code if code in THROTTLE_CODES else "other").inc()

    def record_kv_state(self, blocks_in_use: int, blocks_total: int) -> None:
        """Set the three KV gauges from one snapshot of the block manager."""
        self.kv_blocks_in_use.set(blocks_in_use)
        self.kv_blocks_total.set(blocks_total)
        self.kv_cache_usage_perc.set(blocks_in_use / blocks_total if blocks_total else 0.0)

    def record_queue_state(self, running: int, waiting: int) -> None:
        """Set the running / waiting gauges from one scheduler snapshot."""
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)

    @property
    def content_type(self) -> str:
        """The ``Content-Type`` of :meth:`render` (Prometheus text format 0.0.4)."""
        return CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        """The registry in Prometheus text format, for a ``/metrics`` response body."""
        return generate_latest(self.registry)


class _EnginePhases:
    """A collector of the engine thread's seconds per phase, read when scraped (the engine
    thread keeps plain floats; nothing on its hot path touches prometheus_client)."""

    def __init__(self) -> None:
        self.read: Callable[[], tuple[Mapping[str, float], int]] | None = None

    def collect(self) -> Iterator[Metric]:
        read = self.read
        if read is None:
            return
        family = CounterMetricFamily(
            "tandem:engine_thread_seconds",
            "Wall seconds of the worker's engine thread by phase: schedule, inputs, forward, "
            "sample, postprocess (in the engine step), commands, outputs, publish, idle (around "
            "it). bench/serve_profile.py reads it.",
            labels=["phase"],
        )
        seconds, steps = read()
        for phase, value in seconds.items():
            family.add_metric([phase], value)
        yield family
        yield CounterMetricFamily("tandem:engine_steps", "Engine steps that ran a batch.",
                                  value=steps)  # fmt: skip


def metrics_handler(metrics: TandemMetrics) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler serving ``metrics`` (mount it at ``GET /metrics``)."""

    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": metrics.content_type})

    return handle


@dataclass(frozen=True, slots=True)
class MetricsHttpServer:
    """A running metrics endpoint; ``await close()`` stops it."""

    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/metrics"

    async def close(self) -> None:
        await self.runner.cleanup()


async def serve_metrics_http(
    metrics: TandemMetrics, host: str = "0.0.0.0", port: int = 0
) -> MetricsHttpServer:
    """Serve ``GET /metrics`` (and a trivial ``GET /health``) on ``host:port`` for a process.

    Port 0 picks a free port; the returned server reports the bound one.

    Raises:
        UnavailableError: the address could not be bound (port in use, bad host).
    """
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(metrics))
    app.router.add_get("/health", _health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as err:
        await runner.cleanup()
        raise UnavailableError(f"could not serve metrics on {host}:{port}: {err}") from err
    bound = port
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            bound = int(address[1])
            break
    logger.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsHttpServer(runner=runner, host=host, port=bound)


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok\n")
