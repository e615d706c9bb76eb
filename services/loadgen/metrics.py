"""A level's summary: throughput, latency distributions, goodput and errors.

Definitions (docs/loadgen.md has the full list):

- duration: the level's first send to its last request's end (``runner.py``).
- request throughput: successful requests / duration. Output token throughput: the successful
  requests' output tokens / duration; total token throughput adds their prompt tokens.
- TTFT, TPOT, ITL, E2E: mean and the 50th, 90th and 99th percentiles over successful requests
  (ITL over every inter-token latency of every successful request). Percentiles interpolate
  linearly between the two nearest ranks (NumPy's default, as vLLM's benchmark reports them).
- goodput under ``--slo ttft=0.5,tpot=0.05,e2e=10`` (seconds, any subset): a request is good
  when it succeeded and meets every given bound (a one-token request has no TPOT and meets a
  TPOT bound). Reported as the fraction of all the level's requests, failures included, and as
  good requests per second of duration.
- errors: every failed request counted by kind, with the first two distinct messages of every
  kind. Failed requests count in the totals and the goodput denominator and nowhere else.
- rejected: the 429s among them (admission control), with the send → 429 latency distribution
  and how many came without ``Retry-After``: an overload run shows refusals are immediate.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.common.errors import InvalidArgumentError
from services.loadgen.record import RequestRecord

MESSAGES_PER_KIND = 2  # distinct error messages kept per error kind and level
_SLO_KEYS = ("ttft", "tpot", "e2e")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Distribution:
    """Mean and percentiles of one latency, in seconds, over ``count`` values."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution | None:
        if not values:
            return None
        return cls(len(values), sum(values) / len(values), percentile(values, 50),
                   percentile(values, 90), percentile(values, 99))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency bounds in seconds; None means no bound."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """``"ttft=0.5,tpot=0.05"`` → ``Slo(ttft_s=0.5, tpot_s=0.05)``."""
        bounds: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            if not sep or key not in _SLO_KEYS:
                raise InvalidArgumentError(
                    f"--slo expects KEY=SECONDS with KEY in {', '.join(_SLO_KEYS)}, got {item!r}"
                )
            try:
                bound = float(value)
            except ValueError as exc:
                raise InvalidArgumentError(f"--slo {key}: not a number: {value!r}") from exc
            if not bound > 0:
                raise InvalidArgumentError(f"--slo {key} must be positive, got {value}")
            bounds[f"{key}_s"] = bound
        if not bounds:
            raise InvalidArgumentError("--slo names no bound")
        return cls(**bounds)

    def met_by(self, record: RequestRecord) -> bool:
        """Whether ``record`` succeeded within every bound."""
        if not record.ok:
            return False
        checks = ((self.ttft_s, record.ttft_s), (self.tpot_s, record.tpot_s),
                  (self.e2e_s, record.e2e_s))  # fmt: skip
        return all(bound is None or value is None or value <= bound for bound, value in checks)

    def to_json(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True, slots=True)
class LevelSummary:
    """Everything the table, the JSON and the plots say about one level."""

    requests: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    output_tokens: int
    prompt_tokens: int
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2e: Distribution | None
    errors_by_kind: dict[str, int]
    first_errors: tuple[str, ...]
    output_tokens_from_tokenizer: int  # successful requests whose server sent no usage
    shorter_than_max_tokens: int  # successful answers that stopped before max_tokens
    goodput_fraction: float | None = None
    goodput_rate: float | None = None
    rejected: int = 0  # 429s (also in errors_by_kind["rejected"])
    reject_latency: Distribution | None = None  # send → the 429
    rejected_without_retry_after: int = 0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["first_errors"] = list(self.first_errors)
        return out


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slo: Slo | None = None
) -> LevelSummary:
    """The summary of one level's records (see the module docstring)."""
    good = [r for r in records if r.ok]
    bad = [r for r in records if not r.ok]
    rejected = [r for r in bad if r.error_kind == "rejected"]
    out_tokens = sum(r.output_tokens for r in good)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in good)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    goodput_fraction = goodput_rate = None
    if slo is not None:
        meeting = sum(1 for r in records if slo.met_by(r))
        goodput_fraction = meeting / len(records) if records else 0.0
        goodput_rate = meeting * per_s
    return LevelSummary(
        requests=len(records),
        completed=len(good),
        failed=len(bad),
        duration_s=duration_s,
        request_throughput=len(good) * per_s,
        output_throughput=out_tokens * per_s,
        total_token_throughput=(out_tokens + prompt_tokens) * per_s,
        output_tokens=out_tokens,
        prompt_tokens=prompt_tokens,
        ttft=Distribution.of(_values(r.ttft_s for r in good)),
        tpot=Distribution.of(_values(r.tpot_s for r in good)),
        itl=Distribution.of([x for r in good for x in r.itl_s]),
        e2e=Distribution.of(_values(r.e2e_s for r in good)),
        errors_by_kind=dict(Counter(r.error_kind or "unknown" for r in bad)),
        first_errors=_first_messages(bad),
        output_tokens_from_tokenizer=sum(1 for r in good if r.output_tokens_from != "usage"),
        shorter_than_max_tokens=sum(1 for r in good if r.output_tokens < r.max_tokens),
        goodput_fraction=goodput_fraction,
        goodput_rate=goodput_rate,
        rejected=len(rejected),
        reject_latency=Distribution.of(_values(r.e2e_s for r in rejected)),
        rejected_without_retry_after=sum(1 for r in rejected if r.retry_after_s is None),
    )


def _values(items: Iterable[float | None]) -> list[float]:
    return [x for x in items if x is not None]


def _first_messages(failed: Iterable[RequestRecord]) -> tuple[str, ...]:
    """``"kind: message"`` for the first distinct messages of every error kind, in send order."""
    kept: dict[str, None] = {}
    per_kind: Counter[str] = Counter()
    for record in failed:
        line = f"{record.error_kind}: {record.error}"
        if line not in kept and per_kind[record.error_kind or ""] < MESSAGES_PER_KIND:
            kept[line] = None
            per_kind[record.error_kind or ""] += 1
    return tuple(kept)
