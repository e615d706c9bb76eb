"""Building native kernels: cached per source and machine, and every failure is one clear line."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.engine.core.kernels import cpu_gemv, native_build
from services.engine.core.kernels.native_build import (
    NativeBuildError,
    build_library,
    find_compiler,
    selected_isa,
)


def _compiler_or_skip() -> None:
    try:
        find_compiler()
    except NativeBuildError as exc:
        pytest.skip(str(exc))


def test_build_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _compiler_or_skip()
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    first = build_library(source)
    stamp = first.stat().st_mtime_ns
    assert build_library(source) == first and first.stat().st_mtime_ns == stamp
    assert first.parent == tmp_path / "kernels"
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".build-")]
    source.write_text("int answer(void) { return 43; }\n")
    assert build_library(source) != first  # a changed source is a new library


def test_workers_starting_together_compile_a_kernel_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tandem up's workers want the same kernels at the same moment: one compiles (the real
    compiler, slowed so that every other caller arrives meanwhile), the others wait on its lock
    and load what it built."""
    _compiler_or_skip()
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TANDEM_PREBUILT_KERNELS", str(tmp_path / "none"))
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    compiled: list[Path] = []
    real = native_build._compile

    def slow_compile(*args: object) -> None:
        compiled.append(args[-1])  # type: ignore[arg-type]
        time.sleep(0.5)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(native_build, "_compile", slow_compile)
    start = threading.Barrier(4)

    def build(_: int) -> Path:
        start.wait()
        return build_library(source)

    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(build, range(4)))
    assert len(compiled) == 1 and set(paths) == {compiled[0]} and compiled[0].is_file()
    assert [p.name for p in compiled[0].parent.iterdir() if not p.name.startswith(".")] == [
        compiled[0].name]


def test_building_ahead_skips_what_another_builds_and_compiles_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's build-ahead thread beside a first use compiling one kernel: it passes that one
    by at once (no wait on its lock) and compiles the others; a second run finds them all."""
    _compiler_or_skip()
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TANDEM_PREBUILT_KERNELS", str(tmp_path / "none"))
    busy, free = tmp_path / "busy.c", tmp_path / "free.c"
    busy.write_text("int busy(void) { return 1; }\n")
    free.write_text("int free_(void) { return 2; }\n")
    real = native_build._compile
    compiling, release = threading.Event(), threading.Event()
    compiled: list[str] = []

    def compile_(cc: str, flags: list[str], source: Path, *rest: object) -> None:
        compiled.append(source.name)
        if source == busy:
            compiling.set()
            assert release.wait(30)
        real(cc, flags, source, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(native_build, "_compile", compile_)
    with ThreadPoolExecutor(1) as pool:
        first_use = pool.submit(build_library, busy)
        assert compiling.wait(30)
        native_build.build_ahead(sources=[busy, free])  # returns while busy.c still compiles
        assert compiled == ["busy.c", "free.c"] and not first_use.done()
        release.set()
        assert first_use.result().is_file()
    native_build.build_ahead(sources=[busy, free])
    assert compiled == ["busy.c", "free.c"]  # nothing compiled twice


def test_a_compile_says_why_no_prebuilt_library_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _compiler_or_skip()
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir()
    monkeypatch.setenv("TANDEM_PREBUILT_KERNELS", str(prebuilt))
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    with caplog.at_level(logging.INFO, logger=native_build.__name__):
        build_library(source)
    isa = native_build.library_isa(source, selected_isa())  # a VNNI set's base set: not int8
    assert f"compiling answer.c for {isa}: no prebuilt kernels in {prebuilt}" in caplog.text
    assert "prebuild --this-cpu" in caplog.text
    # an installed set from older sources (a developer pulled new code since the install)
    (prebuilt / f"answer-{isa}-0123456789abcdef.so").write_bytes(b"")
    source.write_text("int answer(void) { return 43; }\n")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=native_build.__name__):
        build_library(source)
    assert "were built from other sources (the code changed since they were built)" in caplog.text


def test_compile_error_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _compiler_or_skip()
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    source = tmp_path / "broken.c"
    source.write_text("int broken(void) { return }\n")
    with pytest.raises(NativeBuildError, match=r"failed on broken\.c: .*error") as info:
        build_library(source)
    assert "\n" not in str(info.value)


def test_unwritable_cache_is_a_build_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _compiler_or_skip()
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(blocker))
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    with pytest.raises(NativeBuildError, match="cannot build into"):
        build_library(source)


def test_missing_compiler_and_off_switch_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(NativeBuildError, match="no C compiler"):
        find_compiler()
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    cpu_gemv.load_cpu_gemv.cache_clear()
    try:
        assert cpu_gemv.load_cpu_gemv() is None
    finally:
        cpu_gemv.load_cpu_gemv.cache_clear()


def test_the_openmp_runtime_is_torchs_own_where_another_wheel_loaded_one_first() -> None:
    """sentencepiece's wheel ships a libgomp that a worker loaded before torch's: kernels linked
    against it ran a second thread pool and missed every prebuilt library (named by the runtime's
    path), so each start compiled them."""
    torch_lib = Path("/venv/lib/python3.11/site-packages/torch")
    maps = "\n".join([
        "7f00-7f01 r-xp 00000000 08:01 11 /venv/lib/python3.11/site-packages/sentencepiece.libs/"
        "libgomp-6a29c32d.so.1.0.0",
        "7f02-7f03 r--p 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6",
        f"7f04-7f05 r-xp 00000000 08:01 13 {torch_lib}/lib/libgomp.so.1",
        "7f06-7f07 rw-p 00000000 00:00 0",
    ])
    assert native_build.openmp_runtime_in(maps, torch_lib) == torch_lib / "lib" / "libgomp.so.1"
    first = maps.splitlines()[0].split(maxsplit=5)[-1]
    assert native_build.openmp_runtime_in(maps, Path("/elsewhere/torch")) == Path(first)
    assert native_build.openmp_runtime_in(maps.splitlines()[1], torch_lib) is None
    # in this process: torch's own, as the prebuilt libraries were named by
    assert Path(native_build.loaded_openmp_runtime()).name.startswith("libgomp")
