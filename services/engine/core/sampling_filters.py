"""The batched row operations the sampler applies: top-k, top-p and min-p filters, repetition /
presence / frequency penalties, and the per-row draw (``sampler.py`` says in which order and why a
generator per row).

Each takes ``[B, V]`` logits and per-row parameters as tensors, leaves a row whose parameter is
neutral as it was, and never looks at another row: a row's result does not depend on its batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

_NEG_INF = float("-inf")


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask all but each row's ``k`` largest logits (ties at the k-th value survive).

    Args:
        logits: ``[B, V]`` float.
        top_k: ``[B]`` integers; ``k <= 0`` or ``k >= V`` leaves the row as is. Keep it on the
            CPU so finding the largest k needs no device sync.

    Returns:
        A new ``[B, V]`` tensor with masked entries at -inf.
    """
    vocab = logits.shape[-1]
    k = top_k.to(torch.long)
    enabled = (k > 0) & (k < vocab)
    if not bool(enabled.any()):
        return logits
    k_max = int(k[enabled].max())
    top_values = logits.topk(k_max, dim=-1).values
    index = (k.clamp(1, k_max) - 1).to(logits.device).unsqueeze(1)
    threshold = top_values.gather(1, index)
    threshold = threshold.masked_fill(~enabled.to(logits.device).unsqueeze(1), _NEG_INF)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose probability reaches ``p``.

    A token survives when the probability mass of the tokens ranked above it is below ``p``, so
    the most likely token always survives.

    Args:
        logits: ``[B, V]`` float.
        top_p: ``[B]`` floats in (0, 1]; 1 leaves the row as is.
    """
    p = top_p.to(device=logits.device, dtype=logits.dtype).unsqueeze(1)
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    mass_above = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    remove_sorted = (mass_above >= p) & (p < 1.0)
    remove = torch.zeros_like(remove_sorted).scatter(1, sorted_index, remove_sorted)
    return logits.masked_fill(remove, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability.

    Args:
        logits: ``[B, V]`` float.
        min_p: ``[B]`` floats in [0, 1]; 0 leaves the row as is.
    """
    probs = logits.softmax(dim=-1)
    scale = min_p.to(device=logits.device, dtype=probs.dtype).unsqueeze(1)
    threshold = probs.amax(dim=-1, keepdim=True) * scale
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """Repetition (HF, prompt + output) then presence / frequency (OpenAI, output) penalties.

    Args:
        logits: ``[B, V]`` float.
        prompt_token_ids / output_token_ids: per row, the tokens seen so far.
        repetition_penalty: ``[B]``; 1 leaves the row as is.
        presence_penalty / frequency_penalty: ``[B]``; 0 leaves the row as is.

    Returns:
        A new ``[B, V]`` tensor.
    """
    rows, vocab = logits.shape
    device, dtype = logits.device, logits.dtype
    output_counts = _token_counts(output_token_ids, rows, vocab, device).to(dtype)
    out = logits
    if bool((repetition_penalty != 1.0).any()):
        seen = (_token_counts(prompt_token_ids, rows, vocab, device) > 0) | (output_counts > 0)
        penalty = repetition_penalty.to(device=device, dtype=dtype).unsqueeze(1)
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
    presence = presence_penalty.to(device=device, dtype=dtype).unsqueeze(1)
    frequency = frequency_penalty.to(device=device, dtype=dtype).unsqueeze(1)
    return out - (presence * (output_counts > 0).to(dtype) + frequency * output_counts)


def sample_from_probs(
    probs: torch.Tensor, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """Draw one token per row by the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``.

    Row i's noise comes only from ``generators[i]``, so its draw is independent of the batch.
    A generator on another device than ``probs`` draws there and the noise is copied over.

    Returns:
        ``[B]`` int64 token ids on ``probs``' device.
    """
    noise = torch.empty_like(probs)
    for row, generator in enumerate(generators):
        if generator.device == probs.device:
            noise[row].exponential_(generator=generator)
        else:
            draw = torch.empty(probs.shape[-1], dtype=probs.dtype, device=generator.device)
            noise[row].copy_(draw.exponential_(generator=generator))
    return probs.div(noise).argmax(dim=-1)


def skip_draws(generator: torch.Generator, vocab_size: int, tokens: int) -> None:
    """Advance ``generator`` past ``tokens`` draws of :func:`sample_from_probs` (one float32
    ``Exp(1)`` per vocabulary entry each), so that a sequence continued on another worker (the KV
    hand-off) draws what it would have drawn had it never moved."""
    scratch = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(tokens):
        scratch.exponential_(generator=generator)


def _token_counts(
    token_lists: Sequence[Sequence[int]], rows: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """``[rows, vocab]`` int64 occurrence counts; ids outside the vocabulary are ignored."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.long)
    flat = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    row_of = torch.repeat_interleave(torch.arange(rows), lengths)
    keep = (flat >= 0) & (flat < vocab)
    linear = (row_of[keep] * vocab + flat[keep]).to(device)
    return torch.bincount(linear, minlength=rows * vocab).view(rows, vocab)
