"""The aarch64 builds of the native kernels, checked on this machine under emulation.

An Arm CPU selects ``neondot`` (NEON with Armv8.2's ``sdot``) where its features list ``asimddp``,
else ``generic`` (NEON alone). ``sdot`` multiplies signed bytes where x86's ``vpdpbusd`` multiplies
unsigned by signed, so the int8 dots take another route to the same integers (q8_0's weights as
stored instead of ``|w|`` and a moved sign); the two builds must still give a row the same bits,
as VNNI and its base set do (``tests/test_int8_decode.py``), or replicas on different Arm CPUs
would disagree. No Arm machine is at hand, so this cross-compiles both builds with
``aarch64-linux-gnu-gcc`` and runs them with ``qemu-aarch64`` (``-cpu max``: every feature,
``sdot`` included) through a small C driver (``tests/native/a8_twins.c``) that loads both and runs
each case through each: the decode rows (``tandem_a8_gemv``, every format, every row path) and the
prompt GEMM (``tandem_q4a8_gemm``), random and largest values, compared bit for bit between the
builds, row by row across batch sizes, and against the float64 reference of the int8 math. Every
kernel source must also build for both sets (what an install on Arm prebuilds).

Speed is not measured here (emulation says nothing about it); ``tandem tune`` times ``neondot``
against ``generic`` on the Arm machine itself and keeps the faster (``isa_tuning``).

The toolchain is Debian's ``gcc-aarch64-linux-gnu`` and ``qemu-user``: without them the tests skip,
and with ``TANDEM_REQUIRE_ARM_CROSS=1`` (CI, which installs them) they fail instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from services.engine.core.kernels import cpu_q4a8_gemm, cpu_qgemv, native_build
from services.engine.core.kernels.cpu_qgemv import CpuQGemv
from services.engine.core.kernels.tile_formats import FORMAT_CODES
from tests.conftest import native_kernel_or_skip
from tests.int8_cases import OUT, TWIN_RANGES, TYPES, reference, rounded_rows, twin_inputs

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"  # Debian's cross libc, where qemu finds the loader
DRIVER = Path(__file__).parent / "native" / "a8_twins.c"
SETS = ("generic", "neondot")  # the driver's LIB_A and LIB_B


def _toolchain_or_skip() -> str:
    cc, qemu = shutil.which(CROSS_CC), shutil.which(QEMU)
    if cc and qemu and Path(SYSROOT).is_dir():
        return cc
    why = (f"no aarch64 cross toolchain ({CROSS_CC}, {QEMU}, {SYSROOT}: Debian's "
           "gcc-aarch64-linux-gnu and qemu-user)")  # fmt: skip
    if os.environ.get("TANDEM_REQUIRE_ARM_CROSS") == "1":
        pytest.fail(f"{why}; TANDEM_REQUIRE_ARM_CROSS=1")
    pytest.skip(why)


def _compile(cc: str, isa: str, source: Path, target: Path, *extra: str) -> None:
    flags = [*native_build.CFLAGS, *native_build.isa_flags(isa, "aarch64"), *extra]
    command = [cc, *flags, "-shared", str(source), "-o", str(target), "-lm"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stderr[-4000:]}"


@dataclass
class ArmTwins:
    """The two aarch64 builds of cpu_q4a8_gemm.c and the driver that runs them."""

    libraries: tuple[Path, Path]
    driver: Path
    work: Path

    def run(self, cases: list[str]) -> str:
        listing = self.work / "cases.txt"
        listing.write_text("\n".join(cases) + "\n")
        command = [QEMU, "-L", SYSROOT, "-cpu", "max", str(self.driver), *map(str, self.libraries),
                   str(listing)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        said = done.stdout[-2000:] + done.stderr[-4000:]
        assert done.returncode == 0, f"{' '.join(command)}:\n{said}"
        return done.stdout


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> ArmTwins:
    cc = _toolchain_or_skip()
    work = tmp_path_factory.mktemp("arm")
    libraries = tuple(work / f"cpu_q4a8_gemm-{isa}.so" for isa in SETS)
    with ThreadPoolExecutor(max_workers=len(SETS)) as pool:  # ~30 s each at -O3
        list(pool.map(lambda isa, target: _compile(cc, isa, cpu_q4a8_gemm.SOURCE, target),
                      SETS, libraries))  # fmt: skip
    driver = work / "a8_twins"
    command = [cc, "-O2", "-std=gnu11", str(DRIVER), "-o", str(driver), "-ldl"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return ArmTwins((libraries[0], libraries[1]), driver, work)


@pytest.fixture(scope="module")
def tiles() -> CpuQGemv:
    """This machine's generic build lays tiles out for the Arm builds: the same 4-lane width (the
    driver's report of the Arm tile and block sizes is checked against it)."""
    native_kernel_or_skip()
    return CpuQGemv(native_build.load_library(cpu_qgemv.SOURCE, "generic"))


