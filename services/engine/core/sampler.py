"""Turns a batch of next-token logits into one token per sequence, each with its own parameters.

Every row of the batch belongs to one sequence and follows its :class:`SamplingParams` (docs/engine.md).
For each row, in this order:

1. ``min_tokens``: while fewer than ``min_tokens`` tokens were generated, the EOS ids and the
   request's ``stop_token_ids`` are masked to -inf (whatever ``ignore_eos`` says).
   ``logit_bias`` (OpenAI's) is added; a constrained row (``grammar``: its ``matcher``) masks
   every token its grammar does not allow (the masks come from :class:`GrammarMasks`, started
   on a helper thread when the step was scheduled).
2. Repetition penalty (Hugging Face semantics) over prompt + output tokens: a positive logit is
   divided by the penalty, a negative one multiplied.
3. Presence / frequency penalties (OpenAI semantics) over output tokens only:
   ``logit -= presence * (count > 0) + frequency * count``.
4. Greedy rows (temperature 0) take the argmax. Other rows: divide by temperature, then the
   top-k, top-p and min-p filters (each masks to -inf), softmax, and a draw by the exponential
   race ``argmax(probs / q)`` with ``q ~ Exp(1)`` from the row's own generator.

Logprobs, when asked for, are ``log_softmax`` of the *raw* model logits (vLLM v1's default), not
of the penalised or filtered ones.

Why a generator per row: the draw for a row depends only on its own generator and its own
probabilities, so a seeded request yields the same tokens whatever else shares the batch and at
whatever row index it sits. Unseeded sampling rows get a generator seeded from ``os.urandom``.

Speed: when every row is greedy with no penalties, no active ``min_tokens`` and no logprobs, the
whole call is one batched argmax (a constrained row keeps its argmax where its grammar allows it,
checked without a mask; the others are masked and argmaxed again) (on CPU the fused ops' vectorised one, given by the model runner
through :meth:`Sampler.use_argmax`: the same indices as ``torch.argmax``). Otherwise the masks,
penalties and filters run batched over the rows that need them; the only per-row Python loop is
the random draw filling ``q``. The general path is also the reference for the fast one (the
tests compare them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingParams
from services.engine.core.grammar import GrammarMasks
from services.engine.core.sampling_filters import (
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    sample_from_probs,
)

logger = logging.getLogger(__name__)

_NEG_INF = float("-inf")


def make_generator(
    seed: int | None, *, greedy: bool = False, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """A private random generator for one sequence.

    Args:
        seed: the request's seed; None seeds from ``os.urandom`` (still one generator per row).
        greedy: greedy rows draw nothing and get None.
        device: where the random draws happen; use the logits' device to avoid a copy per step.
    """
    if greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
    return generator


@dataclass(slots=True)
class SamplingState:
    """What the sampler needs to know about one sequence; the engine keeps one per request.

    Attributes:
        params: the request's sampling parameters.
        prompt_token_ids: the prompt (for the repetition penalty).
        output_token_ids: tokens generated so far; the engine appends each sampled token.
        generator: from :func:`make_generator`; None for greedy rows. A sampling row left at
            None gets one (on the logits' device) on its first draw.
        matcher: the request's ``llguidance.LLMatcher`` when it has a grammar (the engine
            builds it and advances it by every token it appends), else None.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    matcher: Any = None

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> SamplingState:
        """A fresh state with no output and a generator matching ``params``."""
        generator = make_generator(params.seed, greedy=params.greedy, device=device)
        return cls(params, list(prompt_token_ids), [], generator)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The chosen token's logprob and the ``k`` most likely tokens, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int = 0  # 1 = the most likely token; 0 = not computed (sampled tokens)


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One token per row; ``logprobs[i]`` is None where the row did not ask for logprobs."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # row -> why sampling that row failed (its token id is then -1): the row's request ends
    # alone with that error while the other rows' tokens stand (Sampler.__call__)
    failures: dict[int, str] = field(default_factory=dict)


# --------------------------------------------------------------------------------- sampler


