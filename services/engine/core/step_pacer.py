"""Step pacing: how many prompt tokens a step may carry beside running decodes, by time.

A step with decode rows in it is the next token of every stream in it, and a prompt chunk in the
same step delays them all by its compute. The token budget (``max_num_batched_tokens``) bounds a
chunk's tokens, not its time: on two CPU cores, with a prefill worker holding one of them, a
1,024-token chunk of the default 135M model took 3 s and the chunks after it 4 and 6 s (each
attends over the prompt's growing context), so a stream stalled for seconds while a long prompt
was prefilled beside it. Sarathi-Serve's answer is a chunk sized to the stall the streams can
take; here the size comes from a time target (``EngineConfig.max_step_ms``, the workers'
``--max-step-ms``) and the engine's own measured speed:

* A chunk's cost is its multiply-adds, from the model's shape (:class:`ChunkCost`): ``n`` tokens
  after ``c`` computed ones cost ``n`` times the projections and MLP, plus the attention of each
  token over the keys it sees (``c + i``; a sliding layer's at most its window). A chunk late in
  a long prompt therefore gets fewer tokens than an early one.
* The engine's rate (multiply-adds a second and thread) is learnt from the steps it ran
  (:meth:`StepPacer.observe`): after a step with prompt chunks, ``work / (seconds - decode
  part) / threads``, averaged; the decode part is the median time of recent steps without prompt
  chunks. Per thread, because the same engine runs one thread or all of them, step by step, when
  workers share cores (``services/common/core_share.py``): a step's room is the rate times the
  threads it runs with.
* A step with decode rows gives its prompt chunks the work that fits in ``target - decode part``
  (:meth:`StepPacer.prompt_room`), and the first chunk at least :data:`MIN_CHUNK` tokens, so a
  prompt always advances, however slow the step.
* A step without decode rows (a prefill worker's; a decode worker with no stream running) keeps
  the token budget alone: nobody waits on it.

Which tokens a step computes never changes what they compute (every row's result is independent
of its chunk, batch and step: ``tests/test_deterministic_greedy.py``), so pacing moves time only.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from services.common.model_config import ModelConfig

MIN_CHUNK = 16
"""Prompt tokens the first chunk of a paced step always gets (one KV block's worth)."""

SMOOTHING = 0.3
"""Weight of the newest step in the average of the rate."""

DECODE_WINDOW = 9
"""Steps without prompt chunks whose median is the decode part (a median: one step slowed by
something else must not starve the prompts that follow)."""


@dataclass(frozen=True, slots=True)
class ChunkCost:
    """Multiply-adds of prompt tokens, from the model's shape (the LM head aside: a prompt's rows
    do not reach it, bar the sampled one).

    ``linear``: per token, every layer's projections and MLP (an MoE layer's routed experts at
    ``num_experts_per_tok``); ``attention`` / ``sliding_attention``: per token and key it attends
    to, summed over the full-attention / sliding layers (scores and the weighted values);
    ``window``: the sliding layers' window.
    """

    linear: float
    attention: float
    sliding_attention: float = 0.0
    window: int = 0

    @classmethod
    def of(cls, cfg: ModelConfig) -> ChunkCost:
        q_dim = cfg.num_heads * cfg.head_dim
        kv_dim = cfg.num_kv_heads * cfg.head_dim
        linear = attention = sliding = 0.0
        for layer in range(cfg.num_layers):
            linear += cfg.hidden_size * (2 * q_dim + 2 * kv_dim)  # q, k, v and o
            if cfg.is_moe_layer(layer):
                linear += cfg.hidden_size * (
                    3 * cfg.moe_intermediate_size * cfg.num_experts_per_tok + cfg.num_experts
                )
            else:
                linear += 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up and down
            if cfg.is_sliding(layer):
                sliding += 2 * q_dim
            else:
                attention += 2 * q_dim
        return cls(linear, attention, sliding, cfg.sliding_window or 0)

    def work(self, tokens: int, context: int) -> float:
        """Multiply-adds of ``tokens`` prompt tokens after ``context`` computed ones."""
        if tokens <= 0:
            return 0.0
        keys = tokens * context + tokens * (tokens + 1) / 2  # token i sees context + i keys
        total = tokens * self.linear + self.attention * keys
        if self.sliding_attention:
            total += self.sliding_attention * _window_keys(tokens, context, self.window)
        return total

    def tokens_within(self, work: float, context: int, limit: int) -> int:
        """The most tokens (up to ``limit``) after ``context`` whose :meth:`work` fits ``work``."""
        low, high = 0, limit
        while low < high:  # work() grows with tokens: the largest n that fits
            mid = (low + high + 1) // 2
            if self.work(mid, context) <= work:
                low = mid
            else:
                high = mid - 1
        return low


def _window_keys(tokens: int, context: int, window: int) -> float:
    """Sum over i = 1..tokens of min(context + i, window)."""
    below = max(0, min(tokens, window - context))  # tokens whose context + i stays <= window
    return below * context + below * (below + 1) / 2 + (tokens - below) * window


class StepPacer:
    """Learns the engine's speed from its steps and sizes prompt chunks beside decode rows to a
    step time target (see the module docstring)."""

    def __init__(self, cost: ChunkCost, target_seconds: float,
                 threads: Callable[[], int] = lambda: 1) -> None:  # fmt: skip
        """``threads``: the threads the engine's step runs with (PyTorch's on CPU, read at
        each step; one on a GPU)."""
        if target_seconds <= 0:
            raise ValueError("a step time target must be positive")
        self.cost = cost
        self.target = target_seconds
        self.threads = threads
        self.rate: float | None = None  # multiply-adds a second and thread; None: none timed yet
        self._decode_steps: deque[float] = deque(maxlen=DECODE_WINDOW)

    @property
    def decode_seconds(self) -> float:
        """The decode part: the median of recent steps without prompt chunks (0 before any)."""
        return statistics.median(self._decode_steps) if self._decode_steps else 0.0

    def room(self) -> StepRoom:
        """The prompt allowance of one step with decode rows: the multiply-adds that fit in
        ``target - decode part`` (none until the rate is known: the first chunk then gets
        :data:`MIN_CHUNK` tokens, and its time sets the rate)."""
        seconds = max(0.0, self.target - self.decode_seconds)
        rate = self.rate * max(1, self.threads()) if self.rate is not None else 0.0
        return StepRoom(self.cost, seconds * rate)

    def observe(self, chunks: list[tuple[int, int]], decoding: bool, seconds: float) -> None:
        """A step ran for ``seconds`` with these prompt chunks (``(tokens, context)`` each) and,
        when ``decoding``, decode rows."""
        if seconds <= 0:
            return
        if not chunks:
            if decoding:
                self._decode_steps.append(seconds)
            return
        work = sum(self.cost.work(tokens, context) for tokens, context in chunks)
        # the chunks' own share of the step: all of it but the decode rows' usual time, and never
        # under a quarter of it (a step slower than usual for another reason is not all decode)
        own = seconds - self.decode_seconds if decoding else seconds
        rate = work / max(own, 0.25 * seconds) / max(1, self.threads())
        self.rate = rate if self.rate is None else self.rate + SMOOTHING * (rate - self.rate)


class StepRoom:
    """What is left of one step's prompt allowance while the scheduler fills the step."""

    def __init__(self, cost: ChunkCost, work: float) -> None:
        self.cost = cost
        self.work = work
        self.first = True  # no prompt chunk taken yet: the next gets MIN_CHUNK tokens at least

    @property
    def exhausted(self) -> bool:
        """Whether no further prompt token fits (a new prompt is then not admitted)."""
        return not self.first and self.work < self.cost.linear

    def take(self, tokens: int, context: int) -> int:
        """How many of ``tokens`` prompt tokens after ``context`` computed ones go in this step
        (possibly 0), and charge them."""
        fits = self.cost.tokens_within(self.work, context, tokens)
        if self.first:
            fits = max(fits, min(tokens, MIN_CHUNK))
            self.first = False
        self.work -= self.cost.work(fits, context)
        return fits
