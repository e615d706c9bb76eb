"""A snapshot of one engine's load and KV occupancy, published by the engine thread.

Plain data (vLLM v1's habit): the engine loop fills one after every iteration; the services read
it for ``GetStats`` (routing, leak checks) and tests read it to prove batching happened.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def kv_cache_usage(self) -> float:
        """``num_blocks_in_use / num_blocks_total``, in [0, 1]."""
        return self.num_blocks_in_use / self.num_blocks_total if self.num_blocks_total else 0.0
