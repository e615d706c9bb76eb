"""What a flood of distinct large JSON schemas does to a concurrent client's inter-token latency.

    tandem up &                                   # or any running gateway
    python bench/grammar_flood.py --url http://127.0.0.1:8000 [--api-key KEY] \\
        [--schemas 500] [--schema-kib 200] [--flood-concurrency 16] [--tokens 64] [--rounds 3] \\
        [--duration SECONDS]

Issue 47's bar: 500 distinct 200 KiB schemas must not raise a concurrent client's ITL p50 by more
than 20%. Each round streams plain chat completions (``--tokens`` tokens, ``ignore_eos``) back to
back alone for ``--alone-seconds`` (the baseline: one stream's 63 gaps moved its median by 10%
between runs), then again while ``--schemas`` requests, each with its own schema of about
``--schema-kib`` KiB, are sent ``--flood-concurrency`` at a time (each with ``max_tokens`` 1:
the point is their compilation, which the gateway does in its grammar worker pool, and the
workers' matcher build for the ones that get that far). Prints one row per phase: ITL p50/p95
(ms) of the plain stream, its time to first token, and how the flood's requests were answered
(status codes: 400 ``grammar_too_complex`` is the time budget at work).

While the flood runs, plain completions are streamed one after another until the last flood
request is answered, and every gap between their tokens counts: the flood reaches the workers
only as the gateway's pool compiles it, so one short stream would end before most of it lands.
The request bodies are built (and serialized) before the round starts, so that building them
does not stall this client's own event loop and show up as latency. ``--api-key`` defaults to
``TANDEM_API_KEY`` (what ``tandem up`` / compose print once).

``--duration S`` ends a round's flood after S seconds: requests not yet answered are cancelled
and counted as ``cancelled`` (a 500-schema flood of 200 KiB schemas takes hours to compile on a
2-core machine at a lower CPU priority, while its effect on the plain stream is the same from
its first minute: at most ``--grammar-workers`` gateway processes and one compile thread per
worker ever run at once, however many schemas wait).

Heavy by design: on a shared machine run it with small numbers (``--schemas 16
--schema-kib 100``), and never as part of the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def schema(seed: int, kib: int) -> dict[str, Any]:
    """A distinct schema of about ``kib`` KiB: patterned string properties (~60 bytes each)."""
    fields = max(1, kib * 1024 // 62)
    return {"type": "object", "required": [f"s{seed}_0"], "properties": {
        f"s{seed}_{k}": {"type": "string", "pattern": f"^[a-z]{{{k % 7 + 1}}}[0-9]+{seed}$"}
        for k in range(fields)}}  # fmt: skip


async def stream_itl(session: Any, url: str, headers: dict[str, str], model: str,
                     tokens: int) -> tuple[float, list[float]]:  # fmt: skip
    """Time to first token and the gaps between tokens of one plain streamed completion."""
    body = {"model": model, "messages": [{"role": "user", "content": "Count slowly."}],
            "max_tokens": tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    started = time.perf_counter()
    arrivals: list[float] = []
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content"' in line:
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError("the plain stream produced no token")
    return arrivals[0] - started, [b - a for a, b in zip(arrivals, arrivals[1:])]


async def plain_streams(
    session: Any, args: argparse.Namespace, headers: dict[str, str], keep_going: Callable[[], bool]
) -> tuple[list[float], list[float], int]:
    """Plain streams one after another (at least one) while ``keep_going()``: their times to
    first token, every gap between their tokens, and how many ran."""
    ttfts: list[float] = []
    gaps: list[float] = []
    while keep_going() or not ttfts:
        ttft, more = await stream_itl(session, args.url, headers, args.model, args.tokens)
        ttfts.append(ttft)
        gaps.extend(more)
    return ttfts, gaps, len(ttfts)


def flood_bodies(model: str, count: int, kib: int, seed: int) -> list[bytes]:
    """The flood's request bodies, each with its own schema (serialized up front)."""
    return [json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 1, "response_format": {"type": "json_schema", "json_schema": {
                            "name": f"flood{i}", "schema": schema(seed * 100_000 + i, kib)}}},
                       ).encode() for i in range(count)]  # fmt: skip


