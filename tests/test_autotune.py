"""A native kernel has to prove itself: measured against PyTorch on the layers' own shapes, per row
regime, with the decision cached. A deliberately slow kernel is never used; the real 4-bit kernel
wins single-row decode against dequantize-then-``F.linear``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.engine.core.kernels import autotune, cpu_gemv, cpu_qgemv
from services.engine.core.kernels.autotune import REGIME_ROWS, KernelRegimes, choose_regimes
from services.engine.core.kernels.cpu_gemv import CpuGemv
from services.engine.core.kernels.cpu_qgemv import CpuQGemv
from services.engine.core.kernels.native_build import cache_dir, load_library
from services.engine.core.linear import Linear, PackPlan, pack_linears
from services.engine.core.quant.quantized_weight import QuantizedWeight, quantize_q8_0
from tests.conftest import native_kernel_or_skip

SLEEP_S = 0.003


class SlowGemv(CpuGemv):
    """The real float32 kernel, a few milliseconds late: PyTorch must win every regime."""

    calls = 0

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls += 1
        time.sleep(SLEEP_S)
        return super().__call__(*args, **kwargs)


class SlowQGemv(CpuQGemv):
    """The real quantized kernel, a few milliseconds late (layers call what ``bind`` gives)."""

    calls = 0

    def bind(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        call = super().bind(*args, **kwargs)

        def slow(x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            time.sleep(SLEEP_S)
            return call(x)

        return slow


@pytest.fixture(autouse=True)
def measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests time kernels: ``measure`` (a worker's default only reads what ``tandem tune``
    cached, see test_the_default_never_measures)."""
    monkeypatch.setenv("TANDEM_AUTOTUNE", "measure")


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh autotune cache, on a machine taken as idle (a busy one's decisions aren't kept)."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_machine_busy", lambda: False)
    monkeypatch.setattr(autotune, "_cpu_sample", lambda: None)
    return cache_dir()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Linear(64, 96, bias=True), Linear(96, 64), Linear(64, 160))