class Sampler:
    """Samples one token per row from ``[B, V]`` logits, row i following ``states[i]``."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        if vocab_size < 1:
            raise InvalidArgumentError("vocab_size must be positive", param="vocab_size")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        self._argmax: Callable[[torch.Tensor], torch.Tensor | None] | None = None
        self.grammar_masks = GrammarMasks(vocab_size, self.eos_token_ids)

    def prepare(self, states: Sequence[SamplingState]) -> None:
        """A step with these sampled rows was scheduled: start its grammar masks (if any row is
        constrained) so they are computed while the model runs."""
        self.grammar_masks.prepare([state.matcher for state in states])

    def use_argmax(self, argmax: Callable[[torch.Tensor], torch.Tensor | None] | None) -> None:
        """Greedy batches take ``argmax(logits)`` (``torch.argmax``'s indices, or ``None`` for
        logits it does not take) instead of ``torch.argmax``; ``None`` restores PyTorch's."""
        self._argmax = argmax

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """Pick the next token of every row.

        Args:
            logits: ``[B, V']`` of any float dtype with ``V' >= vocab_size``; columns beyond
                ``vocab_size`` (padding) are never chosen. Not modified.
            states: ``B`` states; only a missing generator of a sampling row is filled in.

        Returns:
            The tokens (and logprobs where asked). The caller appends them to the outputs.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise InvalidArgumentError(
                f"logits of shape {tuple(logits.shape)} do not match {len(states)} states"
            )
        if logits.shape[1] < self.vocab_size:
            raise InvalidArgumentError(
                f"logits have {logits.shape[1]} columns, vocabulary is {self.vocab_size}"
            )
        if not states:
            return SamplerOutput([], [])
        logits = logits[:, : self.vocab_size]
        saved = [_GeneratorMark.of(state) for state in states]
        try:
            return self._sample(logits, states)
        except Exception as err:  # noqa: BLE001 - find the rows it belongs to
            return self._sample_rows_alone(logits, states, saved, err)

    def _sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        if all(self._plain_greedy(state, constrained=True) for state in states):
            picked = self._argmax(logits) if self._argmax is not None else None
            if picked is None:
                picked = logits.argmax(dim=-1)
            tokens: list[int] = picked.tolist()
            if any(state.matcher is not None for state in states):
                self._greedy_under_grammar(logits, states, tokens)
            return SamplerOutput(tokens, [None] * len(states))
        return self.sample_general(logits, states)

    def _sample_rows_alone(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        saved: list[_GeneratorMark],
        err: Exception,
    ) -> SamplerOutput:
        """Sampling the batch raised ``err``: sample every row alone (its generator rewound to
        where the step began, so a seeded row draws what it would have) and keep the rows that
        succeed. A row that fails alone on finite logits is its own request's failure (its
        parameters, its grammar); one that fails on non-finite logits is the forward's, and
        fails the step."""
        logger.warning("sampling a batch of %d rows failed (%s): sampling its rows one by one",
                       len(states), err)  # fmt: skip
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        failures: dict[int, str] = {}
        for row, state in enumerate(states):
            saved[row].rewind(state)
            try:
                one = self._sample(logits[row : row + 1], [state])
            except Exception as row_err:  # noqa: BLE001 - this row's alone
                if not bool(torch.isfinite(logits[row]).all()):
                    raise
                tokens.append(-1)
                logprobs.append(None)
                failures[row] = f"{type(row_err).__name__}: {row_err}"
                continue
            tokens.append(one.token_ids[0])
            logprobs.append(one.logprobs[0])
        return SamplerOutput(tokens, logprobs, failures)

    def _greedy_under_grammar(
        self, logits: torch.Tensor, states: Sequence[SamplingState], tokens: list[int]
    ) -> None:
        """Greedy constrained rows: the unconstrained argmax stands where the grammar allows it
        (exactly the masked argmax then: it is the first maximum of all tokens, so of the allowed
        ones too), checked by the matcher without computing its mask; only the other rows pay
        for a mask and a masked argmax."""
        rows = [row for row, state in enumerate(states)
                if state.matcher is not None and state.matcher.validate_tokens([tokens[row]]) != 1]
        if not rows:
            return
        allowed = self.grammar_masks.take([states[row].matcher for row in rows])
        sub = logits[torch.tensor(rows, device=logits.device)].float()
        picked = sub.masked_fill(~allowed.to(sub.device), _NEG_INF).argmax(dim=-1).tolist()
        for row, token in zip(rows, picked, strict=True):
            tokens[row] = token

    def sample_general(
        self, logits: torch.Tensor, states: Sequence[SamplingState]
    ) -> SamplerOutput:
        """The full pipeline for any mix of rows; ``__call__``'s fast path must agree with it."""
        raw = logits[:, : self.vocab_size].float()
        work = self._apply_min_tokens(raw, states)
        work = self._apply_logit_bias(work, states)
        work = self._apply_grammar(work, states)
        work = self._apply_penalties(work, states)
        token_ids: list[int] = self._choose(work, states).tolist()
        return SamplerOutput(token_ids, self._logprobs(raw, token_ids, states))

    # ----------------------------------------------------------------------------- stages

    def _plain_greedy(self, state: SamplingState, constrained: bool = False) -> bool:
        """Greedy with nothing to apply but (with ``constrained``) a grammar."""
        params = state.params
        return (
            params.greedy
            and params.logprobs is None
            and not _has_penalties(params)
            and len(state.output_token_ids) >= params.min_tokens
            and (constrained or state.matcher is None)
            and not params.logit_bias
        )

    def _apply_min_tokens(
        self, logits: torch.Tensor, states: Sequence[SamplingState]
    ) -> torch.Tensor:
        rows: list[int] = []
        columns: list[int] = []
        for row, state in enumerate(states):
            if len(state.output_token_ids) < state.params.min_tokens:
                banned = set(self.eos_token_ids)
                banned.update(t for t in state.params.stop_token_ids if t < self.vocab_size)
                rows.extend([row] * len(banned))
                columns.extend(banned)
        if not rows:
            return logits
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(columns, device=device))
        return logits.index_put(index, torch.tensor(_NEG_INF, device=device))

    def _apply_logit_bias(
        self, logits: torch.Tensor, states: Sequence[SamplingState]
    ) -> torch.Tensor:
        rows: list[int] = []
        columns: list[int] = []
        values: list[float] = []
        for row, state in enumerate(states):
            for token, bias in state.params.logit_bias:
                if token < self.vocab_size:
                    rows.append(row)
                    columns.append(token)
                    values.append(bias)
        if not rows:
            return logits
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(columns, device=device))
        return logits.index_put(index, torch.tensor(values, device=device, dtype=logits.dtype),
                                accumulate=True)  # fmt: skip

    def _apply_grammar(
        self, logits: torch.Tensor, states: Sequence[SamplingState]
    ) -> torch.Tensor:
        """Mask what each constrained row's grammar forbids (a row whose grammar allows nothing,
        a matcher in its error state, keeps its EOS ids open: GrammarMasks)."""
        matchers = [state.matcher for state in states]
        if all(m is None for m in matchers):
            return logits
        allowed = self.grammar_masks.take(matchers).to(logits.device)
        return logits.masked_fill(~allowed, _NEG_INF)

    def _apply_penalties(
        self, logits: torch.Tensor, states: Sequence[SamplingState]
    ) -> torch.Tensor:
        rows = [row for row, state in enumerate(states) if _has_penalties(state.params)]
        if not rows:
            return logits
        chosen = [states[row] for row in rows]
        index = torch.tensor(rows, device=logits.device)
        penalized = apply_penalties(
            logits.index_select(0, index),
            [s.prompt_token_ids for s in chosen],
            [s.output_token_ids for s in chosen],
            torch.tensor([s.params.repetition_penalty for s in chosen]),
            torch.tensor([s.params.presence_penalty for s in chosen]),
            torch.tensor([s.params.frequency_penalty for s in chosen]),
        )
        return logits.index_copy(0, index, penalized)

    def _choose(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Argmax for greedy rows, filtered sampling for the others; ``[B]`` int64."""
        rows = [row for row, state in enumerate(states) if not state.params.greedy]
        if not rows:
            return logits.argmax(dim=-1)
        chosen = [states[row] for row in rows]
        all_sampling = len(rows) == len(states)
        index = torch.tensor(rows, device=logits.device)
        sub = logits if all_sampling else logits.index_select(0, index)
        temperature = torch.tensor([s.params.temperature for s in chosen], device=logits.device)
        sub = sub / temperature.unsqueeze(1)
        top_k = torch.tensor([s.params.top_k for s in chosen])
        sub = apply_top_k(sub, top_k)
        if any(s.params.top_p < 1.0 for s in chosen):
            sub = apply_top_p(sub, torch.tensor([s.params.top_p for s in chosen]))
        if any(s.params.min_p > 0.0 for s in chosen):
            sub = apply_min_p(sub, torch.tensor([s.params.min_p for s in chosen]))
        generators: list[torch.Generator] = []
        for state in chosen:
            if state.generator is None:
                state.generator = make_generator(state.params.seed, device=logits.device)
            generators.append(state.generator)
        sampled = sample_from_probs(sub.softmax(dim=-1), generators)
        if all_sampling:
            return sampled
        return logits.argmax(dim=-1).index_copy(0, index, sampled)

    def _logprobs(
        self, raw: torch.Tensor, token_ids: list[int], states: Sequence[SamplingState]
    ) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * len(states)
        rows = [row for row, state in enumerate(states) if state.params.logprobs is not None]
        if not rows:
            return out
        device = raw.device
        logprobs = torch.log_softmax(raw.index_select(0, torch.tensor(rows, device=device)), -1)
        chosen_ids = torch.tensor([token_ids[row] for row in rows], device=device)
        chosen: list[float] = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
        k_max = max(states[row].params.logprobs or 0 for row in rows)
        top_values: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        if k_max:
            values, ids = logprobs.topk(k_max, dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        for i, row in enumerate(rows):
            k = states[row].params.logprobs or 0
            top = tuple(zip(top_ids[i][:k], top_values[i][:k]))
            out[row] = TokenLogprobs(token_ids[row], chosen[i], top)
        return out


@dataclass(frozen=True)
class _GeneratorMark:
    """Where a row's generator stood before a step, to rewind it if the step's batched sampling
    fails (a generator made during the failed attempt is dropped, to be made again)."""

    generator: torch.Generator | None
    state: torch.Tensor | None

    @classmethod
    def of(cls, state: SamplingState) -> _GeneratorMark:
        generator = state.generator
        if isinstance(generator, torch.Generator):
            return cls(generator, generator.get_state())
        return cls(generator, None)

    def rewind(self, state: SamplingState) -> None:
        state.generator = self.generator
        if self.generator is not None and self.state is not None:
            self.generator.set_state(self.state)


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )
