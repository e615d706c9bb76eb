"""Conditional disaggregation: which prompts go to a prefill worker, and which the decode worker
prefills itself.

Shipping a prompt to the prefill pool pays off when its prefill is long enough to stall the
decode worker's running batch, and only while the prefill pool keeps up. A short prompt is
cheaper to prefill where it will be decoded: no KV hand-off, and the decode worker chunks it
into its running batch under its per-step token budget. That is Dynamo's rule (prefill remotely
when the uncached prompt is longer than ``max_local_prefill_length`` and the prefill queue is
short), and the rule here:

    remote  iff  a prefill worker is healthy
            and  len(prompt) >= remote_min_tokens
            and  the least-loaded prefill worker has fewer than max_prefill_queue requests

otherwise the decode worker prefills it (``Decode.Generate`` carrying the prompt). The prompt's
whole length stands in for its uncached length: the gateway does not see the workers' prefix
caches yet. With no prefill pool at all (``tandem up --mode colocated``) every prompt is local.
Each decision is counted in ``tandem:prefill_path_total{path="remote"|"local"}``.

Knobs (``tandem serve gateway`` flags): ``--remote-prefill-min-tokens`` (0 sends every prompt
to the prefill pool, as before conditional disaggregation; a huge value never does) and
``--max-prefill-queue``.
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
        """Whether a prompt of ``prompt_tokens`` goes to the prefill pool, whose least-loaded
        healthy worker has ``prefill_load`` requests (None: no healthy prefill worker)."""
        return (
            prefill_load is not None
            and prompt_tokens >= self.remote_min_tokens
            and prefill_load < self.max_prefill_queue
        )
