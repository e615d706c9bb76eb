"""Overload: twice the load the stack can serve, with the gateway's admission limit set.

What a user should see when a server is over capacity: the requests it admits keep their
latency, and the rest are refused at once with 429 and ``Retry-After`` (no timeouts, no queue
that grows without bound). One run, three phases against one ``tandem up``:

1. ``tandem up`` (default model, default mode) with the gateway's ``--max-in-flight K``. Each
   phase sends prompts of its own, so none is served from an earlier phase's prefix cache.
2. *unloaded*: ``tandem bench serve --concurrency 1``: the TTFT a lone request gets.
3. *capacity*: ``--concurrency K``: the admission limit kept full; its request throughput is
   what the stack serves (requests/s).
4. *overload*: Poisson arrivals at ``--overload`` (default 2) times that throughput: admitted
   requests' TTFT / E2E percentiles, the 429s and how fast they came, anything else.

Prints one table and the ratio of the overload TTFT p99 to the unloaded one.

    python bench/overload.py [--max-in-flight 4] [--num-prompts 48] [--input-tokens 256]
        [--output-tokens 64] [--overload 2] [--output-dir bench-overload]

Needs an idle machine: nothing else may run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
logger = logging.getLogger("overload")

PORTS = ["--gateway-port", "8500", "--tokenizer-port", "50551", "--tokenizer-metrics-port",
         "9601", "--prefill-port", "50561", "--prefill-metrics-port", "9611", "--decode-port",
         "50571", "--decode-metrics-port", "9621"]  # fmt: skip
URL = "http://127.0.0.1:8500"


def _wait_ready(proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem up exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(URL + "/ready", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError("the stack did not become ready")


def _bench(out: Path, args: argparse.Namespace, seed: int, *level: str) -> dict[str, Any]:
    """One ``tandem bench serve`` level; each phase has its own prompts (``seed``), so no phase
    is served from the prefix cache of an earlier one."""
    cmd = [sys.executable, "-m", "services", "--log-level", "WARNING", "bench", "serve",
           "--base-url", URL, "--num-prompts", str(args.num_prompts), "--input-tokens",
           str(args.input_tokens), "--output-tokens", str(args.output_tokens), "--seed", str(seed),
           "--no-progress", "--timeout", "120", "--output-dir", str(out), *level]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    summary: dict[str, Any] = json.loads((out / "results.json").read_text())["servers"][0][
        "levels"][0]["summary"]
    return summary


def _ms(dist: dict[str, float] | None, key: str) -> str:
    return "–" if not dist else f"{dist[key] * 1e3:.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-in-flight", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--overload", type=float, default=2.0)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-overload"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    up = subprocess.Popen(
        [sys.executable, "-m", "services", "up", *PORTS, "--gateway-args",
         f"--max-in-flight {args.max_in_flight}"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_ready(up)
        phases: dict[str, dict[str, Any]] = {}
        phases["unloaded (c=1)"] = _bench(args.output_dir / "unloaded", args, 1,
                                            "--concurrency", "1")
        k = str(args.max_in_flight)
        phases[f"capacity (c={k})"] = _bench(args.output_dir / "capacity", args, 2,
                                             "--concurrency", k)  # fmt: skip
        rate = args.overload * phases[f"capacity (c={k})"]["request_throughput"]
        logger.info("capacity %.2f req/s; overload at %.2f req/s", rate / args.overload, rate)
        phases[f"overload ({args.overload:g}x: {rate:.2f} req/s)"] = _bench(
            args.output_dir / "overload", args, 3, "--request-rate", f"{rate:.3f}")
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    print(f"max-in-flight {args.max_in_flight}, {args.num_prompts} requests per phase, "
          f"{args.input_tokens}-token prompts, {args.output_tokens} output tokens\n")
    print("| phase | admitted / sent | 429 | other errors | req/s served | TTFT ms p50 / p99 "
          "| E2E s p50 / p99 | 429 latency ms p50 / p99 | 429 without Retry-After |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s in phases.items():
        other = sum(n for kind, n in s["errors_by_kind"].items() if kind != "rejected")
        e2e = s["e2e"]
        print(f"| {name} | {s['completed']} / {s['requests']} | {s['rejected']} | {other} | "
              f"{s['request_throughput']:.2f} | {_ms(s['ttft'], 'p50')} / {_ms(s['ttft'], 'p99')} | "
              f"{e2e['p50']:.2f} / {e2e['p99']:.2f} | {_ms(s['reject_latency'], 'p50')} / "
              f"{_ms(s['reject_latency'], 'p99')} | {s['rejected_without_retry_after']} |")
    unloaded, overload = list(phases.values())[0], list(phases.values())[-1]
    ratio = overload["ttft"]["p99"] / unloaded["ttft"]["p99"]
    print(f"\nadmitted TTFT p99 under overload / unloaded TTFT p99 = {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
