"""Regenerate the Python gRPC stubs for ``protos/tandem/v1/*.proto`` into ``services/common/pb``.

The protos live under ``tandem/v1/`` so their package (``tandem.v1``) and the file names recorded in
the descriptors (``tandem/v1/common.proto``, what server reflection serves) stay clean, while the
Python stubs live inside our package. ``protoc`` writes ``from tandem.v1 import x_pb2``; this script
rewrites those imports to ``from services.common.pb import x_pb2``.

Generation:
  1. Run ``grpc_tools.protoc`` (``--python_out``, ``--pyi_out``, ``--grpc_python_out``) on every
     ``.proto`` into a temporary folder.
  2. Flatten ``tandem/v1/*`` into one folder, rewrite the imports, add ``__init__.py``.
  3. Without ``--check``: replace the output folder's generated files with the new ones.
     With ``--check``: compare instead, list stale / missing / extra files, exit 1 if any.

Usage::

    python protos/codegen.py            # regenerate services/common/pb
    python protos/codegen.py --check    # CI: fail if the committed stubs are stale

The generated code depends on the grpcio-tools version that produced it (it checks the grpcio and
protobuf runtime versions at import), so ``--check`` also prints the version it used.
"""

from __future__ import annotations

import argparse
import importlib.resources
import logging
import re
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_PACKAGE_DIR = Path("tandem") / "v1"
OUT_DIR = REPO_ROOT / "services" / "common" / "pb"
OUT_PACKAGE = "services.common.pb"

_IMPORT_RE = re.compile(r"^from tandem\.v1 import (\w+_pb2)", re.MULTILINE)
# The module name protoc passes to the builder becomes each message class's __module__ (used by
# pickle and reprs), so it must name the real module too.
_MODULE_RE = re.compile(r"'tandem\.v1\.(\w+_pb2)'")

_INIT_TEMPLATE = '''"""Generated protobuf / gRPC stubs for the ``tandem.v1`` protos. Do not edit.

Regenerate with ``python protos/codegen.py``; ``python protos/codegen.py --check`` fails when these
files are stale. Sources: ``protos/tandem/v1/*.proto``.
"""
'''


class CodegenError(Exception):
    """protoc failed or the inputs are missing."""


def _tools_version() -> str:
    try:
        return version("grpcio-tools")
    except PackageNotFoundError:
        return "unknown"


def generate(proto_root: Path, dest: Path) -> dict[str, str]:
    """Run protoc on every proto under ``proto_root/tandem/v1`` and return {file name: text}.

    Args:
        proto_root: the include root holding ``tandem/v1/*.proto``.
        dest: an empty scratch folder for protoc's raw output.

    Raises:
        CodegenError: no protos found, or protoc reported an error.
    """
    from grpc_tools import protoc  # imported lazily: only the codegen needs grpcio-tools

    protos = sorted((proto_root / PROTO_PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise CodegenError(f"no .proto files under {proto_root / PROTO_PACKAGE_DIR}")
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={dest}",
        f"--pyi_out={dest}",
        f"--grpc_python_out={dest}",
        *(str(p.relative_to(proto_root)) for p in protos),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise CodegenError(f"protoc exited with {rc} (args: {' '.join(args[1:])})")

    files: dict[str, str] = {"__init__.py": _INIT_TEMPLATE}
    for path in sorted((dest / PROTO_PACKAGE_DIR).iterdir()):
        if path.suffix not in (".py", ".pyi"):
            continue
        text = _IMPORT_RE.sub(rf"from {OUT_PACKAGE} import \1", path.read_text())
        text = _MODULE_RE.sub(rf"'{OUT_PACKAGE}.\1'", text)
        files[path.name] = text
    return files


def _existing(out_dir: Path) -> dict[str, str]:
    if not out_dir.is_dir():
        return {}
    return {
        p.name: p.read_text()
        for p in sorted(out_dir.iterdir())
        if p.is_file() and p.suffix in (".py", ".pyi")
    }


def stale_files(expected: dict[str, str], out_dir: Path) -> list[str]:
    """Describe every difference between the expected files and those in ``out_dir``."""
    current = _existing(out_dir)
    problems = []
    for name in sorted(expected.keys() | current.keys()):
        if name not in current:
            problems.append(f"missing: {out_dir / name}")
        elif name not in expected:
            problems.append(f"extra (no proto generates it): {out_dir / name}")
        elif current[name] != expected[name]:
            problems.append(f"stale: {out_dir / name}")
    return problems


def write(expected: dict[str, str], out_dir: Path) -> None:
    """Replace the generated files in ``out_dir`` with ``expected`` (removing leftovers)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in _existing(out_dir).keys() - expected.keys():
        (out_dir / name).unlink()
    for name, text in expected.items():
        (out_dir / name).write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    parser.add_argument("--proto-root", type=Path, default=PROTO_ROOT)
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    with tempfile.TemporaryDirectory(prefix="tandem-codegen-") as scratch:
        try:
            expected = generate(args.proto_root, Path(scratch))
        except CodegenError as err:
            logger.error("codegen failed: %s", err)
            return 2

    if args.check:
        problems = stale_files(expected, args.out_dir)
        if problems:
            for line in problems:
                logger.error("%s", line)
            logger.error(
                "generated stubs are stale (checked with grpcio-tools %s); "
                "run: python protos/codegen.py",
                _tools_version(),
            )
            return 1
        logger.info("stubs in %s are up to date (grpcio-tools %s)", args.out_dir, _tools_version())
        return 0

    write(expected, args.out_dir)
    logger.info("wrote %d files to %s", len(expected), args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