def _save(path: Path, tensor: torch.Tensor) -> str:
    path.write_bytes(tensor.contiguous().numpy().tobytes())
    return str(path)


def _load(path: Path, rows: int, out: int) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.float32).reshape(rows, out).copy())


def test_both_sets_read_the_tiles_this_machine_lays_out(twins: ArmTwins, tiles: CpuQGemv) -> None:
    report = twins.run([]).splitlines()
    assert "build 0 generic 0" in report and "build 1 neondot 1" in report  # sdot in neondot only
    assert f"tile {tiles.tile}" in report
    for fmt, code in FORMAT_CODES.items():
        assert f"block {code} {tiles.block_bytes[fmt]}" in report, fmt


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_sdot_gives_generic_neons_bits(twins: ArmTwins, tiles: CpuQGemv, ggml_type: T) -> None:
    """Every row path of the decode rows (and the GEMM for its formats), random and largest
    values: neondot's output equals generic's bit for bit, a row's bits do not depend on its
    batch mates, and both are the int8 math to float32 summation error."""
    weights, x = twin_inputs(ggml_type)
    work = twins.work / ggml_type.name
    work.mkdir(exist_ok=True)
    cases, expected = [], []
    for w, weight in enumerate(weights):
        fmt = tiles.tile_format(weight)
        bias = torch.randn(OUT, generator=torch.Generator().manual_seed(w))
        packed = _save(work / f"w{w}", tiles.tile_weight(weight))
        bias_file = _save(work / f"b{w}", tiles.tile_bias(bias))
        kinds = ["gemv", "gemm"] if fmt in cpu_q4a8_gemm.FORMATS else ["gemv"]
        for kind in kinds:
            for lo, hi in TWIN_RANGES:
                name = f"{w}-{kind}-{lo}-{hi}"
                rows = _save(work / f"x{name}", x[lo:hi])
                outputs = [work / f"y{name}-{isa}" for isa in SETS]
                cases.append(f"{kind} {FORMAT_CODES[fmt]} {hi - lo} {x.shape[1]} {OUT} 2 {packed} "
                             f"{bias_file} {rows} {outputs[0]} {outputs[1]}")  # fmt: skip
                expected.append((kind, w, weight, bias, lo, hi, outputs))
    twins.run(cases)
    whole: dict[tuple[str, int], torch.Tensor] = {}
    for kind, w, weight, bias, lo, hi, outputs in expected:
        plain, dot = (_load(path, hi - lo, OUT) for path in outputs)
        assert torch.equal(dot, plain), (ggml_type.name, kind, w, lo, hi)
        if (lo, hi) == (0, 40):
            whole[kind, w] = plain
            want = reference(x, weight, bias)
            scale = rounded_rows(x).abs() @ weight.dequantize().double().abs().T
            error = ((plain.double() - want).abs() / (scale + 1e-30)).max().item()
            assert error < 1e-5, (ggml_type.name, kind, w, error)
    for kind, w, _, _, lo, hi, outputs in expected:
        plain = _load(outputs[0], hi - lo, OUT)
        assert torch.equal(plain, whole[kind, w][lo:hi]), (ggml_type.name, kind, w, lo, hi)


@pytest.mark.parametrize("arm_isa", SETS)
def test_every_kernel_builds_for_arm(twins: ArmTwins, arm_isa: str) -> None:
    """What an install on Arm prebuilds (prebuild.target_isas there: neondot and generic): every
    source's aarch64 branches compile and link. Without optimization (-O0 after the flags): the
    -O3 builds of all six take ~3 minutes a set here, and the int8 kernel's -O3 build runs
    above."""
    cc = _toolchain_or_skip()
    for source in native_build.kernel_sources():
        target = twins.work / f"{source.stem}-{arm_isa}-O0.so"
        _compile(cc, arm_isa, source, target, "-O0")
        assert target.stat().st_size > 0
