"""Served throughput: the whole stack (`tandem up`) under concurrent streaming chat requests, per
weight dtype, in one run.

For each ``--dtype`` it starts ``tandem up --dtype D`` on the default model (tokenizer, one
prefill and one decode worker, the gateway; all on this machine's cores), waits for ``ready``,
then for each concurrency level keeps that many streaming ``/v1/chat/completions`` requests in
flight (greedy, ``ignore_eos``, ``--max-tokens`` each) until ``--requests`` have finished, and
prints one markdown row: output tokens/s over the level's wall time, and TTFT / inter-token
latency medians seen by the client. A warm-up request runs first. Errors are counted, never
dropped. A small fixed-load probe per dtype; ``tandem bench serve`` (docs/loadgen.md) is the
load generator, and ``bench/serve_compare.py`` compares servers with it.

    python bench/served_throughput.py [--dtype float32 auto] [--concurrency 1 4] [--requests 8]
        [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

PROMPTS = [
    "What is the capital of France?",
    "List three prime numbers.",
    "Explain what a KV cache is in one paragraph.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "Write a Python function that reverses a string.",
    "Name the planets of the solar system.",
]


def start_stack(dtype: str, port: int) -> subprocess.Popen[str]:
    """``tandem up`` with this dtype; returns once it printed ``ready``."""
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.Popen(
        [str(tandem), "up", "--dtype", dtype, "--gateway-port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    raise RuntimeError(f"tandem up --dtype {dtype} exited before it was ready")


def stop_stack(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int
) -> tuple[float, list[float], int]:
    """(TTFT seconds, inter-token gaps, output tokens) of one streamed chat completion."""
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
        "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("no content streamed")
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - start, gaps, tokens


async def run_level(
    base: str, model: str, concurrency: int, requests: int, max_tokens: int
) -> dict[str, float]:
    url = f"{base}/v1/chat/completions"
    ttfts: list[float] = []
    gaps: list[float] = []
    tokens = errors = 0
    queue = list(range(requests))
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await one_request(session, url, model, PROMPTS[0], 8)  # warm-up

        async def worker() -> None:
            nonlocal tokens, errors
            while queue:
                i = queue.pop()
                try:
                    ttft, g, n = await one_request(
                        session, url, model, PROMPTS[i % len(PROMPTS)], max_tokens
                    )
                except (aiohttp.ClientError, RuntimeError, asyncio.TimeoutError):
                    errors += 1
                    continue
                ttfts.append(ttft)
                gaps.extend(g)
                tokens += n

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {
        "tok/s": tokens / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttfts) if ttfts else float("nan"),
        "itl_p50_ms": 1e3 * statistics.median(gaps) if gaps else float("nan"),
        "errors": errors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "auto"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    lines = [
        "| tandem up --dtype | concurrency | output tok/s | TTFT p50 ms | ITL p50 ms | errors |",
        "|---|---|---|---|---|---|",
    ]
    for dtype in args.dtype:
        proc = start_stack(dtype, args.port)
        try:
            model = asyncio.run(_model_name(base))
            for level in args.concurrency:
                r = asyncio.run(run_level(base, model, level, args.requests, args.max_tokens))
                lines.append(
                    f"| {dtype} | {level} | {r['tok/s']:.1f} | {r['ttft_p50_ms']:.0f} | "
                    f"{r['itl_p50_ms']:.1f} | {r['errors']} |"
                )
                print(f"measured {dtype} c={level}", file=sys.stderr, flush=True)
        finally:
            stop_stack(proc)
    lines.append(
        f"\n{args.requests} requests per level, {args.max_tokens} output tokens each (ignore_eos), "
        f"greedy; load average at end {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


async def _model_name(base: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{base}/v1/models") as response:
        return str((await response.json())["data"][0]["id"])


if __name__ == "__main__":
    sys.exit(main())
