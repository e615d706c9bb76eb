"""Per-request state inside the engine.

A sequence's tokens are ``prompt_token_ids + output_token_ids``; ``num_computed_tokens`` of them
have their K/V in the cache. One rule covers every phase (as in vLLM v1): the scheduler computes
``all_token_ids[num_computed_tokens:]`` (a whole prompt, a chunk of it, or the one newest token),
and when that reaches the end of the sequence the next token is sampled.

Lifecycle:
  1. WAITING  — queued; holds no blocks (also where a preempted sequence goes back to).
  2. RUNNING  — holds blocks; is computed every step until a stop condition.
  3. FINISHED — stop / length / abort; blocks were freed (or handed to the caller when the
     engine is a prefill-only worker and the caller ships them to a decode worker).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.common.sampling_params import SamplingParams
from services.engine.core.sampler import SamplingState, TokenLogprobs
from services.engine.core.speculative import PromptLookup


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    """Mutable state of one request; owned by the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: SamplingState
    prefill_only: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    arrival_time: float = 0.0
    cache_root: bytes = b""  # its prefix-cache chain's salt (prefix_hash.prefix_root)
    # speculative decoding (speculative.py): this step's drafts, set by the engine before it
    # schedules and cleared after, and the sequence's prompt-lookup index (None: not speculating)
    draft_token_ids: list[int] = field(default_factory=list)
    lookup: PromptLookup | None = None
    # prompt_logprobs.py: position i's entry scores prompt token i + 1 (filled as the prompt is
    # computed; sent with the first sampled token)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.sampling.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.sampling.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
