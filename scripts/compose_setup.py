"""Before scripts/compose_test.py starts the stack: decide how the image can be built on this
machine, build it through compose, and prepare the environment compose runs in.

Why a plan: the Dockerfile's defaults (``python:3.11-slim`` from Docker Hub, torch from
download.pytorch.org's CPU index) are what users get; a machine that reaches only PyPI and the
Debian mirrors (CI here) builds the same image from a Debian-built base
(scripts/debian_base_image.sh) and a local CPU torch wheel with PyPI for the rest. Each choice is
logged with its reason.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from compose_stack import run

logger = logging.getLogger("compose_test")
DEFAULT_BASE = "python:3.11-slim"
LOCAL_BASE = "tandem-base:bookworm"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI = "https://pypi.org/simple"


@dataclass(frozen=True)
class BuildPlan:
    """Build arguments beyond compose.cpu.yaml's (empty: the Dockerfile's defaults)."""

    build_args: dict[str, str]
    wheels: list[Path]  # torch wheels to place in the build context's wheels/


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=15):
            return True
    except Exception:  # DNS, TLS, HTTP errors alike: not usable
        return False


def _base_image(repo: Path) -> str:
    if subprocess.run(["docker", "image", "inspect", DEFAULT_BASE], capture_output=True,
                      check=False).returncode == 0:  # fmt: skip
        return DEFAULT_BASE
    pulled = subprocess.run(["docker", "pull", "-q", DEFAULT_BASE], capture_output=True,
                            text=True, timeout=300, check=False)  # fmt: skip
    if pulled.returncode == 0:
        return DEFAULT_BASE
    logger.info("cannot pull %s (%s): building %s from Debian packages", DEFAULT_BASE,
                pulled.stderr.strip().splitlines()[-1:] or "?", LOCAL_BASE)  # fmt: skip
    run([str(repo / "scripts" / "debian_base_image.sh"), LOCAL_BASE], timeout=900)
    return LOCAL_BASE


def _local_torch_wheels(given: Path | None) -> list[Path]:
    dirs = [given] if given else [Path(d) for d in os.environ.get("PIP_FIND_LINKS", "").split()]
    return sorted(w for d in dirs if d.is_dir() for w in d.glob("torch-*+cpu-*.whl"))


def plan_build(
    repo: Path, base: str | None, index: str | None, wheels_dir: Path | None
) -> BuildPlan:
    """What to pass the build on this machine (see the module docstring)."""
    args = {"BASE_IMAGE": base or _base_image(repo)}
    wheels = _local_torch_wheels(wheels_dir)
    if index:
        args["TORCH_INDEX_URL"] = index
    elif not _reachable(CPU_INDEX + "/torch/"):
        args["TORCH_INDEX_URL"] = PYPI
        logger.info("%s is out of reach: torch from PyPI%s", CPU_INDEX,
                    f" with the local wheel {wheels[0].name}" if wheels else
                    " (no local CPU wheel: the CUDA build)")  # fmt: skip
    return BuildPlan(args, wheels)


def _place_wheels(repo: Path, wheels: list[Path]) -> None:
    target = repo / "wheels"
    for wheel in wheels:
        placed = target / wheel.name
        if placed.exists():
            continue
        try:
            os.link(wheel, placed)
        except OSError:  # another file system
            shutil.copy2(wheel, placed)


def build_image(repo: Path, files: list[str], plan: BuildPlan, image: str) -> dict[str, float]:
    """``docker compose ... build`` with the plan's arguments; build seconds and image bytes."""
    _place_wheels(repo, plan.wheels)
    flags = [a for k, v in plan.build_args.items() for a in ("--build-arg", f"{k}={v}")]
    started = time.monotonic()
    run(["docker", "compose", *(a for f in files for a in ("-f", f)), "build", *flags, "gateway"],
        cwd=repo, env=compose_env(0), timeout=3600)  # fmt: skip
    took = time.monotonic() - started
    size = float(run(["docker", "image", "inspect", "-f", "{{.Size}}", image], quiet=True))
    logger.info("built %s in %.0f s: %.0f MB (%s)", image, took, size / 1e6,
                " ".join(f"{k}={v}" for k, v in plan.build_args.items()))  # fmt: skip
    return {"build_s": took, "image_mb": size / 1e6}


def compose_env(port: int, dtype: str = "") -> dict[str, str]:
    """The caller's environment without TANDEM_*/COMPOSE_* settings, gateway on ``port``, the
    workers' ``--dtype`` ``dtype`` (compose.yaml's TANDEM_DTYPE) when given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "COMPOSE_"))}
    if dtype:
        env["TANDEM_DTYPE"] = dtype
    if port:
        env["TANDEM_PORT"] = str(port)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
