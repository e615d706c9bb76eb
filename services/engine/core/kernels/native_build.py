"""Compile a C kernel shipped with Tandem into a shared library, once per machine and instruction
set, and load it.

Why at run time: the kernel is built for the instruction set of the CPU it will run on, and an
install needs no compiler; a machine without one just keeps the PyTorch path.

Instruction sets (``tandem_simd.h`` picks the vector width and register blocking for each):

* ``avx512vnni`` — ``avx512`` plus AVX-512 VNNI (``vpdpbusd``: the int8 decode rows' and prefill
  GEMM's integer dots in one instruction, the same integers, so the same bits, as ``avx512``'s);
* ``avx512`` — ``-march=x86-64-v4`` (AVX-512 F/BW/DQ/VL), for CPUs that have them;
* ``avxvnni`` — ``avx2`` plus AVX-VNNI (the 256-bit ``vpdpbusd``, e.g. Alder Lake);
* ``avx2`` — ``-march=x86-64-v3`` (AVX2, FMA, F16C);
* ``neondot`` — aarch64's NEON plus Armv8.2's dot product (``sdot``: the int8 dots in one
  instruction, as VNNI; ``-march=armv8.2-a+dotprod``, for CPUs whose features list ``asimddp``:
  Graviton 2 and later, Ampere Altra, Apple M1 and later);
* ``generic`` — the architecture's baseline: SSE2 on x86-64, NEON on aarch64, plain C elsewhere.

:func:`selected_isa` takes the best set the CPU's flags allow, except a VNNI set (``neondot``
counts as one: an integer dot instruction over its base set's vectors) that ``tandem
tune`` measured no faster than its base set on this CPU (:func:`measured_vnni_choice`; the two
compute the same bits, so it is a speed choice only, and a near tie goes to the base set);
``TANDEM_CPU_ISA`` (one of :data:`ISAS`) forces one (so every variant can be built, tested and
benchmarked on one AVX-512 machine), and a set the CPU can't execute is a build error, never an
illegal instruction. A VNNI set has its base set's vector width and register blocks
(:func:`vector_isa`), and tiles of the same shape.

Why plain C through ``ctypes`` rather than a PyTorch C++ extension: the source has no
PyTorch headers, so a build takes well under a second instead of a minute.

Threads: the library is linked against the GNU OpenMP runtime this process already loaded with
PyTorch, so its ``#pragma omp parallel`` runs on PyTorch's own worker threads. Linking the system
``libgomp`` instead would start a second pool that fights PyTorch's spinning workers for the
same cores.

Built libraries are cached under ``$TANDEM_CACHE_DIR`` (default ``~/.cache/tandem``)``/kernels``,
keyed by the source, the compiler, its flags, the CPU's feature flags and the OpenMP runtime; a
build writes a temporary file and renames it, so processes that start together (``tandem up``)
never load a half-written library. A build holds a lock file beside its target (``flock``), so
when ``tandem up``'s workers start together and want the same kernel, one compiles it and the
others wait for it and load it: each kernel compiles once per machine, not once per worker (two
workers compiling the same six kernels side by side doubled the compiler's work on cores the
model loads also need). A worker that compiles says so first, and why no prebuilt library
served: none installed, or an installed set built from other sources (the code changed since
the install; the prebuild command below brings it up to date).

Prebuilt libraries: an install builds every kernel for every instruction set once
(``python -m services.engine.core.kernels.prebuild DIR``: ``scripts/install.sh`` into the
environment's ``share/tandem/kernels``, the image's build stage into its own directory), so no
worker compiles on its way to ``ready`` and an image needs no compiler. :func:`build_library`
takes the library for the selected set from ``$TANDEM_PREBUILT_KERNELS`` when set, else from
``<sys.prefix>/share/tandem/kernels``, first; those are built with ``-mtune=generic`` and keyed
by the sources, flags and OpenMP runtime only (not the compiler or the build machine's CPU), so
the runtime finds them without a compiler and on any CPU of the architecture, and a changed
source (a developer's edit) misses them and is compiled as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

CFLAGS = ("-O3", "-fPIC", "-std=gnu11", "-fopenmp")
PREBUILT_ENV = "TANDEM_PREBUILT_KERNELS"
X86_ISAS = ("avx512vnni", "avx512", "avxvnni", "avx2", "generic")  # best first
ARM_ISAS = ("neondot", "generic")
ISAS = (*X86_ISAS[:-1], *ARM_ISAS)  # every set of every architecture, best first, generic last
# GCC's temporary-expression replacement (TER, when it leaves SSA form) moves the int8 dots'
# single-use vpmaddubsw products away from their 16-bit adds, and with 16 ymm registers the
# 4-bit and q8_0 decode row blocks and panels then spill about twenty products a group to the
# stack; without it they spill none and batched decode runs faster (measured on an AVX2 CPU:
# docs/benchmarks.md, "the int8 rows without TER"). Scheduling only, so the same bits. GCC's
# flag: _compile drops it for clang. The 32-register sets are not given it until it is measured
# on an AVX-512 CPU.
_AVX2_SCHEDULE = ["-fno-tree-ter"]
_GCC_ONLY_FLAGS = frozenset(_AVX2_SCHEDULE)
_X86_ISA_FLAGS = {
    "avx512vnni": ["-march=x86-64-v4", "-mavx512vnni", "-mtune=native"],
    "avx512": ["-march=x86-64-v4", "-mtune=native"],
    "avxvnni": ["-march=x86-64-v3", "-mavxvnni", "-mtune=native"],
    "avx2": ["-march=x86-64-v3", "-mtune=native", *_AVX2_SCHEDULE],
    "generic": ["-march=x86-64", "-mtune=generic"],
}
_AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "f16c", "bmi2"}
_AVX2 = {"avx2", "fma", "f16c", "bmi2", "movbe"}
# what each set needs in /proc/cpuinfo's flags (the kernels use no more than x86-64-v3/v4 give,
# and vpdpbusd in the VNNI sets)
_X86_ISA_NEEDS = {
    "avx512vnni": _AVX512 | {"avx512_vnni"},
    "avx512": _AVX512,
    "avxvnni": _AVX2 | {"avx_vnni"},
    "avx2": _AVX2,
    "generic": set(),
}
_ARM_ISA_FLAGS = {"neondot": ["-march=armv8.2-a+dotprod"], "generic": ["-march=armv8-a"]}
_ARM_ISA_NEEDS = {"neondot": {"asimddp"}, "generic": set()}  # /proc/cpuinfo's Features
_VECTOR_ISA = {"avx512vnni": "avx512", "avxvnni": "avx2", "neondot": "generic"}


# The kernels whose code vpdpbusd (or sdot) changes: cpu_q4a8_gemm.c's integer dots and the
# one-call decode layers that include it. Every other kernel is the same code in a VNNI set as in
# its base set, so the base set's library serves both (an image builds it once, not twice).
VNNI_SOURCES = frozenset({"cpu_q4a8_gemm.c", "cpu_decode_layers.c"})


def vector_isa(isa: str) -> str:
    """The set whose vector width and tile shapes ``isa`` has (``avx512``, ``avx2`` or
    ``generic``): a VNNI set only adds an instruction."""
    return _VECTOR_ISA.get(isa, isa)


def library_isa(source: Path, isa: str) -> str:
    """The set ``source``'s library is built for when ``isa`` is selected: ``isa``, or its base
    set (:func:`vector_isa`) for a kernel that VNNI does not change (:data:`VNNI_SOURCES`)."""
    return isa if source.name in VNNI_SOURCES else vector_isa(isa)


def kernels_enabled() -> bool:
    """False when ``TANDEM_CPU_KERNELS`` is ``0``/``false``/``no``/``off`` (keep PyTorch paths)."""
    off = os.environ.get("TANDEM_CPU_KERNELS", "1").strip().lower() in {"0", "false", "no", "off"}
    if off:
        logger.info("native CPU kernels off (TANDEM_CPU_KERNELS=0); using PyTorch paths")
    return not off


class NativeBuildError(RuntimeError):
    """The kernel can't be built or loaded here; the message says why in one line."""


