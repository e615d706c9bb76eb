"""Where a served token goes: CPU per output token in each process and the decode engine
thread's step timeline, under ``tandem bench serve`` load at each concurrency.

1. Start ``tandem up`` (default model; ``--up-args`` adds flags) on ports of its own and wait
   for ``/ready``.
2. Per concurrency level: scrape every process's ``/metrics`` (``process_cpu_seconds_total``
   of the gateway, tokenizer, prefill and decode processes; the workers'
   ``tandem:engine_thread_seconds_total{phase}`` and ``tandem:engine_steps_total``), run
   ``tandem bench serve`` for that level alone (completions endpoint, fixed-length prompts and
   outputs, ``ignore_eos``), scrape again. The load generator's own CPU is its child rusage.
3. Print, per level: output tok/s, ITL p50, CPU milliseconds per output token in each process
   (and the whole machine's share: the sum against cores x wall), and the decode engine
   thread's wall time per phase (ms per step and share of the level's wall time).

    python bench/serve_profile.py [--concurrency 1 16] [--num-prompts 32]
        [--input-tokens 256] [--output-tokens 128] [--up-args "--mode colocated"]
        [--output-dir bench-profile]

Needs an idle machine: nothing else may run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from serve_compare import _process  # noqa: E402

logger = logging.getLogger("serve_profile")

GATEWAY = 8600
GATEWAY_METRICS = 9702  # the gateway's /metrics is on a port of its own, not the API's
PORTS = ["--gateway-port", str(GATEWAY), "--gateway-metrics-port", str(GATEWAY_METRICS),
         "--tokenizer-port", "50651",
         "--tokenizer-metrics-port", "9701", "--prefill-port", "50661",
         "--prefill-metrics-port", "9711", "--decode-port", "50671",
         "--decode-metrics-port", "9721"]  # fmt: skip
PROCESSES = {  # name -> metrics URL
    "gateway": f"http://127.0.0.1:{GATEWAY_METRICS}/metrics",
    "tokenizer": "http://127.0.0.1:9701/metrics",
    "prefill": "http://127.0.0.1:9711/metrics",
    "decode": "http://127.0.0.1:9721/metrics",
}
PHASES = ("idle", "commands", "schedule", "inputs", "forward", "sample", "postprocess",
          "outputs", "publish")  # fmt: skip


@dataclass
class Scrape:
    """One process's counters at one moment."""

    cpu_s: float
    phases: dict[str, float]
    steps: float


def scrape(url: str) -> Scrape | None:
    """The counters this profile reads from one ``/metrics`` page (None: not served)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    cpu, phases, steps = 0.0, {}, 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "process_cpu_seconds_total":
                cpu = sample.value
            elif sample.name == "tandem:engine_thread_seconds_total":
                phases[sample.labels["phase"]] = sample.value
            elif sample.name == "tandem:engine_steps_total":
                steps = sample.value
    return Scrape(cpu, phases, steps)


def scrape_all() -> dict[str, Scrape]:
    return {name: s for name, url in PROCESSES.items() if (s := scrape(url)) is not None}


def run_level(args: argparse.Namespace, concurrency: int) -> dict[str, object]:
    """One level under load, with the counters around it."""
    tandem = Path(sys.executable).with_name("tandem")
    out = args.output_dir / f"c{concurrency}"
    argv = [str(tandem), "bench", "serve", "--base-url", f"http://127.0.0.1:{GATEWAY}/v1",
            "--endpoint", "completions", "--input-tokens", str(args.input_tokens),
            "--output-tokens", str(args.output_tokens), "--num-prompts", str(args.num_prompts),
            "--concurrency", str(concurrency), "--output-dir", str(out), "--no-progress"]  # fmt: skip
    before, child_before = scrape_all(), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - start
    after, child_after = scrape_all(), resource.getrusage(resource.RUSAGE_CHILDREN)
    document = json.loads((out / "results.json").read_text())
    level = document["servers"][0]["levels"][0]
    summary = level["summary"]
    tokens = max(1, summary["output_tokens"])
    cpu = {name: after[name].cpu_s - before[name].cpu_s for name in after if name in before}
    cpu["loadgen"] = (child_after.ru_utime + child_after.ru_stime
                      - child_before.ru_utime - child_before.ru_stime)  # fmt: skip
    timeline = {}
    for role in ("decode", "prefill"):
        if role in after and role in before and after[role].phases:
            spent = {p: after[role].phases.get(p, 0.0) - before[role].phases.get(p, 0.0)
                     for p in PHASES}  # fmt: skip
            timeline[role] = {"seconds": spent, "steps": after[role].steps - before[role].steps}
    return {
        "concurrency": concurrency, "wall_s": wall, "duration_s": level["duration_s"],
        "output_tokens": summary["output_tokens"], "output_throughput": summary["output_throughput"],
        "itl_p50_ms": 1000 * summary["itl"]["p50"] if summary.get("itl") else None,
        "ttft_p50_s": summary["ttft"]["p50"] if summary.get("ttft") else None,
        "cpu_ms_per_token": {name: 1000 * s / tokens for name, s in cpu.items()},
        "cpu_share": sum(cpu.values()) / (wall * (os.cpu_count() or 1)),
        "timeline": timeline,
    }  # fmt: skip


def print_level(result: dict[str, object]) -> None:
    c = result["concurrency"]
    print(f"\n### concurrency {c}: {result['output_throughput']:.1f} output tok/s, "
          f"ITL p50 {result['itl_p50_ms']:.2f} ms, TTFT p50 {result['ttft_p50_s']:.3f} s, "
          f"{result['output_tokens']} tokens in {result['duration_s']:.1f} s; the machine "
          f"{100 * result['cpu_share']:.0f}% busy\n")  # fmt: skip
    cpu = result["cpu_ms_per_token"]
    assert isinstance(cpu, dict)
    print("| process | CPU ms per output token |")
    print("|---|---|")
    for name, ms in cpu.items():
        print(f"| {name} | {ms:.2f} |")
    print(f"| all | {sum(cpu.values()):.2f} |")
    timeline = result["timeline"]
    assert isinstance(timeline, dict)
    decode = timeline.get("decode")
    if decode:
        steps = max(1.0, decode["steps"])
        total = sum(decode["seconds"].values()) or 1.0
        print(f"\ndecode engine thread: {decode['steps']:.0f} steps, "
              f"{1000 * (total - decode['seconds']['idle']) / steps:.2f} ms busy per step\n")
        print("| phase | ms per step | share of the thread's wall time |")
        print("|---|---|---|")
        for phase in PHASES:
            spent = decode["seconds"][phase]
            print(f"| {phase} | {1000 * spent / steps:.3f} | {100 * spent / total:.1f}% |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--up-args", default="", help="more `tandem up` flags, one string")
    parser.add_argument("--output-dir", type=Path, default=Path("bench-profile"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    tandem = Path(sys.executable).with_name("tandem")
    argv = [str(tandem), "up", *PORTS, *shlex.split(args.up_args)]
    results = []
    with _process(argv, f"http://127.0.0.1:{GATEWAY}/ready", args.output_dir / "up.log",
                  dict(os.environ)):  # fmt: skip
        logger.info("tandem up is ready: %s", " ".join(argv[1:]))
        for concurrency in args.concurrency:
            result = run_level(args, concurrency)
            results.append(result)
            print_level(result)
    (args.output_dir / "profile.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
