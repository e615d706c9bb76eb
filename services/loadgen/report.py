"""The results as a markdown table (stdout) and as one JSON document (``--output-dir``).

The table has one row per level (and server, with ``--compare``): requests that succeeded out of
those sent, errors by kind, request / output-token / total-token throughput, TTFT, TPOT and ITL
in milliseconds and E2E in seconds as ``mean (p50 / p90 / p99)``, and goodput when an SLO is
given. Below it, the first error messages of every level that had errors: failures are never
left out. The JSON holds the run's configuration, the command line, the date, every server's
URL and model, and per level its summary and every request's record.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.loadgen.metrics import Distribution
from services.loadgen.results import LevelResult, ServerRun


def markdown_table(runs: Sequence[ServerRun], with_goodput: bool) -> str:
    """The results table, one row per (server, level), and the levels' first error messages."""
    show_server = len(runs) > 1
    header = ["level", "ok / sent", "errors", "req/s", "output tok/s", "total tok/s",
              "TTFT ms mean (p50 / p90 / p99)", "TPOT ms mean (p50 / p90 / p99)",
              "ITL ms mean (p50 / p90 / p99)", "E2E s mean (p50 / p90 / p99)"]  # fmt: skip
    if show_server:
        header.insert(0, "server")
    if with_goodput:
        header.append("goodput")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes: list[str] = []
    for run in runs:
        for result in run.levels:
            s = result.summary
            cells = [
                result.level.label, f"{s.completed} / {s.requests}", _errors_cell(s.errors_by_kind),
                f"{s.request_throughput:.2f}", f"{s.output_throughput:.1f}",
                f"{s.total_token_throughput:.1f}", _dist_cell(s.ttft, 1e3), _dist_cell(s.tpot, 1e3),
                _dist_cell(s.itl, 1e3), _dist_cell(s.e2e, 1.0, digits=2),
            ]  # fmt: skip
            if show_server:
                cells.insert(0, run.name)
            if with_goodput:
                cells.append(
                    f"{100 * (s.goodput_fraction or 0):.0f}% ({s.goodput_rate or 0:.2f} req/s)"
                )
            lines.append("| " + " | ".join(cells) + " |")
            where = f"{run.name} {result.level.label}" if show_server else result.level.label
            notes += [f"- {where}: {message}" for message in s.first_errors]
            if s.output_tokens_from_tokenizer:
                notes.append(
                    f"- {where}: no usage from the server for {s.output_tokens_from_tokenizer} "
                    "requests; their output tokens are tokenizer counts"
                )
            if s.rejected:
                late = s.reject_latency
                notes.append(
                    f"- {where}: {s.rejected} rejected with 429 in "
                    f"{_dist_cell(late, 1e3)} ms (mean (p50 / p90 / p99)); "
                    f"{s.rejected_without_retry_after} without Retry-After"
                )
            if s.shorter_than_max_tokens:
                notes.append(
                    f"- {where}: {s.shorter_than_max_tokens} answers stopped before max_tokens "
                    "(EOS or a stop string: does the server ignore ignore_eos?)"
                )
        notes += [f"- {run.name} warm-up: {message}" for message in run.warmup_errors]
        notes += [f"- {run.name}: the server refused `{name}`; sent without it"
                  for name in run.dropped_fields]  # fmt: skip
    if notes:
        lines += ["", "Errors and notes:", *notes]
    return "\n".join(lines)


def _errors_cell(by_kind: Mapping[str, int]) -> str:
    if not by_kind:
        return "0"
    total = sum(by_kind.values())
    return f"{total} (" + ", ".join(f"{k}: {n}" for k, n in sorted(by_kind.items())) + ")"


def _dist_cell(dist: Distribution | None, scale: float, digits: int = 1) -> str:
    if dist is None:
        return "–"
    f = f"{{:.{digits}f}}"
    p = " / ".join(f.format(v * scale) for v in (dist.p50, dist.p90, dist.p99))
    return f"{f.format(dist.mean * scale)} ({p})"


def results_document(
    runs: Sequence[ServerRun], config: Mapping[str, Any], argv: Sequence[str]
) -> dict[str, Any]:
    """The whole run as a JSON-ready dict."""
    return {
        "tool": "tandem bench serve",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(argv),
        "config": dict(config),
        "servers": [
            {
                "name": run.name, "base_url": run.base_url, "model": run.model,
                "dropped_fields": run.dropped_fields, "warmup_errors": run.warmup_errors,
                "levels": [_level_json(result) for result in run.levels],
            }  # fmt: skip
            for run in runs
        ],
    }


def _level_json(result: LevelResult) -> dict[str, Any]:
    return {
        "level": result.level.to_json(),
        "duration_s": result.duration_s,
        "summary": result.summary.to_json(),
        "records": [record.to_json() for record in result.records],
    }


def write_json(path: Path, document: Mapping[str, Any]) -> None:
    """``document`` as indented JSON; infinities become the string ``"inf"`` (JSON has none)."""
    path.write_text(json.dumps(_finite(document), indent=1, allow_nan=False) + "\n")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
