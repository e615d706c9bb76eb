"""Building native kernels: cached per source and machine, and every failure is one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.core.kernels import cpu_gemv
from services.engine.core.kernels.native_build import (
    NativeBuildError,
    build_library,
    find_compiler,
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