def cache_dir() -> Path:
    """Where built libraries live (``$TANDEM_CACHE_DIR`` or ``~/.cache/tandem``, then ``kernels``)."""
    root = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem"
    )
    return Path(root) / "kernels"


def find_compiler() -> str:
    """``$CC``, else ``cc``, ``gcc`` or ``clang`` on ``PATH``."""
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate) or candidate
    raise NativeBuildError("no C compiler found (set CC or install gcc)")


def loaded_openmp_runtime() -> Path:
    """The GNU OpenMP library PyTorch loaded into this process (Linux only): the one in torch's
    own package where it ships one, else the first loaded. Other wheels bring their own libgomp
    (sentencepiece's, loaded before torch's in a worker, was the first in the maps): linking
    against that one would start a second thread pool beside PyTorch's, and would not match the
    prebuilt kernels (whose names carry the runtime's path), so every start compiled them."""
    import torch  # (the runtime is loaded with torch)

    maps = Path("/proc/self/maps")
    if platform.system() != "Linux" or not maps.exists():
        raise NativeBuildError(f"native CPU kernels are built on Linux only, not {platform.system()}")
    runtime = openmp_runtime_in(maps.read_text(), Path(torch.__file__).resolve().parent)
    if runtime is None:
        raise NativeBuildError("PyTorch here does not use GNU OpenMP (no libgomp loaded)")
    return runtime


