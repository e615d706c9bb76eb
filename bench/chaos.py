"""Chaos run: many streaming requests, clients that leave mid-stream, and workers killed with
SIGKILL during the run; then a count of every request's outcome and of KV blocks left in use.

1. ``tandem up --prefill 1 --decode 2`` (every prompt through the prefill worker and the KV
   hand-off: ``--remote-prefill-min-tokens 0``), on ports of its own.
2. ``--requests`` streaming chat requests, ``--concurrency`` at a time (greedy, ``max_tokens``
   between 8 and 48). A ``--disconnect`` fraction of clients (seeded) closes its connection after
   a random number of chunks.
3. When a third of the requests have finished, ``prefill-0`` gets SIGKILL; at two thirds the
   decode worker with the most requests in flight does. ``tandem up`` restarts both.
4. Every request ends in exactly one outcome: *complete* (a finish reason and ``[DONE]``), *error*
   (an HTTP error or an error event: an explicit answer), *disconnected* (the client left, on
   purpose) or *lost* (the stream ended with neither, or nothing came for ``--timeout`` seconds).
5. Once the load is over and every worker answers again, the KV blocks in use of every worker
   (``tandem:kv_blocks_in_use``, leases included) must return to zero.

    python bench/chaos.py [--requests 1000] [--concurrency 16] [--disconnect 0.3] [--seed 0]

Prints one table. Needs an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

logger = logging.getLogger("chaos")

PORTS = ["--gateway-port", "8600", "--gateway-metrics-port", "9702",
         "--tokenizer-port", "50651", "--tokenizer-metrics-port", "9701",
         "--prefill-port", "50661", "--prefill-metrics-port", "9711", "--decode-port", "50671",
         "--decode-metrics-port", "9721"]  # fmt: skip
GATEWAY = "http://127.0.0.1:8600"
WORKER_METRICS = {"prefill-0": 9711, "decode-0": 9721, "decode-1": 9722}
TOPICS = ["the sea", "a dragon", "Paris", "prime numbers", "a KV cache", "pancakes", "the moon",
          "a lighthouse", "rain", "a library"]  # fmt: skip


async def one_request(
    session: aiohttp.ClientSession, i: int, rng: random.Random, leave_after: int | None,
    timeout: float,
) -> str:
    body = {"model": "SmolLM2-135M-Instruct", "stream": True, "temperature": 0,
            "max_tokens": rng.randint(8, 48),
            "messages": [{"role": "user", "content": f"Request {i}: write about {rng.choice(TOPICS)}."}]}  # fmt: skip
    chunks, finished = 0, False
    try:
        async with session.post(GATEWAY + "/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(sock_read=timeout)) as resp:  # fmt: skip
            if resp.status != 200:
                await resp.read()
                return "error"
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    return "complete" if finished else "lost"
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "error"
                for choice in event.get("choices", []):
                    finished = finished or bool(choice.get("finish_reason"))
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    resp.close()  # the client goes away mid-stream
                    return "disconnected"
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return "lost"
    return "lost"  # the stream ended without [DONE]


async def metric(session: aiohttp.ClientSession, port: int, name: str) -> float | None:
    try:
        async with session.get(f"http://127.0.0.1:{port}/metrics",
                               timeout=aiohttp.ClientTimeout(total=5)) as resp:  # fmt: skip
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def pid_of(name: str) -> int:
    out = subprocess.check_output(["pgrep", "-f", "--", f"--worker-id {name} "]).split()
    return int(out[0])


async def run(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    plan = [(i, random.Random(args.seed * 7919 + i),
             rng.randint(1, 6) if rng.random() < args.disconnect else None)
            for i in range(args.requests)]  # fmt: skip
    outcomes: collections.Counter[str] = collections.Counter()
    done = 0
    kills: list[str] = []
    queue: asyncio.Queue[tuple[int, random.Random, int | None]] = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            nonlocal done
            while not queue.empty():
                i, r, leave = queue.get_nowait()
                outcomes[await one_request(session, i, r, leave, args.timeout)] += 1
                done += 1

        async def killer() -> None:
            for fraction, target in ((1 / 3, "prefill"), (2 / 3, "decode")):
                while done < fraction * args.requests:
                    await asyncio.sleep(0.05)
                if target == "prefill":
                    name = "prefill-0"
                else:  # the decode worker with the most running requests
                    running = {n: await metric(session, WORKER_METRICS[n],
                                               "tandem:num_requests_running") or 0.0
                               for n in ("decode-0", "decode-1")}  # fmt: skip
                    name = max(running, key=running.__getitem__)
                os.kill(pid_of(name), signal.SIGKILL)
                kills.append(f"{name} at request {done}")
                logger.info("SIGKILL %s after %d requests", name, done)

        await asyncio.gather(killer(), *(client() for _ in range(args.concurrency)))
        elapsed = time.monotonic() - started
        # Wait for the restarted workers, then for every worker's KV to return to idle.
        deadline = time.monotonic() + 180
        leaked: dict[str, float | None] = {}
        while time.monotonic() < deadline:
            leaked = {n: await metric(session, port, "tandem:kv_blocks_in_use")
                      for n, port in WORKER_METRICS.items()}  # fmt: skip
            if all(v == 0 for v in leaked.values()):
                break
            await asyncio.sleep(1)
        migrations = await metric(session, 9702, "tandem:migrations_total")  # gateway metrics
    return {"outcomes": outcomes, "kills": kills, "elapsed": elapsed, "leaked": leaked,
            "migrations": migrations}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--disconnect", type=float, default=0.3)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="longest silence of a stream before it counts as lost")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, default=Path("chaos-tandem-up.log"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    tandem = Path(sys.executable).with_name("tandem")
    with args.log.open("w") as log:
        up = subprocess.Popen(
            [str(tandem), "up", "--prefill", "1", "--decode", "2", *PORTS,
             "--gateway-args", "--remote-prefill-min-tokens 0"],
            stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            assert up.stdout is not None
            for line in up.stdout:
                if line.strip() == "ready":
                    break
            else:
                raise RuntimeError(f"tandem up exited; see {args.log}")
            result = asyncio.run(run(args))
        finally:
            os.killpg(up.pid, signal.SIGINT)
            up.wait(timeout=60)
    outcomes = result["outcomes"]
    assert isinstance(outcomes, collections.Counter)
    print(f"\n{args.requests} requests, concurrency {args.concurrency}, {args.disconnect:.0%} of "
          f"clients leaving mid-stream, {result['elapsed']:.0f} s; killed: "
          f"{', '.join(result['kills'])}; migrations: {result['migrations']}\n")  # type: ignore[arg-type]
    print("| complete | explicit error | disconnected (on purpose) | lost without an answer | "
          "KV blocks in use after (per worker) |")
    print("|---|---|---|---|---|")
    leaked = ", ".join(f"{n} {v:g}" if v is not None else f"{n} ?"
                       for n, v in result["leaked"].items())  # type: ignore[union-attr]
    print(f"| {outcomes['complete']} | {outcomes['error']} | {outcomes['disconnected']} | "
          f"{outcomes['lost']} | {leaked} |")
    return 0 if outcomes["lost"] == 0 and all(
        v == 0 for v in result["leaked"].values()) else 1  # type: ignore[union-attr]


if __name__ == "__main__":
    sys.exit(main())
