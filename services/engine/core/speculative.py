"""Speculative decoding: guess a sequence's next tokens cheaply, have the model check every guess
in one forward pass, and keep each guess it agrees with as a token that cost no step of its own.

A batch-1 decode step reads every weight once to make one token, so its cost is the weight read
(the memory ceiling); the same read scores several positions of one sequence at little more
cost. Tandem has two proposers. A **draft model** (``--speculative draft --draft-model PATH``,
``draft_proposer.py``): a smaller model with the same vocabulary, greedy. And **prompt lookup**
(``--speculative ngram``; vLLM's n-gram proposer, llama.cpp's lookup decoding): find the most recent earlier occurrence of the sequence's last
``n`` tokens (``ngram_min <= n <= ngram_max``, longest first) in its prompt and output, and propose
the ``k`` tokens that followed it. Workloads that copy from their prompt (editing a document or
code, answering from given text, JSON that repeats keys) accept several tokens a step.

How a step verifies (``LLMEngine``, ``model_runner``): a speculating sequence computes its last
token and its ``d`` drafts in one slice of the batch (the chunked-prefill path; on CPU every
position's numbers are the same whatever slice computes them, ``linear.py``), so the step has
logits for ``d + 1`` positions. Position 0's row is sampled as any decode row is. Position
``j``'s row is *valid* only if every token emitted before it equals the draft it was computed
from, so the engine samples rows in order, position by position, appending each sampled token
as a normal step would (grammar matcher, stop conditions, logprobs, the request's own generator),
and stops at the first sampled token that differs from its draft — that token is still emitted:
it is what the model samples there. At most ``d + 1`` tokens a step.

Why this is exact: every emitted token is sampled from the target model's own distribution at
its position, with the request's parameters (penalties, ``logit_bias``, ``min_tokens``, top-k/p,
min-p, grammar masks) over exactly the tokens before it; drafts only decide how many positions a
step may emit. For a deterministic proposer (prompt lookup draws nothing), this is Leviathan et
al.'s rejection rule with a one-hot draft distribution (the draft model proposes its argmax, so
it draws nothing either): the draft ``x`` is accepted with
probability ``p(x)``, and on rejection the token comes from ``p`` with ``x`` removed,
renormalised. Each emitted token consumes exactly one draw of the request's generator, in the
same order as without speculation, so **greedy output is token for token, and a seeded request
draws the same text, with and without speculation** (on CPU, where the logits are the same bits
whatever the step's shape; on CUDA, logits may differ in their last bits between a 1-token and a
``d + 1``-token slice: ``docs/benchmarks.md``).

KV: the step wrote K/V for all ``d + 1`` positions; only those of accepted tokens are kept
(``num_computed_tokens`` counts them), the rest are overwritten by later steps, and blocks past
what the sequence's tokens need are returned at once. A grammar-constrained request's drafts are
cut at the first token its grammar forbids (never scored).

When it speculates: only sequences in pure decode (not a prompt chunk, not a prefill-only
request), whose request did not opt out (``SamplingParams.speculative``), while at most
``max_batch`` sequences run (a big batch already fills the weight read with useful rows, so
verification there costs more than it saves); each sequence's draft length adapts to its last
verification (one more than it accepted, up to ``num_speculative_tokens``), and a sequence whose
drafts keep failing rests from proposing for a growing number of steps (``PromptLookup``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.errors import InvalidArgumentError

SPECULATIVE_METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16
MAX_NGRAM = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How a worker speculates (``--speculative``, ``--num-speculative-tokens``, ``--ngram-max``,
    ``--ngram-min``, ``--speculative-max-batch``, ``--draft-model``, ``--draft-dtype``,
    ``--draft-kv``)."""

    method: str = "ngram"
    num_speculative_tokens: int = 8
    ngram_max: int = 4
    ngram_min: int = 1
    max_batch: int = 4
    draft_model: str | None = None  # the draft method's model (a path, ``default``, ...)
    draft_dtype: str = "auto"
    draft_kv: str = "auto"  # a handed-off prompt's draft KV: adopted from the target's, or built

    def validate(self) -> SpeculativeConfig:
        """InvalidArgumentError naming the flag on any out-of-range value; return self."""
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidArgumentError(
                f"--speculative must be one of {', '.join(SPECULATIVE_METHODS)}, not "
                f"{self.method!r}",
                param="speculative",
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidArgumentError(
                f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]",
                param="num_speculative_tokens",
            )
        if not 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM:
            raise InvalidArgumentError(
                f"--ngram-min and --ngram-max must satisfy 1 <= min <= max <= {MAX_NGRAM}",
                param="ngram_max",
            )
        if (self.method == "draft") != (self.draft_model is not None):
            raise InvalidArgumentError("--speculative draft needs --draft-model, and --draft-model "
                                       "needs --speculative draft", param="draft_model")  # fmt: skip
        if self.max_batch < 1:
            raise InvalidArgumentError("--speculative-max-batch must be at least 1",
                                       param="speculative_max_batch")  # fmt: skip
        return self


class PromptLookup:
    """One sequence's proposer state: an index of where each token occurs in the sequence's
    tokens (prompt lookup), extended as tokens are appended, so that a proposal examines only the
    earlier occurrences of the last token instead of scanning the whole history; and how many
    tokens to draft next, which follows acceptance (both methods use this part).

    Back-off: a verification that accepts nothing costs a step its extra rows for nothing (on a
    CPU whose int8 rows are compute-bound, a one-draft step costs most of a second step), so
    after two in a row the sequence rests — proposes nothing — for 1, 2, 4, ... up to 32 steps,
    and starts again at one draft."""

    __slots__ = ("_positions", "_indexed", "draft_len", "_misses", "_rest")

    MAX_REST = 32

    def __init__(self, draft_len: int) -> None:
        self._positions: dict[int, list[int]] = {}
        self._indexed = 0
        self.draft_len = draft_len  # this sequence's current draft length (adapts)
        self._misses = 0  # verifications in a row that accepted nothing
        self._rest = 0  # steps left without proposals

    def ready(self) -> bool:
        """Whether this sequence proposes this step (counts a resting step down)."""
        if self._rest > 0:
            self._rest -= 1
            return False
        return True

    def propose(self, tokens: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
        suffix of ``tokens`` (``ngram_min`` to ``ngram_max`` long) that occurred before; [] when
        none did."""
        for i in range(self._indexed, len(tokens)):
            self._positions.setdefault(tokens[i], []).append(i)
        self._indexed = len(tokens)
        last = len(tokens) - 1
        if k < 1 or last < 1:
            return []
        best_len, best_end = 0, -1
        for end in reversed(self._positions.get(tokens[last], ())):
            if end >= last:
                continue  # the suffix itself
            length = 1
            while (length < ngram_max and end - length >= 0
                   and tokens[end - length] == tokens[last - length]):  # fmt: skip
                length += 1
            if length > best_len:
                best_len, best_end = length, end
                if length == ngram_max:
                    break
        if best_len < ngram_min:
            return []
        return tokens[best_end + 1 : best_end + 1 + k]

    def adapt(self, accepted: int, k: int) -> None:
        """Adapt to this verification: draft one more than was accepted next time; rest after
        repeated misses (see the class docstring)."""
        self.draft_len = max(1, min(k, accepted + 1))
        if accepted:
            self._misses = 0
            return
        self._misses += 1
        if self._misses >= 2:
            self._rest = min(2 ** (self._misses - 2), self.MAX_REST)


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start (vLLM's ``spec_decode_*`` metrics): verifications with at least one
    draft, draft tokens scored, draft tokens accepted, and accepted drafts per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
