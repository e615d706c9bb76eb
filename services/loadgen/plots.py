"""PNG figures of a sweep, with matplotlib (Agg, no display), imported only when plotting.

Written into ``--output-dir``, for each kind of level that ran (``concurrency`` / ``rate``):

- ``throughput_<kind>.png``: output tokens/s and requests/s (and goodput when an SLO is set)
  against the level, one line per server;
- ``latency_<kind>.png``: TTFT, ITL, TPOT and E2E p50 / p90 / p99 against the level, one
  colour per server, one line style per percentile;

and for every level: ``ttft_cdf.png`` and ``itl_cdf.png``, the empirical CDFs of the successful
requests' TTFTs and of every ITL, one line per level, one panel per server.

Levels sit at evenly spaced positions labelled with their value (so ``inf`` has a place), in
the order they ran; compared servers ran the same levels and share the axes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from services.loadgen.metrics import Distribution, LevelSummary
from services.loadgen.results import LevelKind, LevelResult, ServerRun

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

_PERCENTILES = (("p50", "-"), ("p90", "--"), ("p99", ":"))
_LATENCIES: tuple[tuple[str, str, float], ...] = (
    ("ttft", "TTFT (ms)", 1e3), ("itl", "ITL (ms)", 1e3),
    ("tpot", "TPOT (ms)", 1e3), ("e2e", "E2E latency (s)", 1.0),
)  # fmt: skip
_X_LABELS = {"concurrency": "concurrency (requests in flight)", "rate": "request rate (req/s)"}


def write_plots(out_dir: Path, runs: Sequence[ServerRun]) -> list[Path]:
    """Write every figure into ``out_dir``; returns the paths written."""
    written: list[Path] = []
    kinds: list[LevelKind] = []
    for result in (result for run in runs for result in run.levels):
        if result.level.kind not in kinds:
            kinds.append(result.level.kind)
    for kind in kinds:
        per_server = [(run.name, [r for r in run.levels if r.level.kind == kind]) for run in runs]
        written.append(_save(_throughput(per_server, kind), out_dir / f"throughput_{kind}.png"))
        written.append(_save(_latency(per_server, kind), out_dir / f"latency_{kind}.png"))
    written.append(_save(_cdf(runs, "TTFT (ms)", _ttfts), out_dir / "ttft_cdf.png"))
    written.append(_save(_cdf(runs, "ITL (ms)", _itls), out_dir / "itl_cdf.png"))
    return written


def _figure(rows: int, cols: int, width: float, height: float, share: bool = False) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    figure.subplots(rows, cols, squeeze=False, sharex=share, sharey=share)
    return figure


def _save(figure: Figure, path: Path) -> Path:
    figure.savefig(path, dpi=110)
    logger.info("wrote %s", path)
    return path


def _positions(results: Sequence[LevelResult]) -> tuple[list[int], list[str]]:
    return list(range(len(results))), [r.level.axis_label for r in results]


def _throughput(per_server: Sequence[tuple[str, list[LevelResult]]], kind: LevelKind) -> Figure:
    figure = _figure(1, 2, 11, 4.2)
    tokens_ax, requests_ax = figure.axes
    for color, (name, results) in zip(_colors(), per_server):
        xs, labels = _positions(results)
        sums = [r.summary for r in results]
        tokens_ax.plot(xs, [s.output_throughput for s in sums], "o-", color=color, label=name)
        requests_ax.plot(xs, [s.request_throughput for s in sums], "o-", color=color,
                         label=f"{name} requests/s")  # fmt: skip
        if any(s.goodput_rate is not None for s in sums):
            requests_ax.plot(xs, [s.goodput_rate or 0.0 for s in sums], "s--", color=color,
                             label=f"{name} goodput")  # fmt: skip
        for ax in (tokens_ax, requests_ax):
            ax.set_xticks(xs, labels)
    tokens_ax.set_title("output throughput")
    tokens_ax.set_ylabel("output tokens/s")
    requests_ax.set_title("request throughput")
    requests_ax.set_ylabel("requests/s")
    for ax in (tokens_ax, requests_ax):
        _finish(ax, _X_LABELS[kind])
    return figure


def _latency(per_server: Sequence[tuple[str, list[LevelResult]]], kind: LevelKind) -> Figure:
    figure = _figure(2, 2, 11, 7.5)
    for ax, (field, title, scale) in zip(figure.axes, _LATENCIES):
        for color, (name, results) in zip(_colors(), per_server):
            xs, labels = _positions(results)
            dists = [_dist(r.summary, field) for r in results]
            for percentile, style in _PERCENTILES:
                ys = [getattr(d, percentile) * scale if d else float("nan") for d in dists]
                label = percentile if len(per_server) == 1 else f"{name} {percentile}"
                ax.plot(xs, ys, marker="o", linestyle=style, color=color, label=label)
            ax.set_xticks(xs, labels)
        ax.set_title(title)
        ax.set_ylabel(title)
        _finish(ax, _X_LABELS[kind])
    return figure


def _cdf(
    runs: Sequence[ServerRun], xlabel: str, values: Callable[[LevelResult], list[float]]
) -> Figure:
    figure = _figure(1, len(runs), 5.5 * len(runs), 4.2, share=True)
    for ax, run in zip(figure.axes, runs):
        for color, result in zip(_colors(), run.levels):
            xs = sorted(v * 1e3 for v in values(result))
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", color=color, label=result.level.label)
        ax.set_title(f"{run.name}: {xlabel.split()[0]} CDF")
        ax.set_ylabel("fraction of values ≤ x")
        ax.set_ylim(0, 1.02)
        _finish(ax, xlabel)
    return figure


def _finish(ax: Axes, xlabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _dist(summary: LevelSummary, field: str) -> Distribution | None:
    dist = getattr(summary, field)
    return dist if isinstance(dist, Distribution) else None


def _ttfts(result: LevelResult) -> list[float]:
    return [r.ttft_s for r in result.records if r.ok and r.ttft_s is not None]


def _itls(result: LevelResult) -> list[float]:
    return [x for r in result.records if r.ok for x in r.itl_s]


def _colors() -> list[str]:
    return [f"C{i % 10}" for i in range(100)]
