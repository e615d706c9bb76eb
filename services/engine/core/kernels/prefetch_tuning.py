"""How far ahead the quantized decode rows prefetch their weights, measured on this machine.

A decode row streams each weight byte from memory once, and the hardware prefetchers alone leave
a core's stream well short of what memory gives: the kernels prefetch each block a fixed distance
ahead (``cpu_qgemv.c``). The best distance is the CPU's (its prefetchers, memory latency, how
fast a core consumes a format's blocks): on a Zen 3 q4_k rows read 24-27 GB/s at 16 KiB and
19-21 at 8 KiB, while the other formats were no faster past 8 KiB and q6_k slower. So the kernels
carry that table as their default, ``tandem tune`` times each format's int8 decode rows from
memory at a few distances (:func:`tune`) and caches the fastest for this CPU, instruction set
and thread count, and every kernel library that reads the tiles takes the cached table when it
is loaded (:func:`apply`). A distance moves data, never a result: workers with different tables
compute the same bits. ``TANDEM_AUTOTUNE=fixed`` keeps the built-in table.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from services.engine.core.kernels.autotune import (
    autotune_mode,
    cpu_sample,
    others_busy,
    round_times,
    write_json,
)
from services.engine.core.kernels.huge_pages import huge_page_arena, huge_pages_on
from services.engine.core.kernels.native_build import (
    NativeBuildError,
    cache_dir,
    cpu_model,
    selected_isa,
)
from services.engine.core.kernels.tile_formats import FORMAT_CODES

logger = logging.getLogger(__name__)


class DecodeRowsKernel(Protocol):
    """What :func:`tune` times: ``cpu_q4a8_gemm.CpuQ4A8Gemm``'s int8 decode rows (named by its
    shape, not imported: that module loads its library through :func:`apply`)."""

    library: ctypes.CDLL
    decode_block_bytes: dict[str, int]

    def decode_tiles_shape(self, fmt: str, out_features: int, in_features: int) -> tuple[int, ...]:
        ...

    def bind_decode(
        self, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, fmt: str
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        ...

CANDIDATES = (0, 4096, 8192, 16384, 32768)  # bytes ahead; 0: no prefetch
AHEAD_MAX = 1 << 20  # cpu_qgemv.c's PREFETCH_AHEAD_MAX
# a distance replaces the built-in one only when this much faster: closer is run-to-run noise
# (on a 2-core Zen 3 VM a compute-bound format's distances, paired by round, differed by up to 5.5%;
# the gain this table was made for, q4_k at 16 KiB against 8, was 20-30%): the kernels' 10%
MARGIN = 0.10
TABLE_VERSION = "4"  # part of the cache key: a new version re-measures every machine (3: timed
# in huge pages, where the tiles now are; 4: decode rows with fewer instructions per byte)
# The built-in table (cpu_qgemv.c) was measured in 4 KiB pages. Where the tiles sit in huge pages
# q4_k rows read fastest with no software prefetch at all: on a Zen 4 (AVX-512 VNNI, 2 threads) a
# Llama-3.2-1B Q4_K_M's 65 decode matmuls in a row read 53.5 GB/s against 43.2 at 16 KiB while a
# plain read gave 60, and 36.7 against 34.9 while it gave 37 (distances taking turns in one
# process; with q6_k's off too, 38.5: it keeps its 8 KiB). The hardware prefetchers follow a 2 MiB
# page to its end, and a software prefetch ahead of them only takes a line-fill buffer.
HUGE_PAGE_TABLE = {"q4_k": 0}
SHAPE = (2048, 8192)  # out, in: a 1B model's MLP down projection, every format's blocks divide it


def apply(library: ctypes.CDLL, threads: int | None = None) -> ctypes.CDLL:
    """Give ``library`` (any kernel library that carries ``cpu_qgemv.c``) the distances ``tandem
    tune`` cached for this CPU, selected instruction set and ``threads`` (default PyTorch's
    count); where none are cached, or with ``TANDEM_AUTOTUNE=fixed``, it keeps its built-in
    table, :data:`HUGE_PAGE_TABLE`'s distances over it where the tiles go in huge pages. Returns
    ``library``."""
    if huge_pages_on():
        for fmt, ahead in HUGE_PAGE_TABLE.items():
            library.tandem_set_prefetch_ahead(FORMAT_CODES[fmt], ctypes.c_int64(ahead))
    try:
        if autotune_mode() == "fixed":
            return library
        path = cache_path(threads or torch.get_num_threads())
    except (ValueError, NativeBuildError):
        return library
    chosen = _read(path)
    for fmt, ahead in (chosen or {}).items():
        library.tandem_set_prefetch_ahead(FORMAT_CODES[fmt], ctypes.c_int64(ahead))
    return library


def current(library: ctypes.CDLL) -> dict[str, int]:
    """The distance each format's rows prefetch at now in ``library``."""
    library.tandem_prefetch_ahead.restype = ctypes.c_int64
    return {fmt: int(library.tandem_prefetch_ahead(code)) for fmt, code in FORMAT_CODES.items()}


