"""Prebuilt native kernels (services/engine/core/kernels/prebuild.py): built ahead of time with a
compiler, then found and loaded by the runtime with none (what the container image does); a
prebuilt directory without the library falls back to building (and, with no compiler, says so).
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from services.engine.core.kernels import native_build, prebuild
from tests.conftest import native_kernel_or_skip

GEMV = Path(native_build.__file__).with_name("cpu_gemv.c")


def _no_compiler() -> str:
    raise native_build.NativeBuildError("no C compiler found (set CC or install gcc)")


def test_a_prebuilt_library_loads_without_a_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    native_kernel_or_skip()
    isa = native_build.library_isa(GEMV, native_build.selected_isa())  # a VNNI set's: its base
    monkeypatch.setattr(native_build, "kernel_sources", lambda: [GEMV])
    monkeypatch.setattr(prebuild, "target_isas", lambda this_cpu=False: (isa,))
    assert prebuild.main([str(tmp_path / "prebuilt")]) == 0
    (built,) = (tmp_path / "prebuilt").iterdir()
    assert built.name.startswith(f"cpu_gemv-{isa}-") and built.suffix == ".so"

    monkeypatch.setattr(native_build, "find_compiler", _no_compiler)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))  # nothing built there
    monkeypatch.setenv(native_build.PREBUILT_ENV, str(tmp_path / "prebuilt"))
    assert native_build.build_library(GEMV) == built
    library = native_build.load_library(GEMV)
    library.tandem_gemv_isa.restype = ctypes.c_char_p
    assert library.tandem_gemv_isa().decode() == isa
    assert not (tmp_path / "cache").exists()

    monkeypatch.delenv(native_build.PREBUILT_ENV)
    monkeypatch.setattr(native_build.sys, "prefix", str(tmp_path / "env"))  # an empty environment
    with pytest.raises(native_build.NativeBuildError, match="no C compiler"):
        native_build.build_library(GEMV)
    # where scripts/install.sh builds them: the environment's own share/tandem/kernels
    installed = tmp_path / "env" / "share" / "tandem" / "kernels"
    installed.mkdir(parents=True)
    (installed / built.name).write_bytes(built.read_bytes())
    assert native_build.prebuilt_dir() == installed
    assert native_build.build_library(GEMV) == installed / built.name


def test_an_install_builds_what_this_cpu_selects_and_drops_older_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    native_kernel_or_skip()
    monkeypatch.setattr(native_build, "kernel_sources", lambda: [GEMV])
    monkeypatch.setattr(native_build.sys, "prefix", str(tmp_path / "env"))
    stale = native_build.prebuilt_dir() / "cpu_gemv-avx2-0123456789abcdef.so"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an older source's build")
    other = native_build.prebuilt_dir() / "not-ours.so"
    other.write_bytes(b"")
    assert prebuild.main(["--this-cpu"]) == 0
    built = {p.name.split("-")[1] for p in native_build.prebuilt_dir().glob("cpu_gemv-*.so")}
    assert built == {native_build.library_isa(GEMV, native_build.selected_isa())}
    assert not stale.exists() and other.exists()


def test_prebuilt_names_ignore_the_compiler_and_the_cpu_but_not_the_flags() -> None:
    openmp = Path("/opt/venv/lib/libgomp.so.1")
    name = native_build.prebuilt_name(GEMV, "avx2", openmp)
    assert name == native_build.prebuilt_name(GEMV, "avx2", openmp)  # no compiler involved
    assert name != native_build.prebuilt_name(GEMV, "generic", openmp)
    assert name != native_build.prebuilt_name(GEMV, "avx2", Path("/elsewhere/libgomp.so.1"))
    if native_build._is_x86():
        assert "-mtune=generic" in native_build.prebuilt_flags("avx512")
        assert not any(f == "-mtune=native" for f in native_build.prebuilt_flags("avx2"))


def test_every_kernel_source_is_prebuilt_for_every_isa() -> None:
    sources = {p.name for p in native_build.kernel_sources()}
    loaded = {m.group(1) for p in GEMV.parent.glob("*.py")
              for m in re.finditer(r'with_name\("(\w+\.c)"\)', p.read_text())}  # fmt: skip
    assert loaded and loaded <= sources  # every kernel a module loads is in the image
    assert prebuild.target_isas() == native_build.architecture_isas()
    assert native_build.architecture_isas("x86_64") == native_build.X86_ISAS
    assert native_build.architecture_isas("aarch64") == ("neondot", "generic")
    assert native_build.isa_flags("neondot", "aarch64") == ["-march=armv8.2-a+dotprod"]
    with pytest.raises(native_build.NativeBuildError, match="not an instruction set of x86_64"):
        native_build.isa_flags("neondot", "x86_64")


def test_gcc_only_flags_are_dropped_for_clang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The avx2 set's -fno-tree-ter is GCC's; a clang build compiles without it, a GCC one with."""
    if not native_build._is_x86():
        pytest.skip("x86 instruction-set flags")
    flags = [*native_build.CFLAGS, *native_build.isa_flags("avx2")]
    assert "-fno-tree-ter" in flags
    commands: list[list[str]] = []

    def run(cmd: list[str], **_: object) -> object:
        commands.append(cmd)
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"")
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(native_build.subprocess, "run", run)
    versions = (("clang version 17.0.6", False), ("gcc (Debian 12.2.0) 12.2.0", True))
    for version, expected in versions:
        monkeypatch.setattr(native_build, "_compiler_version", lambda cc, v=version: v)
        commands.clear()
        native_build._compile("cc", flags, GEMV, Path("/usr/lib/libgomp.so.1"), tmp_path / "k.so")
        assert ("-fno-tree-ter" in commands[0]) is expected
        assert "-march=x86-64-v3" in commands[0] and (tmp_path / "k.so").exists()
