"""The decode rows' prefetch distances: a speed choice per machine that never changes a result.

Any distance (none at all included) gives every format's rows the same bits, the int8 rows and
the float32-activation ones; a distance out of range or an unknown format is refused; ``tune``
keeps the built-in distance unless another is clearly faster, caches its choice only when the
machine was quiet, and a library loaded later takes the cached table (``apply``), unless
``TANDEM_AUTOTUNE=fixed``, over a built-in table with huge pages' own distances where the tiles sit
in them; and the built libraries do carry prefetch instructions.
"""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from services.engine.core.kernels import (
    autotune,
    cpu_decode_layers,
    cpu_q4a8_gemm,
    cpu_qgemv,
    prefetch_tuning,
)
from services.engine.core.kernels.cpu_q4a8_gemm import CpuQ4A8Gemm
from services.engine.core.kernels.cpu_qgemv import CpuQGemv
from services.engine.core.kernels.native_build import load_library
from services.engine.core.kernels.tile_formats import FORMAT_CODES
from tests.conftest import native_kernel_or_skip
from tests.int8_cases import TYPES, int8_kernels, int8_rows, quant_weight

OUT, IN = 70, 512


@pytest.fixture
def kernels(isa: str) -> Iterator[tuple[CpuQGemv, CpuQ4A8Gemm]]:
    """This build's kernels; their libraries' distances put back afterwards (a process shares one
    library, and so one table, per build)."""
    qgemv, a8 = int8_kernels(isa)
    saved = prefetch_tuning.current(a8.library)
    yield qgemv, a8
    for fmt, ahead in saved.items():
        assert a8.library.tandem_set_prefetch_ahead(FORMAT_CODES[fmt], ctypes.c_int64(ahead)) == 0


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_any_distance_gives_the_same_bits(
    kernels: tuple[CpuQGemv, CpuQ4A8Gemm], ggml_type: T
) -> None:
    qgemv, a8 = kernels
    weight = quant_weight(ggml_type, seed=21)
    packed, fmt = qgemv.tile_weight(weight), qgemv.tile_format(weight)
    decode_rows = a8.bind_decode(packed, None, OUT, fmt)
    x = int8_rows(3, seed=22)
    results = []
    for ahead in (0, 64, 4096, 16384, prefetch_tuning.AHEAD_MAX):
        assert a8.library.tandem_set_prefetch_ahead(FORMAT_CODES[fmt], ctypes.c_int64(ahead)) == 0
        assert prefetch_tuning.current(a8.library)[fmt] == ahead
        results.append((decode_rows(x[:1]), decode_rows(x), qgemv(x[:1], packed, fmt, None, OUT)))
    for later in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], later, strict=True)), fmt


