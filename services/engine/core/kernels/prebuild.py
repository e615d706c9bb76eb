"""Build every native CPU kernel for every instruction set into one directory, ahead of time.

Why: a container image should not need a C compiler at run time. The Dockerfile runs this in its
build stage and the runtime stage copies the directory and sets ``$TANDEM_PREBUILT_KERNELS`` to
it; :func:`native_build.build_library` then loads the variant the running CPU selects from there
(see native_build.py for the naming). On x86-64 all three sets are built whatever the build
machine's CPU (compiling for AVX-512 does not need AVX-512); elsewhere the ``generic`` one.

    python -m services.engine.core.kernels.prebuild /opt/tandem/kernels
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from services.engine.core.kernels import native_build

logger = logging.getLogger(__name__)
KERNELS = Path(__file__).resolve().parent


def kernel_sources() -> list[Path]:
    """Every kernel's C source shipped with Tandem."""
    return sorted(KERNELS.glob("*.c"))


def target_isas() -> tuple[str, ...]:
    """The instruction sets worth building on this architecture."""
    return native_build.ISAS if native_build._is_x86() else ("generic",)


def prebuild(out: Path) -> list[Path]:
    """Build every kernel for every set of :func:`target_isas` into ``out``; the paths built."""
    openmp = native_build.loaded_openmp_runtime()
    built = []
    for source in kernel_sources():
        for isa in target_isas():
            target = out / native_build.prebuilt_name(source, isa, openmp)
            native_build.compile_library(source, isa, native_build.prebuilt_flags(isa), target)
            built.append(target)
            logger.info("built %s", target)
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for the libraries")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        built = prebuild(args.out)
    except native_build.NativeBuildError as exc:
        logger.error("prebuild failed: %s", exc)
        return 1
    logger.info("%d kernel libraries in %s", len(built), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
