"""Whether this CPU's VNNI kernels are faster than its base set's, measured once by ``tandem tune``.

A VNNI set (``avx512vnni``, ``avxvnni``) changes one thing in the int8 kernels: each 4-input
integer dot is one ``vpdpbusd`` instead of ``vpmaddubsw`` + a 16-bit add (+ a ``vpmaddwd`` every
few steps). It computes the same integers, so the same bits (``tests/test_int8_decode.py``), and
fewer instructions per weight byte should make it faster; but "should" is not measured: a decode
row is bound by memory, and a CPU that runs ``vpdpbusd`` at a lower rate, or one whose 512-bit
instructions lower its clock, can lose. So, as every fast path here, it proves itself on the
machine it runs on: :func:`tune` times the VNNI build's int8 kernels against the base set's on
this CPU, the two taking turns in each round, in both regimes they run (the decode rows, from
memory, every format; the prefill q4 x int8 GEMM, from cache), and keeps VNNI only when it is
:data:`MARGIN` faster in one regime, paired round by round, and not that much slower in the
other. A near tie goes to the base set. The choice is cached per CPU model (not when other
processes kept the cores busy) and :func:`native_build.selected_isa` takes it at every kernel
load; until something is measured the flags decide (VNNI where present), and
``TANDEM_AUTOTUNE=fixed`` keeps it that way.

Arm's ``neondot`` (``sdot``) stands to ``generic`` as a VNNI set to its base set, and is timed the
same way.

Only between a VNNI set and its base set: those have the same tiles and bits, so workers that
chose differently still agree token for token. AVX-512 against AVX2 is not a speed choice of this
kind (their sums run in different vector widths and give other bits).
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.core.kernels import native_build, prefetch_tuning
from services.engine.core.kernels.autotune import cpu_sample, others_busy, round_times, write_json
from services.engine.core.kernels.cpu_q4a8_gemm import FORMATS, SOURCE, CpuQ4A8Gemm

logger = logging.getLogger(__name__)

# VNNI must win a regime by this much, and lose none by as much: closer is noise on a shared VM
# (the kernels' 10%; the prefetch distances' paired rounds differed by up to 5.5% with no change)
MARGIN = 0.10
DECODE_SHAPE = (2048, 8192)  # out, in: a 1B model's MLP down projection, every format divides it
PREFILL_SHAPE = (512, 2048, 2048)  # rows, out, in: a prompt chunk through a 1B model's q_proj


@dataclass(frozen=True, slots=True)
class VnniChoice:
    """What :func:`tune` measured and chose."""

    vnni: str  # the VNNI set, e.g. avx512vnni
    base: str  # its base set, e.g. avx512
    speedup: dict[str, float]  # regime -> base time / VNNI time, median paired round
    chosen: str
    cached: bool

    def describe(self) -> str:
        ratios = ", ".join(f"{regime} {ratio:.2f}x" for regime, ratio in self.speedup.items())
        return f"{self.vnni} against {self.base}: {ratios} -> {self.chosen}"


def vnni_pair() -> tuple[str, str] | None:
    """(the VNNI set, its base set) when the CPU's flags offer a VNNI set, else ``None``."""
    best = native_build.supported_isas()[0]
    base = native_build.vector_isa(best)
    return None if base == best else (best, base)


def choose(speedup: dict[str, float], vnni: str, base: str) -> str:
    """``vnni`` when it is :data:`MARGIN` faster in some regime and not that much slower in any,
    else ``base`` (a tie included: the two give the same bits)."""
    wins = any(ratio > 1 + MARGIN for ratio in speedup.values())
    loses = any(ratio < 1 - MARGIN for ratio in speedup.values())
    return vnni if wins and not loses else base