async def flood(session: Any, url: str, headers: dict[str, str], bodies: list[bytes],
                concurrency: int) -> collections.Counter[str]:  # fmt: skip
    """Send ``bodies``, ``concurrency`` at a time; how they were answered."""
    answers: collections.Counter[str] = collections.Counter()
    gate = asyncio.Semaphore(concurrency)

    async def one(body: bytes) -> None:
        async with gate:
            async with session.post(url + "/v1/chat/completions", data=body,
                                    headers={**headers, "Content-Type": "application/json"}) as r:
                payload = await r.read()
                code = ""
                if r.status != 200:
                    try:
                        code = json.loads(payload)["error"].get("code") or ""
                    except (ValueError, KeyError, TypeError):
                        code = "?"
                answers[f"{r.status}{' ' + code if code else ''}"] += 1

    tasks = [asyncio.ensure_future(one(body)) for body in bodies]
    try:
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:  # --duration ran out: count what never got an answer
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        answers["cancelled"] = len(bodies) - sum(answers.values())
    return answers


async def run(args: argparse.Namespace) -> None:
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows: list[tuple[str, float, float, float, str]] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if args.model is None:  # the gateway's first served name
            async with session.get(args.url + "/v1/models", headers=headers) as resp:
                resp.raise_for_status()
                args.model = (await resp.json())["data"][0]["id"]
        for round_ in range(args.rounds):
            bodies = await asyncio.to_thread(flood_bodies, args.model, args.schemas,
                                             args.schema_kib, round_ + 1)  # fmt: skip
            calm_ends = time.monotonic() + args.alone_seconds
            ttfts, gaps, streams = await plain_streams(
                session, args, headers, lambda: time.monotonic() < calm_ends)
            rows.append((f"alone ({streams} streams)", statistics.median(ttfts),
                         *_p50_p95(gaps), ""))
            flooding = asyncio.create_task(flood(session, args.url, headers, bodies,
                                                 args.flood_concurrency))  # fmt: skip
            await asyncio.sleep(0.5)  # the flood is compiling
            ends = time.monotonic() + args.duration if args.duration else float("inf")
            ttfts, gaps, streams = await plain_streams(
                session, args, headers, lambda: not flooding.done() and time.monotonic() < ends)
            if not flooding.done():
                flooding.cancel()
            answers = await flooding
            del bodies
            rows.append((f"with flood ({streams} streams)", statistics.median(ttfts),
                         *_p50_p95(gaps),
                         ", ".join(f"{k}: {v}" for k, v in sorted(answers.items()))))
    _print(rows, args)


def _p50_p95(gaps: list[float]) -> tuple[float, float]:
    ordered = sorted(gaps) or [0.0]
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def _print(rows: list[tuple[str, float, float, float, str]], args: argparse.Namespace) -> None:
    print(f"\n{args.schemas} distinct ~{args.schema_kib} KiB schemas, {args.flood_concurrency} at "
          f"a time; plain stream of {args.tokens} tokens; {args.url}\n")
    print("| phase | TTFT (ms) | ITL p50 (ms) | ITL p95 (ms) | flood answers |")
    print("|---|---:|---:|---:|---|")
    for phase, ttft, p50, p95, answers in rows:
        print(f"| {phase} | {ttft * 1e3:.1f} | {p50 * 1e3:.2f} | {p95 * 1e3:.2f} | {answers} |")
    alone = [r[2] for r in rows if r[0].startswith("alone")]
    flooded = [r[2] for r in rows if r[0].startswith("with flood")]
    if alone and flooded:
        change = statistics.median(flooded) / statistics.median(alone) - 1
        print(f"\nITL p50, median over rounds: {statistics.median(alone) * 1e3:.2f} ms alone, "
              f"{statistics.median(flooded) * 1e3:.2f} ms with the flood ({change:+.0%})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                        help="default: env TANDEM_API_KEY")
    parser.add_argument("--model", default=None, help="default: the gateway's first model")
    parser.add_argument("--schemas", type=int, default=500)
    parser.add_argument("--schema-kib", type=int, default=200)
    parser.add_argument("--flood-concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--alone-seconds", type=float, default=15.0,
                        help="how long plain streams run back to back, alone, before each "
                        "round's flood: the baseline (default %(default)s)")
    parser.add_argument("--duration", type=float, default=None,
                        help="end each round's flood after this many seconds (default: when "
                        "every flood request is answered)")
    args = parser.parse_args()
    if min(args.schemas, args.schema_kib, args.flood_concurrency, args.tokens, args.rounds) < 1:
        parser.error("every count must be >= 1")
    if args.duration is not None and not args.duration > 0:
        parser.error("--duration must be positive")
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