def tune(
    kernel: DecodeRowsKernel,
    *,
    formats: Sequence[str] | None = None,
    candidates: Sequence[int] = CANDIDATES,
    shape: tuple[int, int] = SHAPE,
    read_bytes: int = 256 << 20,
    rounds: int = 9,
) -> dict[str, dict[int, float]]:
    """Time one int8 decode row (``kernel``'s ``tandem_a8_gemv``, PyTorch's thread count) over
    enough copies of a ``shape`` weight per format that a round reads ``read_bytes`` from memory,
    at every distance, the distances taking turns within each round (``formats``: default every
    one the int8 decode rows read). Per format the built-in distance stays unless another's speed
    against it, paired round by round (so a drift of the machine's bandwidth during the timing
    cancels), is :data:`MARGIN` higher in the median round; the choice is set in ``kernel``'s
    library and cached (not when other processes kept the cores busy). Returns the median weight
    read rate (GB/s) per format and distance."""
    library = kernel.library
    default = current(library)
    threads = torch.get_num_threads()
    formats = list(kernel.decode_block_bytes) if formats is None else list(formats)
    rates: dict[str, dict[int, float]] = {}
    chosen: dict[str, int] = {}
    before = cpu_sample()
    for fmt in formats:
        per_round = _round_rates(kernel, fmt, candidates, shape, read_bytes, rounds)
        rates[fmt] = {ahead: statistics.median(r) for ahead, r in per_round.items()}
        chosen[fmt] = default[fmt]
        if default[fmt] in per_round:  # else nothing to compare with: the default stays
            base = per_round[default[fmt]]
            gain = {
                ahead: statistics.median(x / y for x, y in zip(r, base, strict=True))
                for ahead, r in per_round.items()
            }  # fmt: skip
            best = max(gain, key=lambda ahead: gain[ahead])
            if gain[best] > 1 + MARGIN:
                chosen[fmt] = best
        library.tandem_set_prefetch_ahead(FORMAT_CODES[fmt], ctypes.c_int64(chosen[fmt]))
    busy, others = others_busy(before)
    table = ", ".join(
        f"{fmt} {chosen[fmt] // 1024} KiB ({rates[fmt].get(chosen[fmt], 0.0):.1f} GB/s)"
        for fmt in formats
    )
    if busy:
        logger.info("prefetch distances, %d threads: %s (machine busy: other processes used "
                    "%.0f%% of the CPUs; not cached)", threads, table, others * 100)  # fmt: skip
    else:
        _write(cache_path(threads), {**(_read(cache_path(threads)) or {}), **chosen})
        logger.info("prefetch distances, %d threads: %s (cached)", threads, table)
    return rates


def _round_rates(
    kernel: DecodeRowsKernel,
    fmt: str,
    candidates: Sequence[int],
    shape: tuple[int, int],
    read_bytes: int,
    rounds: int,
) -> dict[int, list[float]]:
    """The weight read rate (GB/s) per distance and round."""
    rows, read = decode_rows_from_memory(kernel, fmt, shape, read_bytes)
    library = kernel.library

    def at(ahead: int) -> Callable[[], None]:
        def run() -> None:
            library.tandem_set_prefetch_ahead(FORMAT_CODES[fmt], ctypes.c_int64(ahead))
            rows()
        return run

    times = round_times([at(ahead) for ahead in candidates], rounds)
    return {ahead: [read / t / 1e9 for t in per_round]
            for ahead, per_round in zip(candidates, times, strict=True)}  # fmt: skip


def decode_rows_from_memory(
    kernel: DecodeRowsKernel, fmt: str, shape: tuple[int, int], read_bytes: int
) -> tuple[Callable[[], None], int]:
    """(a call running one int8 decode row over each of enough copies of an ``[out, in]`` =
    ``shape`` weight in ``fmt`` that they come from memory, the bytes it reads)."""
    out, n_in = shape
    tiles = kernel.decode_tiles_shape(fmt, out, n_in)
    one = tiles[0] * tiles[1] * tiles[2]
    copies = max(1, read_bytes // one)
    # 0x2A everywhere: every scale a normal float16 (no slow subnormal arithmetic), any values;
    # in huge pages where the model's tiles are (the best distance differs by page size: q4_k on
    # a Zen 4 best at 16 KiB in 4 KiB pages, with none at all in 2 MiB ones)
    arena = huge_page_arena()
    shape_all = (copies, *tiles)
    weights = torch.empty(shape_all, dtype=torch.uint8) if arena is None else \
        arena.empty(shape_all, torch.uint8)  # fmt: skip
    weights.fill_(0x2A)
    calls = [kernel.bind_decode(weights[c], None, out, fmt) for c in range(copies)]
    x = torch.randn(1, n_in)

    def rows() -> None:
        for call in calls:
            call(x)

    return rows, one * copies


def cache_path(threads: int) -> Path:
    """Where the distances for this CPU, the selected instruction set and ``threads`` live."""
    cpu = cpu_model()
    # TABLE_VERSION: tables cached before the libraries carried their prefetches (GCC had deleted
    # them: see cpu_qgemv.c's prefetch_block) timed one code at every distance; not reused
    parts = [cpu, selected_isa(), str(threads), TABLE_VERSION]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return cache_dir() / f"prefetch-{key}.json"


def _read(path: Path) -> dict[str, int] | None:
    try:
        data = json.loads(path.read_text())
        return {
            fmt: int(ahead) for fmt, ahead in data.items()
            if fmt in FORMAT_CODES and 0 <= int(ahead) <= AHEAD_MAX
        }  # fmt: skip
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _write(path: Path, chosen: dict[str, int]) -> None:
    write_json(path, chosen, "prefetch distances")  # unwritable: the built-in table stays
