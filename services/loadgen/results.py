"""What a sweep produced: its levels, each level's records, and each server's run.

A *level* is one load setting of the sweep: a fixed number of requests in flight
(``--concurrency``) or a Poisson arrival rate (``--request-rate``). Levels run one after another,
each with ``--num-prompts`` requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from services.loadgen.record import RequestRecord

if TYPE_CHECKING:
    from services.loadgen.metrics import LevelSummary

LevelKind = Literal["concurrency", "rate"]


@dataclass(frozen=True, slots=True)
class Level:
    """One load setting: ``value`` requests in flight, or ``value`` requests/s (inf: at once)."""

    kind: LevelKind
    value: float

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"c={int(self.value)}"
        return "rate=inf" if math.isinf(self.value) else f"rate={self.value:g}/s"

    @property
    def axis_label(self) -> str:
        """The value as an x-axis tick."""
        return "inf" if math.isinf(self.value) else f"{self.value:g}"

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "value": "inf" if math.isinf(self.value) else self.value,
                "label": self.label}  # fmt: skip


@dataclass(frozen=True, slots=True)
class LevelResult:
    """One level against one server: its records (in send order) and its summary."""

    level: Level
    duration_s: float
    records: tuple[RequestRecord, ...]
    summary: LevelSummary


@dataclass(slots=True)
class ServerRun:
    """One server's sweep."""

    name: str
    base_url: str
    model: str
    levels: list[LevelResult] = field(default_factory=list)
    warmup_errors: list[str] = field(default_factory=list)
    dropped_fields: list[str] = field(default_factory=list)
