"""Time ``tandem up`` from launch to its ``ready`` line: a first start with the kernel cache
removed, then later starts, side by side with the old way (each worker compiling its kernels and
timing them against PyTorch on its way to ready).

Each row starts the whole system (tokenizer, a prefill and a decode worker, the gateway) on the
given model with a fresh, empty ``$TANDEM_CACHE_DIR`` for its "first start" and the same cache
again for "later starts", waits for the ``ready`` line (every worker reachable from the
gateway), stops it, and reports seconds. The old way is the same tree with
``TANDEM_PREBUILT_KERNELS`` pointed at an empty directory (so workers compile) and
``TANDEM_AUTOTUNE=measure`` (so they time their kernels). Run it on a quiet machine.

    python bench/startup.py [--model default] [--later 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("bench.startup")
ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def time_to_ready(model: str, env: dict[str, str], timeout: float, log: Path) -> float:
    """Seconds from launching ``tandem up`` to its ``ready`` line; the system is then stopped."""
    tandem = Path(sys.executable).with_name("tandem")
    with socket.socket() as probe:  # a free port for the gateway
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [str(tandem), "up", "--model", model, "--gateway-port", str(port)]
    start = time.perf_counter()
    with open(log, "ab") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                if raw.strip() == b"ready":
                    return time.perf_counter() - start
                if time.perf_counter() - start > timeout:
                    break
            raise RuntimeError(f"tandem up gave no ready line (see {log})")
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--later", type=int, default=2, help="later starts timed per way")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--log", type=Path, default=Path("bench-startup.log"))
    parser.add_argument("--no-old", action="store_true", help="time only the way it is now")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ways = {
        "now (prebuilt kernels, no timing at start)": {},
        "old (compile + time at start)": {"TANDEM_AUTOTUNE": "measure"},
    }
    if args.no_old:
        ways = dict(list(ways.items())[:1])
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-startup-") as tmp:
        empty = Path(tmp) / "no-prebuilt"
        empty.mkdir()
        for name, extra in ways.items():
            cache = Path(tmp) / f"cache-{len(rows)}"
            env = {**os.environ, **extra, "TANDEM_CACHE_DIR": str(cache)}
            if extra:
                env["TANDEM_PREBUILT_KERNELS"] = str(empty)
            shutil.rmtree(cache, ignore_errors=True)
            logger.info("%s: first start, cache %s", name, cache)
            first = time_to_ready(args.model, env, args.timeout, args.log)
            logger.info("%s: first start %.1f s", name, first)
            later = [time_to_ready(args.model, env, args.timeout, args.log)
                     for _ in range(args.later)]  # fmt: skip
            logger.info("%s: later starts %s s", name, ", ".join(f"{t:.1f}" for t in later))
            rows.append((name, first, later))
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "baseline"
    print(f"\n`tandem up --model {args.model}` to `ready`, {cpu_model()} ({isa}), "
          f"{os.cpu_count()} cores\n")
    print("| way | first start (kernel cache removed) | later starts (median) |")
    print("|---|---|---|")
    for name, first, later in rows:
        median = sorted(later)[len(later) // 2] if later else float("nan")
        print(f"| {name} | {first:.1f} s | {median:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
