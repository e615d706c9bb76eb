"""A snapshot of one engine's load and KV occupancy, published by the engine thread.

Plain data (vLLM v1's habit): the engine loop publishes one after every iteration; the services
read it for ``GetStats`` (routing, leak checks) and tests read it to prove batching happened.
:class:`StatsPublisher` is the one place that turns snapshots into Prometheus gauges and
counter increments.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.common.metrics import TandemMetrics
from services.engine.core.engine import LLMEngine


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counts at one instant.

    Attributes:
        num_running: sequences in the running batch.
        num_waiting: sequences queued for admission.
        num_blocks_total: KV blocks in the pool.
        num_blocks_in_use: blocks referenced by a sequence or held (leases, incoming transfers).
        num_blocks_free: blocks allocatable now (evictable prefix-cache blocks included).
        num_held_requests: request ids holding blocks outside any sequence.
        num_steps: engine steps run so far.
        max_batch_size: the most sequences sampled together in one step so far.
        num_preemptions: sequences preempted for lack of blocks so far.
        block_size: token slots per block.
        prefix_hits / prefix_queries: prompt tokens served from / looked up in the prefix cache.
        spec_drafts / spec_draft_tokens / spec_accepted_tokens / spec_accepted_per_position:
            speculative decoding's counters so far (``speculative.SpecDecodeStats``).
        updated: ``time.monotonic()`` when the snapshot was taken.
    """

    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_in_use: int
    num_blocks_free: int
    num_held_requests: int
    num_steps: int
    max_batch_size: int
    num_preemptions: int
    block_size: int
    prefix_hits: int
    prefix_queries: int
    updated: float
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        """``num_blocks_in_use / num_blocks_total``, in [0, 1]."""
        return self.num_blocks_in_use / self.num_blocks_total if self.num_blocks_total else 0.0


class StatsPublisher:
    """Builds snapshots of one engine and mirrors them into metrics. Engine thread only."""

    def __init__(self, engine: LLMEngine, metrics: TandemMetrics | None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._last: EngineStats | None = None

    def publish(self, *, num_held_requests: int, num_steps: int, max_batch_size: int) -> EngineStats:
        bm = self.engine.block_manager.stats()
        scheduler = self.engine.scheduler
        spec = self.engine.spec_stats
        stats = EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_blocks_total=bm.num_blocks,
            num_blocks_in_use=bm.num_in_use,
            num_blocks_free=bm.num_free,
            num_held_requests=num_held_requests,
            num_steps=num_steps,
            max_batch_size=max_batch_size,
            num_preemptions=scheduler.num_preemptions,
            block_size=self.engine.config.block_size,
            prefix_hits=bm.prefix_hits,
            prefix_queries=bm.prefix_queries,
            updated=time.monotonic(),
            spec_drafts=spec.num_drafts,
            spec_draft_tokens=spec.num_draft_tokens,
            spec_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=tuple(spec.accepted_per_position),
        )
        m, last = self.metrics, self._last
        if m is not None:
            m.record_kv_state(stats.num_blocks_in_use, stats.num_blocks_total)
            m.record_queue_state(stats.num_running, stats.num_waiting)
            if last is not None:
                m.prefix_cache_hits.inc(stats.prefix_hits - last.prefix_hits)
                m.prefix_cache_queries.inc(stats.prefix_queries - last.prefix_queries)
                m.num_preemptions.inc(stats.num_preemptions - last.num_preemptions)
                _record_speculation(m, stats, last)
        self._last = stats
        return stats


def _record_speculation(m: TandemMetrics, stats: EngineStats, last: EngineStats) -> None:
    """Mirror the speculative-decoding counters' growth since ``last`` into ``m``."""
    if stats.spec_drafts == last.spec_drafts:
        return
    m.spec_decode_num_drafts.inc(stats.spec_drafts - last.spec_drafts)
    m.spec_decode_num_draft_tokens.inc(stats.spec_draft_tokens - last.spec_draft_tokens)
    m.spec_decode_num_accepted_tokens.inc(stats.spec_accepted_tokens - last.spec_accepted_tokens)
    before = last.spec_accepted_per_position
    for position, count in enumerate(stats.spec_accepted_per_position):
        grown = count - (before[position] if position < len(before) else 0)
        if grown:
            m.spec_decode_num_accepted_tokens_per_pos.labels(position=str(position)).inc(grown)
