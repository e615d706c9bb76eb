"""``tandem tune`` measures this machine's kernels once; a worker's start never does.

A worker built without a cached decision takes the fixed table and times nothing; ``tandem tune``
(on a machine taken as quiet) times the model's kernels and caches the decisions; a worker built
after it takes them, again timing nothing.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from services.engine.core.kernels import autotune, isa_tuning
from services.engine.core.kernels.native_build import cache_dir
from tests.conftest import native_kernel_or_skip
from tests.tiny_stack import write_tiny_model

pytestmark = pytest.mark.slow


def _never(*args: object) -> None:
    raise AssertionError("a worker's start timed its kernels")


def test_tune_caches_what_workers_then_take_without_timing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    native_kernel_or_skip()
    from services import tune_cli
    from services.engine.runtime.worker_options import WorkerOptions
    from services.engine.runtime.worker_runtime import build_engine

    model = write_tiny_model(tmp_path / "tiny", 512)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TANDEM_AUTOTUNE", raising=False)
    real_measure = autotune._measure
    monkeypatch.setattr(autotune, "_measure", _never)
    options = WorkerOptions(model=str(model), threads=1, num_blocks=64)

    with caplog.at_level(logging.INFO, logger=autotune.__name__):
        build_engine(options, load_tokenizer_too=False)  # nothing cached: the fixed table
    assert "fixed table" in caplog.text and "(cached)" not in caplog.text
    assert not list(cache_dir().glob("autotune-*.json"))

    monkeypatch.setattr(autotune, "_measure", real_measure)
    monkeypatch.setattr(autotune, "_machine_busy", lambda: False)  # taken as quiet
    monkeypatch.setattr(autotune, "_cpu_sample", lambda: None)
    monkeypatch.setenv("TANDEM_AUTOTUNE", "cached")  # tune_cli sets its own process's mode
    args = argparse.Namespace(model=str(model), dtype="auto", threads=[1], max_num_seqs=64)
    assert tune_cli.run(args) == 0
    written = list(cache_dir().glob("autotune-*.json"))
    assert written, "tandem tune cached no decision"
    assert list(cache_dir().glob("prefetch-*.json")), "tandem tune cached no prefetch distances"
    vnni_cached = list(cache_dir().glob("isa-*.json"))  # a VNNI CPU's choice, none elsewhere
    assert len(vnni_cached) == (isa_tuning.vnni_pair() is not None), vnni_cached

    monkeypatch.setenv("TANDEM_AUTOTUNE", "cached")  # a worker's default
    monkeypatch.setattr(autotune, "_measure", _never)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=autotune.__name__):
        build_engine(options, load_tokenizer_too=False)
    assert "(cached)" in caplog.text


def test_default_thread_counts_follow_tandem_ups_plan() -> None:
    from services.cpu_plan import plan_cpus, usable_cpus
    from services.tune_cli import default_thread_counts

    expected = {p.threads for p in plan_cpus(1, 1, usable_cpus()).values()}
    assert default_thread_counts() == sorted(expected) and all(n >= 1 for n in expected)
