"""TTFT, inter-token latencies and TPOT of one stream, from when its content chunks arrived.

Definitions (times in seconds from when the request was sent; N = output tokens):

- **TTFT**: arrival of the first chunk that carries content (a non-empty ``delta.content`` /
  ``reasoning_content`` for chat, ``text`` for completions). Role-only and usage-only chunks
  do not count.
- **E2E**: arrival of the end of the stream (``data: [DONE]``).
- **TPOT** = (E2E − TTFT) / (N − 1): the mean time per output token after the first, as vLLM
  defines it; undefined (None) for N < 2.
- **ITL** (inter-token latency): one value per output token after the first, N − 1 of them.
  A chunk usually carries one token and contributes the gap since the previous content chunk.
  When chunks carry several tokens (a server batching its stream, a detokenizer holding back a
  partial character or a stop string), a chunk carrying k tokens contributes k values of
  gap / k, as SGLang's benchmark splits a multi-token chunk; the tokens that come with the first
  chunk contribute 0 s each (they arrived together with the first one). So the ITLs of a request
  sum to (last content chunk − first content chunk) and their count is N − 1.

How many tokens a chunk carries is not in the OpenAI stream, so it is estimated
(:func:`apportion`): every chunk carries at least one; the server's N is split over the chunks in
proportion to each chunk's text length in tokens beyond one (by the load generator's
tokenizer), and tokens that no text accounts for (a token whose text came out empty, a
character split over two tokens) go to the chunks that waited longest since the previous chunk
(the first chunk last). With one token per chunk, the common case (vLLM, llama.cpp, Tandem), the
chunk count already equals N and the rule is exact whatever the tokenizer. If the server
reports fewer tokens than there were chunks, each chunk counts as one token and the ITL count
is the chunk count − 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """The latency figures of one successful stream (see the module docstring)."""

    ttft_s: float
    e2e_s: float
    tpot_s: float | None
    itl_s: tuple[float, ...]


def apportion(
    weights: Sequence[int], total: int, priority: Sequence[float] | None = None
) -> list[int]:
    """Split ``total`` tokens over chunks: at least 1 each, the rest by ``weights``.

    Every chunk gets one token. The ``total - len(weights)`` others are shared in proportion to
    each weight's excess over 1 (evenly when no weight exceeds 1), rounded down; what rounding
    leaves goes one by one by largest remainder, then highest ``priority``, then earliest chunk.
    With ``total <= len(weights)`` every chunk gets one.
    """
    count = len(weights)
    extra = total - count
    if count == 0 or extra <= 0:
        return [1] * count
    rank = list(priority) if priority is not None else [0.0] * count
    excess = [max(0, w - 1) for w in weights]
    basis = excess if sum(excess) > 0 else [1] * count
    shares = [b * extra / sum(basis) for b in basis]
    counts = [1 + int(share) for share in shares]
    order = sorted(range(count), key=lambda i: (-(shares[i] - int(shares[i])), -rank[i], i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def stream_timing(
    chunk_times: Sequence[float], chunk_weights: Sequence[int], end_s: float, output_tokens: int
) -> StreamTiming:
    """TTFT, E2E, TPOT and ITLs of a stream whose content chunks arrived at ``chunk_times``
    (seconds after the send; at least one chunk), their texts ``chunk_weights`` tokens long by
    the tokenizer, which ended at ``end_s`` with ``output_tokens`` tokens in all."""
    waits = [-math.inf] + [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    tokens = apportion(chunk_weights, output_tokens, priority=waits)
    itl: list[float] = [0.0] * (tokens[0] - 1)
    for wait, k in zip(waits[1:], tokens[1:]):
        itl.extend([wait / k] * k)
    ttft = chunk_times[0]
    tpot = (end_s - ttft) / (output_tokens - 1) if output_tokens > 1 else None
    return StreamTiming(ttft, end_s, tpot, tuple(itl))
