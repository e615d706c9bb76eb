"""Measure a native kernel against the PyTorch path on the model's own layers; keep the faster.

A kernel tuned on one CPU can lose on another (vector width, cache sizes, how good the local BLAS
is), so a fast path has to prove itself on the machine it runs on. The first time a kernel build
meets a model's layer shapes, :func:`choose_regimes`:

1. runs the model's layers (their real shapes, weights read from memory) once per path to warm
   up, for each row regime: decode of 1, 8 and 32 rows and a prefill chunk of 512 rows;
2. times each path as the best of a few alternating runs;
3. picks, per regime, the faster path (the kernel only when it wins by more than
   :data:`MARGIN`, or the margin the caller gives, one for all regimes or one per regime: a near
   tie is noise, and goes to PyTorch); a
   row count uses the regime of the smallest measured count at or above it (2-8 rows → the
   8-row choice, 33+ rows → prefill);
4. caches the decision as JSON next to the kernel build (keyed by the build, the format, the
   shapes, the thread count, the torch version and any limit on PyTorch's BLAS instruction set),
   so later starts reuse it, and logs it once
   in one line: format, instruction set, measured speed ratio per regime.

When it measures: never on the way to a worker's ``ready``. Measuring every kernel against
PyTorch took a 2-core machine ~50 s per start (two workers timing each other's load, each then
finding the machine "busy" and caching nothing). ``TANDEM_AUTOTUNE`` (read at each call):

* unset or ``cached`` (the default): the decision ``tandem tune`` cached for this build, format,
  shapes and thread count; where there is none, the fixed table (the ``fixed`` path the caller
  gives: what the measurements mostly chose on AVX2 and AVX-512 machines, the same for both),
  measuring nothing. Every process on a machine therefore takes the same path.
* ``fixed``: the fixed table even where a decision is cached (replicas on different machines
  that must compute the same bits: compose, Kubernetes).
* ``measure``: measure what is not cached yet, and cache it (the old default; tests).
* ``remeasure``: measure everything again and overwrite the cache (``tandem tune``).

Workers that start together (``tandem up``) would time each other's load; a lock file beside the
cache makes them measure one at a time, and the later ones find the decision already cached. A
measurement taken while something else keeps the cores busy is used but not cached, so a busy
moment does not decide for every later start: busy means a load average above the core count
before measuring, or other processes using more than :data:`OTHERS_LIMIT` of the CPUs while
measuring (``/proc/stat`` against this process's own CPU time). The load average alone lags by a
minute and misses a burst: on a development machine that also ran the test suite, a cached
decision had a float32 kernel 1.12x faster at prefill where it measured 0.63x on an idle machine.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.core.kernels.native_build import cache_dir

logger = logging.getLogger(__name__)

# A prefill chunk is timed at 512 rows, not fewer: PyTorch's GEMM gains on the kernels as rows grow
# (the q4 gate/up projection: kernel 1.06x at 256 rows, 0.87x at 512, 0.80x at 1,024, AVX-512), and
# prompts run in chunks of up to the step budget (1,024 tokens by default).
REGIME_ROWS = (1, 8, 32, 512)
# PyTorch's BLAS instruction-set limits: they change how fast the PyTorch path is
BLAS_LIMIT_VARIABLES = ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
REPEATS = 5
# the kernel must beat PyTorch by this fraction: within it the two are a tie that run-to-run noise
# decides, and a tie goes to the reference path. 10%, not less: on a shared 2-core VM a 5% win at
# the 256-row regime was noise once, and the float32 kernel then ran 512-row prefills at 0.6x MKL.
MARGIN = 0.10
# a ratio a busy machine's noise is not taken to explain: measured while busy, a choice that
# changes results follows its measurement only beyond it, else the caller's fixed path
CLEAR = 2.0
# other processes' share of all CPUs during a measurement above which it is not cached
OTHERS_LIMIT = 0.15
AUTOTUNE_MODES = ("cached", "fixed", "measure", "remeasure")


def autotune_mode() -> str:
    """``$TANDEM_AUTOTUNE`` (``cached`` when unset); an unknown value is an error."""
    mode = os.environ.get("TANDEM_AUTOTUNE", "").strip().lower() or "cached"
    if mode not in AUTOTUNE_MODES:
        raise ValueError(f"TANDEM_AUTOTUNE={mode!r} is not one of {', '.join(AUTOTUNE_MODES)}")
    return mode


@dataclass(frozen=True, slots=True)
class KernelRegimes:
    """Per measured row count, whether the kernel (True) or the PyTorch path runs."""

    rows: tuple[int, ...] = REGIME_ROWS
    use_kernel: tuple[bool, ...] = (True,) * len(REGIME_ROWS)
    speedup: tuple[float, ...] = ()  # PyTorch time / kernel time per regime, when measured

    def kernel_for(self, rows: int) -> bool:
        """Whether ``rows`` rows go through the kernel."""
        index = min(bisect.bisect_left(self.rows, rows), len(self.rows) - 1)
        return self.use_kernel[index]

    @property
    def measured(self) -> bool:
        """False for the default (kernel everywhere, nothing timed yet)."""
        return bool(self.speedup)

    def any_torch(self) -> bool:
        return not all(self.use_kernel)

    def describe(self) -> str:
        ratios = ", ".join(
            f"{rows} row{'s' if rows > 1 else ''} {ratio:.2f}x"  # rows: batch size for attention
            for rows, ratio in zip(self.rows, self.speedup, strict=False)
        )
        torch_rows = [str(r) for r, k in zip(self.rows, self.use_kernel, strict=True) if not k]
        verdict = f"PyTorch for {', '.join(torch_rows)} rows" if torch_rows else "kernel everywhere"
        if not self.speedup:
            return f"not measured -> {verdict}"
        return f"kernel/PyTorch speed {ratios} -> {verdict}"


def choose_regimes(
    fmt: str,
    *,
    isa: str,
    build: str,
    shapes: Sequence[tuple[int, ...]],
    run_kernel: Callable[[int], object],
    run_torch: Callable[[int], object],
    rows: Sequence[int] = REGIME_ROWS,
    margin: float | Sequence[float] = MARGIN,
    fixed: bool | Sequence[bool] = True,
) -> KernelRegimes:
    """The per-regime choice for this build, format and set of shapes: the cached decision, or
    (``TANDEM_AUTOTUNE=measure``/``remeasure``) ``run_kernel(n)`` timed against ``run_torch(n)``
    for each ``n`` in ``rows``, the kernel taken where it is faster by more than ``margin`` (one
    value, or one per row count); else the fixed table.

    ``fixed``: the path each regime takes (one value for all, or one per row count) when no
    measurement decides: nothing cached, ``TANDEM_AUTOTUNE=fixed``, or, for a choice that
    changes results (a C kernel's sums against PyTorch's), a measurement on a busy machine (not
    cached either) where the two paths are within :data:`CLEAR` of each other. Processes that
    start together on a loaded machine then agree with each other, and a stream migrated
    between them keeps its greedy text, instead of each following its own noisy timing.
    """
    margins = (margin,) * len(rows) if isinstance(margin, int | float) else tuple(margin)
    if len(margins) != len(rows):
        raise ValueError(f"{len(margins)} margins for {len(rows)} row counts")
    if fixed is not None and not isinstance(fixed, bool) and len(fixed) != len(rows):
        raise ValueError(f"{len(fixed)} fixed paths for {len(rows)} row counts")
    pinned = KernelRegimes(
        rows=tuple(rows),
        use_kernel=(fixed,) * len(rows) if isinstance(fixed, bool) else tuple(fixed),
    )
    mode = autotune_mode()
    if mode == "fixed":
        logger.info("CPU %s kernel [%s, %s]: %s (TANDEM_AUTOTUNE=fixed)", fmt, isa, build,
                    pinned.describe())  # fmt: skip
        return pinned
    key = _cache_key(fmt, build, shapes, rows, margins)
    path = cache_dir() / f"autotune-{key}.json"
    if mode == "cached":
        cached = _read(path)
        if cached is None:
            logger.info("CPU %s kernel [%s, %s]: %s (fixed table; `tandem tune` measures this "
                        "machine)", fmt, isa, build, pinned.describe())  # fmt: skip
            return pinned
        logger.info("CPU %s kernel [%s, %s]: %s (cached)", fmt, isa, build, cached.describe())
        return cached
    with _measuring_lock():
        cached = _read(path) if mode == "measure" else None
        if cached is not None:
            logger.info("CPU %s kernel [%s, %s]: %s (cached)", fmt, isa, build, cached.describe())
            return cached
        before = _cpu_sample()
        regimes = _measure(rows, run_kernel, run_torch, margins)
        busy, others = others_busy(before)
        if not busy:
            _write(path, regimes)
    logger.info(
        "CPU %s kernel [%s, %s]: %s (measured%s)", fmt, isa, build, regimes.describe(),
        f"; machine busy (other processes used {others:.0%} of the CPUs), not cached"
        if busy else "",
    )  # fmt: skip
    if busy:
        use = tuple(
            measured if ratio >= CLEAR or ratio <= 1 / CLEAR else fixed_path
            for measured, fixed_path, ratio in zip(
                regimes.use_kernel, pinned.use_kernel, regimes.speedup, strict=True
            )
        )  # a clear win or loss stands (a slow build must not run); a near call takes the fixed path
        regimes = KernelRegimes(rows=regimes.rows, use_kernel=use, speedup=regimes.speedup)
        logger.info("CPU %s kernel: %s on a busy machine (the choice changes results: near calls "
                    "take the fixed path, as every process starting now does)", fmt,
                    regimes.describe())  # fmt: skip
    return regimes


def cpu_sample() -> tuple[float, float, float] | None:
    """A point from which :func:`others_busy` measures what other processes did."""
    return _cpu_sample()


def others_busy(before: tuple[float, float, float] | None) -> tuple[bool, float]:
    """Whether other work competed for the cores since ``before`` (:func:`cpu_sample`), so that a
    measurement taken meanwhile should not be cached, and other processes' share of the CPUs."""
    others = _others_share(before, _cpu_sample())
    return _machine_busy() or others > OTHERS_LIMIT, others