def openmp_runtime_in(maps: str, torch_package: Path) -> Path | None:
    """Of the libgomp libraries a ``/proc/<pid>/maps`` text names, the one inside
    ``torch_package``, else the first; None when there is none."""
    loaded: list[Path] = []
    for line in maps.splitlines():
        path = Path(line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else "")
        if "libgomp" in path.name and path not in loaded:
            loaded.append(path)
    inside = [path for path in loaded if torch_package in path.parents]
    return (inside or loaded or [None])[0]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _is_x86(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in {"x86_64", "amd64"}


def _is_arm(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in {"aarch64", "arm64"}


def architecture_isas(machine: str | None = None) -> tuple[str, ...]:
    """The sets Tandem builds for ``machine`` (default: this one), best first."""
    return X86_ISAS if _is_x86(machine) else ARM_ISAS if _is_arm(machine) else ("generic",)


def supported_isas() -> list[str]:
    """The instruction sets this CPU can execute, best first (``generic`` always)."""
    flags = set(_cpu_flags().partition(":")[2].split())
    needs = _X86_ISA_NEEDS if _is_x86() else _ARM_ISA_NEEDS if _is_arm() else {"generic": set()}
    return [isa for isa in architecture_isas() if needs[isa] <= flags]


def selected_isa() -> str:
    """``$TANDEM_CPU_ISA`` when set (checked against the CPU), else the best set it supports, or
    that set's base set where ``tandem tune`` found VNNI no faster (:func:`measured_vnni_choice`)."""
    forced = os.environ.get("TANDEM_CPU_ISA", "").strip().lower()
    if not forced:
        best = supported_isas()[0]
        return measured_vnni_choice(best) or best
    if forced not in ISAS:
        raise NativeBuildError(f"TANDEM_CPU_ISA={forced!r} is not one of {', '.join(ISAS)}")
    if forced not in supported_isas():
        raise NativeBuildError(f"TANDEM_CPU_ISA={forced} but this CPU lacks it ({platform.machine()})")
    return forced


def cpu_model() -> str:
    """The first CPU's vendor, family, model, name and stepping (``/proc/cpuinfo``): what a
    measurement cached for "this CPU" is keyed by."""
    keys = ("vendor_id", "cpu family", "model", "model name", "stepping", "CPU part")
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return os.uname().machine
    return "\n".join(line for line in lines if line.split(":")[0].strip() in keys)


def vnni_choice_path() -> Path:
    """Where ``tandem tune`` caches this CPU's measured VNNI choice
    (``services.engine.core.kernels.isa_tuning``)."""
    key = hashlib.sha256(cpu_model().encode()).hexdigest()[:16]
    return cache_dir() / f"isa-{key}.json"


def measured_vnni_choice(best: str) -> str | None:
    """The set ``tandem tune`` chose on this CPU when the flags' best set ``best`` is a VNNI set:
    ``best`` or its base set (:func:`vector_isa`); ``None`` where nothing was measured for it,
    or with ``TANDEM_AUTOTUNE=fixed`` (replicas that must take the same paths everywhere: the
    flags alone decide). Only between a VNNI set and its base set, which compute the same bits;
    never between vector widths, whose sums differ."""
    base = vector_isa(best)
    # TANDEM_AUTOTUNE read here, not by autotune.autotune_mode: that module imports this one
    if base == best or os.environ.get("TANDEM_AUTOTUNE", "").strip().lower() == "fixed":
        return None
    try:
        data = json.loads(vnni_choice_path().read_text())
        chosen = data["chosen"] if data["vnni"] == best else None
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return chosen if chosen in (best, base) else None


def isa_flags(isa: str, machine: str | None = None) -> list[str]:
    """Compiler flags that target ``isa`` on ``machine``'s architecture (default: this one's; a
    cross build names another). NEON is part of aarch64's baseline."""
    table = (_X86_ISA_FLAGS if _is_x86(machine)
             else _ARM_ISA_FLAGS if _is_arm(machine) else {"generic": []})  # fmt: skip
    if isa not in table:
        where = machine or platform.machine()
        raise NativeBuildError(f"{isa} is not an instruction set of {where}")
    return list(table[isa])


def prebuilt_flags(isa: str) -> list[str]:
    """Flags of a prebuilt library: :func:`isa_flags` tuned for no particular CPU."""
    tuned = ["-mtune=generic" if f.startswith("-mtune=") else f for f in isa_flags(isa)]
    return [*CFLAGS, *tuned]


def _sources(source: Path) -> list[str]:
    """``source`` and every C source and header beside it (a kernel may include another's)."""
    beside = [p.read_text() for p in sorted(source.parent.glob("*.[ch]")) if p != source]
    return [source.read_text(), *beside]


def prebuilt_name(source: Path, isa: str, openmp: Path) -> str:
    """File name of ``source``'s prebuilt library for ``isa`` against the ``openmp`` runtime."""
    parts = [*_sources(source), " ".join(prebuilt_flags(isa)), str(openmp)]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return f"{source.stem}-{isa}-{key}.so"


def prebuilt_dir() -> Path:
    """Where prebuilt libraries are looked for: ``$TANDEM_PREBUILT_KERNELS``, else the running
    environment's ``share/tandem/kernels`` (where ``scripts/install.sh`` builds them)."""
    root = os.environ.get(PREBUILT_ENV)
    return Path(root) if root else Path(sys.prefix) / "share" / "tandem" / "kernels"


def prebuilt_library(source: Path, isa: str) -> Path | None:
    """The prebuilt library (:func:`prebuilt_dir`) for ``source`` and ``isa``, if it is there."""
    path = prebuilt_dir() / prebuilt_name(source, isa, loaded_openmp_runtime())
    return path if path.is_file() else None


def compile_library(source: Path, isa: str, flags: list[str], target: Path) -> None:
    """Compile and link ``source`` with ``flags`` (ISA flags included) into ``target``."""
    _compile(find_compiler(), flags, source, loaded_openmp_runtime(), target)


@functools.cache
def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"{cc} --version failed: {exc}") from exc


def build_library(source: Path, isa: str | None = None) -> Path:
    """Compile ``source`` for ``isa`` (default :func:`selected_isa`), or reuse the cached build,
    and return the shared library's path. Every C source and header beside ``source`` is part of
    the cache key (a kernel may include another's source: cpu_decode_layers.c). A prebuilt
    library (:func:`prebuilt_dir`) for the same sources and ``isa`` is taken first."""
    path = _build(source, isa, wait=True)
    assert path is not None  # a waiting build always ends with the library (or raises)
    return path


def _build(source: Path, isa: str | None, *, wait: bool) -> Path | None:
    """:func:`build_library`; with ``wait`` False, None at once when another process or thread is
    compiling the same library (it will be there for whoever needs it)."""
    isa = library_isa(source, isa or selected_isa())
    prebuilt = prebuilt_library(source, isa)
    if prebuilt is not None:
        return prebuilt
    cc = find_compiler()
    openmp = loaded_openmp_runtime()
    flags = [*CFLAGS, *isa_flags(isa)]
    key = hashlib.sha256(
        "\0".join(
            [*_sources(source), cc, _compiler_version(cc), " ".join(flags), _cpu_flags(),
             str(openmp)]
        ).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{isa}-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _build_lock(target, wait=wait) as locked:
            if not locked:
                return None
            if target.exists():  # another process built it while this one waited
                return target
            logger.info("compiling %s for %s: %s", source.name, isa, _why_compiling(source, isa))
            _compile(cc, flags, source, openmp, target)
    except OSError as exc:  # e.g. a read-only cache directory
        raise NativeBuildError(f"cannot build into {target.parent}: {exc}") from exc
    logger.info("built %s", target)
    return target


@contextlib.contextmanager
def _build_lock(target: Path, *, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``target``'s lock file, released when the holder ends (even
    by a crash). ``wait``: until another process or thread building the same library is done;
    else yields False at once when one is."""
    fd = os.open(target.with_name(f".{target.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def kernel_sources() -> list[Path]:
    """Every kernel's C source shipped with Tandem."""
    return sorted(Path(__file__).resolve().parent.glob("*.c"))


def build_ahead(isa: str | None = None, sources: list[Path] | None = None) -> None:
    """Compile every shipped kernel (or ``sources``) that has no library here yet for ``isa``
    (default: the selected set), skipping any that another process or thread is compiling. A
    worker runs this on a thread of its own at start: without prebuilt kernels its first uses
    would compile them one at a time while a core idles (and the other workers wait on the same
    locks), so this keeps a second compiler busy meanwhile. With prebuilt or cached libraries it
    only looks (no compiler runs). A kernel that fails to build is left to its first use, which
    reports it."""
    if not kernels_enabled():
        return
    try:
        isa = isa or selected_isa()  # once: the set this worker selected at its start
    except NativeBuildError as exc:
        logger.debug("building kernels ahead: %s", exc)
        return
    for source in kernel_sources() if sources is None else sources:
        try:
            _build(source, isa, wait=False)
        except Exception as exc:  # noqa: BLE001 - best effort: the kernel's first use reports it
            logger.debug("building %s ahead failed: %s", source.name, exc)


def _why_compiling(source: Path, isa: str) -> str:
    """Why no prebuilt library served ``source`` (for the log line before a compile)."""
    where = prebuilt_dir()
    hint = "`python -m services.engine.core.kernels.prebuild --this-cpu` builds them ahead of time"
    if any(where.glob(f"{source.stem}-{isa}-*.so")):
        return (f"the prebuilt kernels in {where} were built from other sources (the code "
                f"changed since they were built); {hint}")
    return f"no prebuilt kernels in {where}; {hint}"


def _compile(cc: str, flags: list[str], source: Path, openmp: Path, target: Path) -> None:
    if "clang" in _compiler_version(cc).lower():
        flags = [f for f in flags if f not in _GCC_ONLY_FLAGS]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        # compile with -fopenmp, but link the process's libgomp by path instead of -lgomp
        steps = [
            [cc, *flags, f"-I{source.parent}", "-c", str(source), "-o", str(obj)],
            [cc, "-shared", str(obj), str(openmp), f"-Wl,-rpath,{openmp.parent}",
             "-Wl,--no-undefined", "-lm", "-o", str(lib)],
        ]
        for cmd in steps:
            try:
                # generous: the one-call decode layers take ~2 minutes at -O3 for AVX-512 on
                # one core, and an image build compiles several at once
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
            except (OSError, subprocess.SubprocessError) as exc:
                raise NativeBuildError(f"{Path(cc).name} failed to run: {exc}") from exc
            if done.returncode != 0:
                lines = done.stderr.strip().splitlines() or ["(no output)"]
                first = next((line for line in lines if "error" in line), lines[0])
                raise NativeBuildError(f"{Path(cc).name} failed on {source.name}: {first.strip()}")
        os.replace(lib, target)


def load_kernel(source: Path, make: Callable[[ctypes.CDLL], T], what: str) -> T | None:
    """``make(library)`` for ``source`` built for the selected instruction set, or ``None`` when
    the kernels are off (``TANDEM_CPU_KERNELS=0``) or can't be built here (one warning saying why:
    the caller keeps its PyTorch path)."""
    if not kernels_enabled():
        return None
    try:
        return make(load_library(source, selected_isa()))
    except NativeBuildError as exc:
        logger.warning("%s unavailable, using PyTorch: %s", what, exc)
        return None


def load_library(source: Path, isa: str | None = None) -> ctypes.CDLL:
    """Build (or reuse) and ``dlopen`` the library for ``source`` and ``isa``."""
    path = build_library(source, isa)
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeBuildError(f"cannot load {path.name}: {exc}") from exc