def tune(*, rounds: int = 9, read_bytes: int = 256 << 20) -> VnniChoice | None:
    """Time this CPU's VNNI set against its base set (PyTorch's thread count), cache the choice
    for this CPU model unless the machine was busy, and return it; ``None`` (nothing timed) on a
    CPU without VNNI or with ``TANDEM_CPU_ISA`` set (the workers take that set, whatever this
    would choose)."""
    pair = vnni_pair()
    if pair is None or os.environ.get("TANDEM_CPU_ISA", "").strip():
        logger.info("VNNI: %s; nothing to time", "TANDEM_CPU_ISA is set" if pair else "not on this CPU")
        return None
    vnni, base = pair
    kernels = [
        CpuQ4A8Gemm(prefetch_tuning.apply(native_build.load_library(SOURCE, isa))) for isa in pair
    ]  # fmt: skip
    before = cpu_sample()
    speedup = compare(kernels[0], kernels[1], rounds=rounds, read_bytes=read_bytes)
    busy, others = others_busy(before)
    choice = VnniChoice(vnni, base, speedup, choose(speedup, vnni, base), cached=not busy)
    threads = torch.get_num_threads()
    if busy:
        logger.info("VNNI, %d threads: %s (machine busy: other processes used %.0f%% of the "
                    "CPUs; not cached)", threads, choice.describe(), others * 100)  # fmt: skip
    else:
        write(choice)
        logger.info("VNNI, %d threads: %s (cached)", threads, choice.describe())
    return choice


def compare(
    candidate: CpuQ4A8Gemm, base: CpuQ4A8Gemm, *, rounds: int = 9, read_bytes: int = 256 << 20
) -> dict[str, float]:
    """Per regime, ``base``'s time over ``candidate``'s in the median round (the two take turns
    in each round, so a drift of the machine's speed cancels): ``decode``, one int8 decode row
    per format over copies of a :data:`DECODE_SHAPE` weight enough to read ``read_bytes`` from
    memory; ``prefill``, the q4 x int8 GEMM over a :data:`PREFILL_SHAPE` chunk per format, its
    weights in cache. Both kernels must read the same tiles."""
    if candidate.tile != base.tile or candidate.decode_block_bytes != base.decode_block_bytes:
        raise ValueError(f"{candidate.build} and {base.build} read different tiles")
    regimes = {"decode": _decode_rows, "prefill": _prefill_chunks}
    speedup = {}
    for regime, make in regimes.items():
        times = round_times([make(candidate, read_bytes), make(base, read_bytes)], rounds)
        speedup[regime] = statistics.median(b / c for c, b in zip(*times, strict=True))
    return speedup


def write(choice: VnniChoice) -> None:
    """Cache ``choice`` where :func:`native_build.measured_vnni_choice` reads it."""
    data = {"vnni": choice.vnni, "chosen": choice.chosen, "speedup": choice.speedup}
    write_json(native_build.vnni_choice_path(), data, "VNNI choice")  # unwritable: the flags decide


def _decode_rows(kernel: CpuQ4A8Gemm, read_bytes: int) -> Callable[[], None]:
    """One int8 decode row per format, each over enough weight copies to come from memory."""
    per_format = read_bytes // len(kernel.decode_block_bytes)
    runs = [prefetch_tuning.decode_rows_from_memory(kernel, fmt, DECODE_SHAPE, per_format)[0]
            for fmt in kernel.decode_block_bytes]  # fmt: skip

    def every_format() -> None:
        for run in runs:
            run()

    return every_format


def _prefill_chunks(kernel: CpuQ4A8Gemm, read_bytes: int) -> Callable[[], None]:
    """The q4 x int8 GEMM over one prompt chunk per format it reads, weights in cache."""
    del read_bytes  # compute-bound: one copy of the weights, reused
    rows, out, n_in = PREFILL_SHAPE
    x = torch.randn(rows, n_in)
    calls = []
    for fmt, inputs in FORMATS.items():
        tiles = (-(-out // kernel.tile), n_in // inputs, kernel.block_bytes[fmt])
        calls.append(kernel.bind(torch.full(tiles, 0x2A, dtype=torch.uint8), None, out, fmt))

    def every_format() -> None:
        for call in calls:
            call(x)

    return every_format