def _machine_busy() -> bool:
    """Whether other work was competing for the cores (1-minute load average above the cores)."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:
        return False


def _cpu_sample() -> tuple[float, float, float] | None:
    """(wall clock, CPU seconds the whole machine spent busy, CPU seconds of this process), or
    None where ``/proc/stat`` can't be read (not Linux)."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal: busy is all but idle and iowait (steal,
    # another VM's time on these cores, counts as busy)
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return time.perf_counter(), busy, own.user + own.system


def _others_share(
    before: tuple[float, float, float] | None, after: tuple[float, float, float] | None
) -> float:
    """Other processes' share of all CPUs between two samples (0 when unknown)."""
    if before is None or after is None or after[0] <= before[0]:
        return 0.0
    wall, busy, own = (a - b for a, b in zip(after, before, strict=True))
    return max(0.0, busy - own) / (wall * (os.cpu_count() or 1))


@contextlib.contextmanager
def _measuring_lock() -> Iterator[None]:
    """One measuring process per machine at a time (a no-op when the cache is not writable)."""
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        handle = open(cache_dir() / "autotune.lock", "a")  # noqa: SIM115 (held across the yield)
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _measure(
    rows: Sequence[int],
    run_kernel: Callable[[int], object],
    run_torch: Callable[[int], object],
    margins: Sequence[float],
) -> KernelRegimes:
    kernel_s, torch_s = [], []
    for n in rows:
        run_kernel(n), run_torch(n)  # warm-up: allocators, first-touch, caches
        best_kernel = best_torch = float("inf")
        for _ in range(REPEATS):
            best_kernel = min(best_kernel, _timed(run_kernel, n))
            best_torch = min(best_torch, _timed(run_torch, n))
        kernel_s.append(best_kernel)
        torch_s.append(best_torch)
    return KernelRegimes(
        rows=tuple(rows),
        use_kernel=tuple(
            k * (1 + m) <= t for k, t, m in zip(kernel_s, torch_s, margins, strict=True)
        ),
        speedup=tuple(t / k for k, t in zip(kernel_s, torch_s, strict=True)),
    )


