"""Build every native CPU kernel for every instruction set into one directory, ahead of time.

Why: no worker should compile on its way to ``ready`` (a first start took 89 s, much of it each
worker compiling its kernels), and a container image should not need a C compiler at run time.
``scripts/install.sh`` runs this into the environment's ``share/tandem/kernels`` (with no
argument, :func:`native_build.prebuilt_dir`); the Dockerfile runs it in its build stage, and the
runtime stage copies the directory and sets ``$TANDEM_PREBUILT_KERNELS`` to it.
:func:`native_build.build_library` then loads the variant the running CPU selects from there
(see native_build.py for the naming). On x86-64 every set is built whatever the build
machine's CPU (compiling for AVX-512 does not need AVX-512); on aarch64 ``neondot`` and
``generic``; elsewhere the ``generic`` one.
An install (``--this-cpu``) builds the set this CPU selects and, for a VNNI set, its base set
too, which ``tandem tune`` may choose instead (``isa_tuning``).

    python -m services.engine.core.kernels.prebuild [/opt/tandem/kernels]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.engine.core.kernels import native_build

logger = logging.getLogger(__name__)


def target_isas(this_cpu: bool = False) -> tuple[str, ...]:
    """The instruction sets worth building on this architecture (``this_cpu``: only what this
    CPU's workers may select, what an install for this machine needs: the selected set and, for a
    VNNI set, its base set too, which ``tandem tune`` may choose instead; an image builds them
    all)."""
    if this_cpu and os.environ.get("TANDEM_CPU_ISA", "").strip():
        return (native_build.selected_isa(),)  # forced: the workers take nothing else
    if this_cpu:
        best = native_build.supported_isas()[0]
        return tuple(dict.fromkeys((best, native_build.vector_isa(best))))
    return native_build.architecture_isas()


def prebuild(out: Path, this_cpu: bool = False) -> list[Path]:
    """Build every kernel for every set of :func:`target_isas` into ``out`` (one compiler per
    core; a library already there is kept) and remove the libraries of older sources; the paths
    built."""
    openmp = native_build.loaded_openmp_runtime()
    jobs = {  # a kernel VNNI does not change is built once, for the base set (library_isa)
        out / native_build.prebuilt_name(source, built, openmp): (source, built)
        for source in native_build.kernel_sources()
        for isa in target_isas(this_cpu)
        for built in [native_build.library_isa(source, isa)]
    }

    def build(target: Path) -> Path:
        if not target.is_file():
            source, isa = jobs[target]
            native_build.compile_library(source, isa, native_build.prebuilt_flags(isa), target)
            logger.info("built %s", target.name)
        return target

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        built = list(pool.map(build, jobs))
    stems = {source.stem for source in native_build.kernel_sources()}
    for old in out.glob("*.so"):
        if old not in jobs and old.name.rsplit("-", 2)[0] in stems:
            old.unlink(missing_ok=True)  # a build of sources no longer shipped
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=None,
                        help="directory for the libraries (default: this environment's "
                             "share/tandem/kernels, where workers look)")  # fmt: skip
    parser.add_argument("--this-cpu", action="store_true",
                        help="only the instruction sets this CPU runs (an install, not an image)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = args.out if args.out is not None else native_build.prebuilt_dir()
    try:
        built = prebuild(out, this_cpu=args.this_cpu)
    except native_build.NativeBuildError as exc:
        logger.error("prebuild failed: %s", exc)
        return 1
    logger.info("%d kernel libraries in %s", len(built), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
