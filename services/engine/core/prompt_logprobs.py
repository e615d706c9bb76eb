"""Prompt logprobs (vLLM's ``prompt_logprobs``): for every prompt token after the first, its
log-probability given the tokens before it, its rank in the vocabulary and the ``k`` most likely
tokens at that position.

What scorers (evaluation harnesses computing loglikelihoods, ``echo`` with ``logprobs`` on
``/v1/completions``) need is the model's own distribution: the float32 log-softmax of the raw
logits, before any sampling processor (temperature, penalties, bias, grammar) — what
``torch.log_softmax(transformers_model(ids).logits, -1)`` gives. They are computed where the
prompt is prefilled (a prefill worker, or a decode worker prefilling locally), from the hidden
states the forward pass computes anyway: the model runner marks, per step, the rows of prompt
positions whose next token is still a prompt token (:class:`PromptRows`), and :func:`score_rows`
runs only those rows through the LM head, a slice at a time, so a long prompt never holds a
``[tokens, vocab]`` matrix at once.

Such a prompt is computed whole: the scheduler does not read it from the prefix cache (a cached
position has no hidden state here), and a position scored once (before a preemption recomputed
it) is not scored again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.core.sampler import TokenLogprobs
from services.engine.core.sequence import Sequence

ROWS_PER_SLICE = 128
"""Rows projected to the vocabulary at once (128 x 150k float32 logits: ~77 MB)."""


@dataclass(slots=True)
class PromptRows:
    """One sequence's scored rows in a step: rows of the step's hidden states, and the prompt
    token each one predicts (the token at the row's position + 1)."""

    seq: Sequence
    rows: list[int]
    targets: list[int]


def rows_to_score(seq: Sequence, start: int, n: int, first_row: int) -> PromptRows | None:
    """The rows of ``seq``'s slice ``[start, start + n)`` (its rows from ``first_row`` on) whose
    next token is a prompt token not scored yet; None when there are none or the request did not
    ask for prompt logprobs."""
    if seq.params.prompt_logprobs is None:
        return None
    prompt = seq.prompt_token_ids
    lo = max(start, len(seq.prompt_logprobs))
    hi = min(start + n, len(prompt) - 1)
    if lo >= hi:
        return None
    return PromptRows(seq, [first_row + p - start for p in range(lo, hi)], prompt[lo + 1 : hi + 1])


def score_rows(
    hidden: torch.Tensor,
    wanted: list[PromptRows],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> None:
    """Append each wanted row's :class:`TokenLogprobs` (token, logprob, rank, top k) to its
    sequence's ``prompt_logprobs``."""
    for item in wanted:
        k = item.seq.params.prompt_logprobs or 0
        for lo in range(0, len(item.rows), ROWS_PER_SLICE):
            rows = torch.tensor(item.rows[lo : lo + ROWS_PER_SLICE], device=hidden.device)
            targets = torch.tensor(item.targets[lo : lo + ROWS_PER_SLICE], device=hidden.device)
            logits = compute_logits(hidden.index_select(0, rows))[:, :vocab_size].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            chosen = logprobs.gather(1, targets[:, None])
            ranks = (logprobs > chosen).sum(dim=-1) + 1
            if k > 0:
                top_values, top_ids = logprobs.topk(k, dim=-1)
                tops = list(zip(top_ids.tolist(), top_values.tolist()))
            else:
                tops = [([], [])] * len(rows)
            for token, value, rank, (ids, values) in zip(
                item.targets[lo : lo + ROWS_PER_SLICE], chosen[:, 0].tolist(), ranks.tolist(), tops
            ):
                item.seq.prompt_logprobs.append(
                    TokenLogprobs(token, value, tuple(zip(ids, values)), rank)
                )