def _timed(fn: Callable[[int], object], rows: int) -> float:
    start = time.perf_counter()
    fn(rows)
    return time.perf_counter() - start


def _cache_key(
    fmt: str,
    build: str,
    shapes: Sequence[tuple[int, ...]],
    rows: Sequence[int],
    margins: Sequence[float],
) -> str:
    blas_limits = [os.environ.get(name, "") for name in BLAS_LIMIT_VARIABLES]
    parts = [fmt, build, repr(sorted(shapes)), repr(list(rows)), repr(list(margins)),
             str(torch.get_num_threads()), torch.__version__, *blas_limits]  # fmt: skip
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _read(path: Path) -> KernelRegimes | None:
    try:
        data = json.loads(path.read_text())
        return KernelRegimes(
            rows=tuple(int(r) for r in data["rows"]),
            use_kernel=tuple(bool(k) for k in data["use_kernel"]),
            speedup=tuple(float(s) for s in data["speedup"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(path: Path, regimes: KernelRegimes) -> None:
    data = {"rows": regimes.rows, "use_kernel": regimes.use_kernel, "speedup": regimes.speedup}
    write_json(path, data, "autotune decision")  # unwritable: only a re-measure next start


def write_json(path: Path, data: object, what: str) -> None:
    """Cache ``data`` at ``path`` as JSON, written to a temporary file and renamed (workers
    starting together never read a half-written file, nor collide); an unwritable cache is
    logged at debug level and otherwise ignored (the fixed path stays)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:
        logger.debug("%s not cached: %s", what, exc)


def round_times(variants: Sequence[Callable[[], object]], rounds: int) -> list[list[float]]:
    """Each variant's time (s) per round, the variants taking turns in each round (the order flips
    every round, so a drift of the machine's speed reaches all alike); round 0 warms up (first
    touch, page faults) and is not kept."""
    times: list[list[float]] = [[] for _ in variants]
    for r in range(rounds + 1):
        order = range(len(variants)) if r % 2 else reversed(range(len(variants)))
        for v in order:
            start = time.perf_counter()
            variants[v]()
            if r:
                times[v].append(time.perf_counter() - start)
    return times