@pytest.mark.parametrize("fmt", ["float32", "q8_0"])
@pytest.mark.usefixtures("one_thread")
def test_slow_kernel_loses_every_regime_and_is_never_called(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    native_kernel_or_skip()
    model = _model()
    if fmt == "float32":
        slow: SlowGemv | SlowQGemv = SlowGemv(load_library(cpu_gemv.SOURCE))
        plan = PackPlan(kernel=slow, splits=2, autotune=True)
        weights = [layer.weight.detach().clone() for layer in model]
    else:
        slow = SlowQGemv(load_library(cpu_qgemv.SOURCE))
        plan = PackPlan(qkernel=slow, splits=2, autotune=True)
        weights = []
        for layer in model:
            quant = quantize_q8_0(layer.weight.detach())
            layer.set_quantized(quant)
            weights.append(quant.dequantize())
    slow.build = f"slow-{slow.build}"  # its own autotune cache key
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    biases = [None if layer.bias is None else layer.bias.detach().clone() for layer in model]

    assert pack_linears(model, plan, free_dense=True) == 3
    assert slow.calls > 0  # it was measured
    for layer in model:
        assert layer.weight_format == fmt and layer.packed is not None
        assert layer.regimes.any_torch() and not any(layer.regimes.use_kernel)
        assert all(not layer.regimes.kernel_for(n) for n in (1, 5, 8, 20, 32, 100, 256, 1000))
        assert all(ratio < 1 for ratio in layer.regimes.speedup)
        if fmt == "float32":  # PyTorch's layout is kept beside the tiles, the dense copy freed
            assert layer.split is not None and layer.weight.numel() == 0

    slow.calls = 0
    with torch.inference_mode():
        for rows in (1, 5, 40, 300):
            x = torch.randn(rows, 64)
            got = model(x)
            expected = x
            for weight, bias in zip(weights, biases, strict=True):
                expected = F.linear(expected, weight, bias)
            # the split bmm, or dequantize (from the kernel's tiles) then F.linear: the same
            # products, perhaps summed in another order (BLAS picks by the weight's alignment)
            assert torch.allclose(got, expected, atol=1e-5), (rows, (got - expected).abs().max())
    assert slow.calls == 0


@pytest.mark.usefixtures("one_thread")
def test_real_q4_kernel_wins_single_row_decode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    native_kernel_or_skip()
    qkernel = cpu_qgemv.load_cpu_qgemv()  # built (or found) in the shared cache
    assert qkernel is not None
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))  # a fresh measurement
    gen = torch.Generator().manual_seed(1)
    layer = Linear(576, 1024)
    qs = torch.randint(0, 256, (1024, 576 // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(1024, 576 // 32, generator=gen) * 0.01).half().float()
    quant = QuantizedWeight("q4", qs, scales, (-8 * scales).half().float())
    layer.set_quantized(quant)
    pack_linears(nn.Sequential(layer), PackPlan(qkernel=qkernel, autotune=True), free_dense=True)
    assert layer.packed is not None and layer.packed.dtype == torch.uint8
    assert layer.regimes.kernel_for(1), layer.regimes.describe()
    assert layer.regimes.speedup[0] > 1
    x = torch.randn(1, 576)
    expected = F.linear(x, quant.dequantize())
    assert torch.allclose(layer(x), expected, atol=1e-4)


class SlowForOneShape(CpuQGemv):
    """The real quantized kernel, a few milliseconds late for ``slow_out`` outputs only."""

    slow_out = 0

    def bind(self, packed, fmt, bias, out_features):  # type: ignore[no-untyped-def]
        call = super().bind(packed, fmt, bias, out_features)
        if out_features != self.slow_out:
            return call

        def slow(x: torch.Tensor) -> torch.Tensor:
            time.sleep(SLEEP_S)
            return call(x)

        return slow


@pytest.mark.usefixtures("one_thread")
def test_each_shape_is_decided_on_its_own(tmp_cache: Path) -> None:
    """A kernel that loses on one shape (here: slowed down for it) keeps the layers of the other
    shapes: the decision is per format and shape, not one for all of a format's layers."""
    native_kernel_or_skip()
    slow = SlowForOneShape(load_library(cpu_qgemv.SOURCE))
    slow.build = f"slow-shape-{slow.build}"
    slow.slow_out = 512
    torch.manual_seed(2)
    model = nn.Sequential(Linear(576, 1024), Linear(1024, 576), Linear(576, 512))
    for layer in model:
        layer.set_quantized(quantize_q8_0(torch.randn(layer.out_features, layer.in_features)))
    pack_linears(model, PackPlan(qkernel=slow, autotune=True), free_dense=True)
    fast_one, fast_two, slowed = model
    assert not any(slowed.regimes.use_kernel), slowed.regimes.describe()
    for layer in (fast_one, fast_two):  # single-row decode: the kernel reads a quarter the bytes
        assert layer.regimes.kernel_for(1), layer.regimes.describe()
    assert len(list(tmp_cache.glob("autotune-*.json"))) == 3  # one cached decision per shape


def _runners(kernel_slow_from: int) -> tuple[list[int], list[int], object, object]:
    """Fake paths: the kernel sleeps from ``kernel_slow_from`` rows on, PyTorch below it."""
    kernel_calls: list[int] = []
    torch_calls: list[int] = []

    def run_kernel(rows: int) -> None:
        kernel_calls.append(rows)
        if rows >= kernel_slow_from:
            time.sleep(0.002)

    def run_torch(rows: int) -> None:
        torch_calls.append(rows)
        if rows < kernel_slow_from:
            time.sleep(0.002)

    return kernel_calls, torch_calls, run_kernel, run_torch


def test_decision_per_regime_is_cached(tmp_cache: Path) -> None:
    kernel_calls, torch_calls, run_kernel, run_torch = _runners(kernel_slow_from=32)
    shapes = [(96, 64), (64, 96)]
    first = choose_regimes(
        "q4", isa="avx2", build="fake.so", shapes=shapes, run_kernel=run_kernel, run_torch=run_torch
    )
    assert first.rows == REGIME_ROWS and first.use_kernel == (True, True, False, False)
    assert [first.kernel_for(n) for n in (1, 2, 8, 9, 32, 33, 256, 4096)] == [
        True, True, True, False, False, False, False, False
    ]  # fmt: skip
    assert sorted(set(kernel_calls)) == sorted(set(torch_calls)) == list(REGIME_ROWS)
    assert len(kernel_calls) == len(torch_calls) == (1 + autotune.REPEATS) * len(REGIME_ROWS)

    files = list(tmp_cache.glob("autotune-*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["use_kernel"] == [True, True, False, False] and len(data["speedup"]) == 4

    kernel_calls.clear(), torch_calls.clear()
    again = choose_regimes(  # same key, shapes in another order: read from the cache
        "q4", isa="avx2", build="fake.so", shapes=shapes[::-1], run_kernel=run_kernel,
        run_torch=run_torch,
    )
    assert again == first and kernel_calls == [] and torch_calls == []

    for other in ({"fmt": "q8_0", "build": "fake.so"}, {"fmt": "q4", "build": "other.so"}):
        choose_regimes(
            other["fmt"], isa="avx2", build=other["build"], shapes=shapes, run_kernel=run_kernel,
            run_torch=run_torch,
        )
    assert len(kernel_calls) == 2 * (1 + autotune.REPEATS) * len(REGIME_ROWS)  # new format or build
    assert len(list(tmp_cache.glob("autotune-*.json"))) == 3


def test_busy_machine_decision_is_used_but_not_cached(
    tmp_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(autotune, "_machine_busy", lambda: True)
    kernel_calls, _, run_kernel, run_torch = _runners(kernel_slow_from=8)
    args = {"isa": "avx2", "build": "fake.so", "shapes": [(8, 8)], "run_kernel": run_kernel,
            "run_torch": run_torch, "rows": (1, 8)}  # fmt: skip
    assert choose_regimes("q4", **args).use_kernel == (True, False)  # type: ignore[arg-type]
    assert not list(tmp_cache.glob("autotune-*.json"))
    kernel_calls.clear()
    assert choose_regimes("q4", **args).use_kernel == (True, False)  # type: ignore[arg-type]
    assert len(kernel_calls) == (1 + autotune.REPEATS) * 2  # measured again


def test_a_choice_that_changes_results_takes_its_fixed_path_on_a_busy_machine(
    tmp_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8 or float32 activations: measured while busy, each process would follow its own noisy
    timing and two workers could part in greedy text; with ``fixed`` they all take that path (and
    a quiet measurement still decides, and is cached), as every process does under
    TANDEM_AUTOTUNE=fixed, measuring nothing."""
    busy = [True]
    monkeypatch.setattr(autotune, "_machine_busy", lambda: busy[0])
    monkeypatch.setattr(autotune, "_others_share", lambda before, after: 0.0)

    def run_kernel(rows: int) -> None:  # near calls: 30% apart, the kernel slower from 8 rows
        time.sleep(0.0026 if rows >= 8 else 0.002)

    def run_torch(rows: int) -> None:
        time.sleep(0.002 if rows >= 8 else 0.0026)

    args = {"isa": "avx2", "build": "fake.so", "shapes": [(8, 8)], "run_kernel": run_kernel,
            "run_torch": run_torch, "rows": (1, 8)}  # fmt: skip
    assert choose_regimes("q4", fixed=True, **args).use_kernel == (True, True)  # type: ignore[arg-type]
    assert choose_regimes("q4", fixed=(False, True), **args).use_kernel == (False, True)  # type: ignore[arg-type]
    assert not list(tmp_cache.glob("autotune-*.json"))
    busy[0] = False
    assert choose_regimes("q4", fixed=True, **args).use_kernel == (True, False)  # type: ignore[arg-type]
    assert len(list(tmp_cache.glob("autotune-*.json"))) == 1
    busy[0] = True  # a clear loss stands, busy or not: a slow build must not run
    kernel_calls, _, slow_kernel, fast_torch = _runners(kernel_slow_from=8)
    args.update(run_kernel=slow_kernel, run_torch=fast_torch, shapes=[(12, 12)])
    assert choose_regimes("q4", fixed=True, **args).use_kernel == (True, False)  # type: ignore[arg-type]
    monkeypatch.setenv("TANDEM_AUTOTUNE", "fixed")
    kernel_calls.clear()
    args.update(shapes=[(16, 16)])
    assert choose_regimes("q4", fixed=(True, True), **args).use_kernel == (True, True)  # type: ignore[arg-type]
    assert not kernel_calls  # nothing measured
    assert choose_regimes("q4", **args).use_kernel == (True, True)  # the default fixed path
    assert not kernel_calls


def test_the_default_never_measures(tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's start (TANDEM_AUTOTUNE unset): the cached decision where ``tandem tune`` left
    one, else the fixed table, never a timing run; ``remeasure`` (``tandem tune``) times again and
    overwrites what is cached."""
    kernel_calls, torch_calls, run_kernel, run_torch = _runners(kernel_slow_from=8)
    args = {"isa": "avx2", "build": "fake.so", "shapes": [(8, 8)], "run_kernel": run_kernel,
            "run_torch": run_torch, "rows": (1, 8)}  # fmt: skip
    monkeypatch.delenv("TANDEM_AUTOTUNE")
    untuned = choose_regimes("q4", fixed=(False, True), **args)  # type: ignore[arg-type]
    assert untuned.use_kernel == (False, True) and not untuned.measured
    assert kernel_calls == torch_calls == [] and not list(tmp_cache.glob("autotune-*.json"))

    monkeypatch.setenv("TANDEM_AUTOTUNE", "remeasure")
    tuned = choose_regimes("q4", fixed=(False, True), **args)  # type: ignore[arg-type]
    assert tuned.use_kernel == (True, False) and tuned.measured and kernel_calls
    (cached,) = tmp_cache.glob("autotune-*.json")
    monkeypatch.setenv("TANDEM_AUTOTUNE", "cached")
    kernel_calls.clear()
    assert choose_regimes("q4", fixed=(False, True), **args) == tuned  # type: ignore[arg-type]
    assert kernel_calls == []

    cached.write_text(json.dumps({"rows": [1, 8], "use_kernel": [False, False],
                                  "speedup": [0.5, 0.5]}))  # fmt: skip
    monkeypatch.setenv("TANDEM_AUTOTUNE", "remeasure")
    again = choose_regimes("q4", fixed=(False, True), **args)  # type: ignore[arg-type]
    assert again.use_kernel == (True, False)
    assert json.loads(cached.read_text())["use_kernel"] == [True, False]  # overwritten
    monkeypatch.setenv("TANDEM_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="TANDEM_AUTOTUNE='sometimes'"):
        choose_regimes("q4", **args)  # type: ignore[arg-type]


def test_unreadable_or_unwritable_cache_remeasures(
    tmp_path: Path, tmp_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel_calls, _, run_kernel, run_torch = _runners(kernel_slow_from=8)
    rows = (1, 8)
    args = {"isa": "generic", "build": "fake.so", "shapes": [(8, 8)], "run_kernel": run_kernel,
            "run_torch": run_torch, "rows": rows}  # fmt: skip
    first = choose_regimes("q8_0", **args)  # type: ignore[arg-type]
    assert first.use_kernel == (True, False)
    (cached,) = cache_dir().glob("autotune-*.json")
    cached.write_text("{not json")
    kernel_calls.clear()
    assert choose_regimes("q8_0", **args).use_kernel == first.use_kernel  # type: ignore[arg-type]
    assert len(kernel_calls) == (1 + autotune.REPEATS) * len(rows)

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(blocker))  # cache_dir() is under a file
    kernel_calls.clear()
    assert choose_regimes("q8_0", **args).use_kernel == first.use_kernel  # type: ignore[arg-type]
    assert len(kernel_calls) == (1 + autotune.REPEATS) * len(rows)


def test_kernel_for_maps_row_counts_to_regimes() -> None:
    regimes = KernelRegimes(use_kernel=(True, False, True, False), speedup=(3.0, 0.5, 1.5, 0.9))
    expected = {1: True, 2: False, 5: False, 8: False, 9: True, 20: True, 32: True, 33: False,
                256: False, 257: False, 10_000: False}  # fmt: skip
    assert {n: regimes.kernel_for(n) for n in expected} == expected
    assert regimes.any_torch()
    assert regimes.describe() == (
        "kernel/PyTorch speed 1 row 3.00x, 8 rows 0.50x, 32 rows 1.50x, 512 rows 0.90x "
        "-> PyTorch for 8, 512 rows"
    )
    always = KernelRegimes()
    assert not always.any_torch() and all(always.kernel_for(n) for n in (1, 8, 32, 256, 999))


def test_margin_per_regime(tmp_cache: Path) -> None:
    """One margin per row count: a 1.5x faster kernel wins where the margin is 0 and loses where
    it must be 2x faster."""

    def run_kernel(rows: int) -> None:
        time.sleep(0.002)

    def run_torch(rows: int) -> None:
        time.sleep(0.003)

    regimes = choose_regimes(
        "q4", isa="avx2", build="margins.so", shapes=[(64, 64)], run_kernel=run_kernel,
        run_torch=run_torch, rows=(1, 256), margin=(0.0, 1.0),
    )  # fmt: skip
    assert regimes.use_kernel == (True, False), regimes.describe()
    with pytest.raises(ValueError, match="2 margins for 1 row counts"):
        choose_regimes("q4", isa="avx2", build="margins.so", shapes=[(64, 64)],
                       run_kernel=run_kernel, run_torch=run_torch, rows=(1,), margin=(0.0, 1.0))  # fmt: skip


def test_others_share_of_the_cpus() -> None:
    cpus = os.cpu_count() or 1
    before = (10.0, 100.0, 5.0)  # wall clock, machine busy CPU seconds, own CPU seconds
    assert autotune._others_share(before, (12.0, 100.0 + 2 * cpus, 5.0)) == pytest.approx(1.0)
    assert autotune._others_share(before, (12.0, 101.0, 6.0)) == 0.0  # only this process ran
    assert autotune._others_share(before, None) == autotune._others_share(None, before) == 0.0
    sample = autotune._cpu_sample()
    assert sample is None or (sample[1] >= 0 and sample[2] >= 0)


def test_a_measurement_next_to_busy_processes_is_used_but_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other processes keep every core busy while the kernel is timed (the load average has not
    caught up yet): the decision is returned but not written, so a later start measures again."""
    if autotune._cpu_sample() is None:
        pytest.skip("no /proc/stat here")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_machine_busy", lambda: False)
    spin = [sys.executable, "-c", "while True: pass"]
    spinners = [subprocess.Popen(spin) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.2)  # the spinners are running
        regimes = choose_regimes(
            "q4", isa="avx2", build="busy.so", shapes=[(64, 64)],
            run_kernel=lambda rows: time.sleep(0.01), run_torch=lambda rows: time.sleep(0.02),
        )  # fmt: skip
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert all(regimes.use_kernel[:3])  # the decision is still made and used
    assert not list(cache_dir().glob("autotune-*.json"))
