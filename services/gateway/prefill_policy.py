"""Conditional disaggregation: which prompts go to a prefill worker, and which the decode worker
prefills itself.

Shipping a prompt to the prefill pool pays off when its prefill is long enough to stall the
decode worker's running batch, and only while the prefill pool keeps up. A short prompt is
cheaper to prefill where it will be decoded: no KV hand-off, and the decode worker chunks it
into its running batch under its per-step token budget. That is Dynamo's rule (prefill remotely
when the uncached prompt is longer than ``max_local_prefill_length`` and the prefill queue is
short), and the rule here:

    remote  iff  a prefill worker is healthy
            and  uncached(prompt) >= remote_min_tokens
            and  that prefill worker has fewer than max_prefill_queue requests

otherwise the decode worker prefills it (``Decode.Generate`` carrying the prompt).
``uncached(prompt)`` is the prompt's length minus the prefix the chosen decode worker already
holds (the router follows every worker's prefix cache), so a conversation's next turn whose
history is cached on its decode worker is prefilled there, cheaply. Prefill workers are tried
in the router's order (overlap, then load). With no prefill pool at all (``tandem up --mode colocated``) every prompt is local.
Each decision is counted in ``tandem:prefill_path_total{path="remote"|"local"}``.

Knobs (``tandem serve gateway`` flags): ``--remote-prefill-min-tokens`` (0 sends every prompt
to the prefill pool, as before conditional disaggregation; a huge value never does) and
``--max-prefill-queue``. The queue bound assumes a decode worker has compute of its own to
prefill with; where ``tandem up`` runs prefill and decode workers on the same cores it raises the
bound (``launch_plan.SHARED_CORES_PREFILL_QUEUE``), as a decode worker prefilling there only takes
its streams' core: on 2 shared cores, a 600-token stream beside three 3,000-token prompts kept an
ITL p99 of 24-30 ms with the long prompts queued, against ~0.6 s with the third one prefilled
locally (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import InvalidArgumentError

DEFAULT_REMOTE_PREFILL_MIN_TOKENS = 512
DEFAULT_MAX_PREFILL_QUEUE = 2


@dataclass(frozen=True, slots=True)
class PrefillPolicy:
    """The conditional-disaggregation thresholds (see the module docstring)."""

    remote_min_tokens: int = DEFAULT_REMOTE_PREFILL_MIN_TOKENS
    max_prefill_queue: int = DEFAULT_MAX_PREFILL_QUEUE

    def validate(self) -> PrefillPolicy:
        if self.remote_min_tokens < 0:
            raise InvalidArgumentError(
                "remote prefill min tokens must be >= 0", param="remote_prefill_min_tokens"
            )
        if self.max_prefill_queue < 1:
            raise InvalidArgumentError("max prefill queue must be >= 1", param="max_prefill_queue")
        return self

    def prefill_remotely(self, prompt_tokens: int, prefill_load: int | None) -> bool:
        """Whether a prompt with ``prompt_tokens`` uncached tokens goes to a prefill worker that
        has ``prefill_load`` requests (None: no healthy prefill worker)."""
        return (
            prefill_load is not None
            and prompt_tokens >= self.remote_min_tokens
            and prefill_load < self.max_prefill_queue
        )