@pytest.mark.parametrize("source", ["cpu_qgemv", "cpu_q4a8_gemm", "cpu_decode_layers"])
def test_each_library_carries_the_prefetches(isa: str, source: str) -> None:
    """The compiled rows do prefetch: a prefetch changes no value, so a compiler may delete it
    (GCC 12 did, for every row kernel, when ``prefetch_block`` was not inlined early), and no
    result or timing test would notice. objdump comes with the compiler that built the library."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump (binutils) here")
    module = {"cpu_qgemv": cpu_qgemv, "cpu_q4a8_gemm": cpu_q4a8_gemm,
              "cpu_decode_layers": cpu_decode_layers}[source]  # fmt: skip
    library = load_library(module.SOURCE, isa)
    listing = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", str(library._name)],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    prefetches = re.findall(r"\s(?:prefetch(?:nta|t0|t1|t2)|prfm)\s", listing)  # x86, Arm
    assert len(prefetches) >= 10, f"{source} ({isa}) has {len(prefetches)} prefetch instructions"


def test_bad_distances_are_refused(kernels: tuple[CpuQGemv, CpuQ4A8Gemm]) -> None:
    library = kernels[1].library
    before = prefetch_tuning.current(library)
    for code, ahead in ((FORMAT_CODES["q4_k"], -1), (FORMAT_CODES["q4_k"], prefetch_tuning.AHEAD_MAX + 1),
                        (99, 4096), (-1, 4096)):  # fmt: skip
        assert library.tandem_set_prefetch_ahead(code, ctypes.c_int64(ahead)) == -1
    library.tandem_prefetch_ahead.restype = ctypes.c_int64
    assert library.tandem_prefetch_ahead(99) == -1
    assert prefetch_tuning.current(library) == before


@pytest.fixture
def quiet_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache on a machine taken as quiet."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TANDEM_AUTOTUNE", raising=False)
    monkeypatch.setattr(autotune, "_machine_busy", lambda: False)
    monkeypatch.setattr(autotune, "_cpu_sample", lambda: None)
    return tmp_path


def test_tune_keeps_the_default_unless_clearly_faster(
    kernels: tuple[CpuQGemv, CpuQ4A8Gemm], quiet_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a8 = kernels[1]
    defaults = prefetch_tuning.current(a8.library)
    fast, slow = 1 + 2 * prefetch_tuning.MARGIN, 1 + prefetch_tuning.MARGIN / 2
    timed = {  # GB/s per distance and round: q8_0's best is inside the margin, q4_k's beyond it
        "q8_0": {0: [10.0] * 3, 8192: [10.0] * 3, 32768: [10.0 * slow] * 3},
        "q4_k": {0: [10.0] * 3, defaults["q4_k"]: [10.0] * 3, 32768: [10.0 * fast] * 3},
    }
    monkeypatch.setattr(prefetch_tuning, "_round_rates", lambda kernel, fmt, *rest: timed[fmt])
    prefetch_tuning.tune(a8, formats=["q8_0", "q4_k"])
    chosen = {"q8_0": defaults["q8_0"], "q4_k": 32768}
    assert {f: prefetch_tuning.current(a8.library)[f] for f in chosen} == chosen
    (cached,) = quiet_cache.glob("kernels/prefetch-*.json")
    assert json.loads(cached.read_text()) == chosen

    # paired by round: the medians of the rates say 11% faster, the median round's pair 3%
    timed["q8_0"] = {defaults["q8_0"]: [10.0, 6.0, 8.0], 32768: [9.5, 6.2, 8.9]}
    prefetch_tuning.tune(a8, formats=["q8_0"])
    assert prefetch_tuning.current(a8.library)["q8_0"] == defaults["q8_0"]

    monkeypatch.setattr(autotune, "_machine_busy", lambda: True)  # a busy machine: set, not cached
    timed["q4_k"] = {0: [10.0 * fast] * 3, 32768: [10.0] * 3}
    prefetch_tuning.tune(a8, formats=["q4_k"])
    assert prefetch_tuning.current(a8.library)["q4_k"] == 0
    assert json.loads(cached.read_text()) == chosen


def test_a_library_loaded_later_takes_the_cached_table(
    kernels: tuple[CpuQGemv, CpuQ4A8Gemm], quiet_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = kernels[1].library
    defaults = prefetch_tuning.current(library)
    monkeypatch.setattr(prefetch_tuning, "huge_pages_on", lambda: False)  # the next test's subject
    path = prefetch_tuning.cache_path(torch.get_num_threads())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"q4_k": 4096, "q6_k": 0, "bogus": 8192, "q8_0": -5}))
    monkeypatch.setenv("TANDEM_AUTOTUNE", "fixed")  # the built-in table, whatever is cached
    assert prefetch_tuning.current(prefetch_tuning.apply(library)) == defaults
    monkeypatch.setenv("TANDEM_AUTOTUNE", "cached")
    assert prefetch_tuning.current(prefetch_tuning.apply(library)) == {
        **defaults, "q4_k": 4096, "q6_k": 0
    }  # unknown formats and bad distances in the file are ignored
    path.write_text("{not json")
    assert prefetch_tuning.current(prefetch_tuning.apply(library))["q4_k"] == 4096  # left as set


def test_tiles_in_huge_pages_start_from_the_huge_page_table(
    kernels: tuple[CpuQGemv, CpuQ4A8Gemm], quiet_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing cached the built-in table holds, HUGE_PAGE_TABLE's distances over it where the
    tiles go in huge pages (fixed mode too: it is part of the built-in choice); a cached table
    still wins."""
    library = kernels[1].library
    for fmt, ahead in {"q4_k": 16384, "q6_k": 8192}.items():  # cpu_qgemv.c's built-in distances
        library.tandem_set_prefetch_ahead(FORMAT_CODES[fmt], ctypes.c_int64(ahead))
    monkeypatch.setattr(prefetch_tuning, "huge_pages_on", lambda: False)
    assert prefetch_tuning.current(prefetch_tuning.apply(library))["q4_k"] == 16384
    monkeypatch.setattr(prefetch_tuning, "huge_pages_on", lambda: True)
    for mode in ("fixed", "cached"):
        monkeypatch.setenv("TANDEM_AUTOTUNE", mode)
        table = prefetch_tuning.current(prefetch_tuning.apply(library))
        assert table["q4_k"] == prefetch_tuning.HUGE_PAGE_TABLE["q4_k"] == 0, mode
        assert table["q6_k"] == 8192, mode
    path = prefetch_tuning.cache_path(torch.get_num_threads())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"q4_k": 8192}))
    assert prefetch_tuning.current(prefetch_tuning.apply(library))["q4_k"] == 8192


def test_tune_measures_every_decode_format(
    kernels: tuple[CpuQGemv, CpuQ4A8Gemm], quiet_cache: Path
) -> None:
    """A real (small) timing run: a rate per format and distance, a choice among them."""
    native_kernel_or_skip()
    a8 = kernels[1]
    rates = prefetch_tuning.tune(a8, candidates=(0, 8192, 16384), read_bytes=4 << 20, rounds=1)
    assert set(rates) == set(a8.decode_block_bytes)
    assert all(set(r) == {0, 8192, 16384} and min(r.values()) > 0 for r in rates.values())
    chosen = json.loads(next(quiet_cache.glob("kernels/prefetch-*.json")).read_text())
    assert set(chosen) == set(rates) and all(ahead in (0, 8192, 16384) for ahead in chosen.values())
