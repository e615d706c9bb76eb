"""A stream's inter-token latency while long prompts arrive beside it, against a running server.

    python bench/itl_under_prefill.py [--url http://127.0.0.1:8000] [--long 3] [--words 3000]
                                      [--stream-tokens 600] [--gap 2.0] [--rounds 2]

Each round streams one completion (a short prompt, ``--stream-tokens`` greedy tokens) and, a
second after it starts, sends ``--long`` prompts of ``--words`` random words (about that many
tokens on SmolLM2's vocabulary; fresh words each round, so no prefix cache helps), ``--gap``
seconds apart, each asking for 4 tokens. The first row is the same stream with nothing beside it,
the baseline of the same run. Printed per round: the stream's ITL p50 / p90 / p99 / max and the
long prompts' end-to-end seconds.

What it shows is how a server shares the machine between a running decode and prompts being
prefilled (``tandem up``'s workers on shared cores: ``services/common/core_share.py``; chunked
prefill on the decode worker when the prefill queue is full: ``gateway/prefill_policy.py``). Run
it against each server (or each checkout) in turn, on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time

import aiohttp

logger = logging.getLogger("bench.itl_under_prefill")

WORDS = ("alpha beta gamma delta river stone cloud paper metal light shadow garden window "
         "music").split()  # fmt: skip


async def _model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as resp:
        return (await resp.json())["data"][0]["id"]


async def _stream(session: aiohttp.ClientSession, url: str, model: str, tokens: int) -> list[float]:
    """Arrival times of the stream's chunks."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    times: list[float] = []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"stream: HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: ") and b"[DONE]" not in line:
                times.append(time.perf_counter())
    return times


async def _long(session: aiohttp.ClientSession, url: str, model: str, words: int,
                seed: int) -> float:  # fmt: skip
    """Seconds one long prompt took, end to end."""
    rng = random.Random(seed)
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    start = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"long prompt: HTTP {resp.status}: {text}")
    return time.perf_counter() - start


async def _round(session: aiohttp.ClientSession, args: argparse.Namespace, model: str,
                 n_long: int, seed: int) -> tuple[list[float], list[float]]:  # fmt: skip
    stream = asyncio.create_task(_stream(session, args.url, model, args.stream_tokens))
    await asyncio.sleep(1.0)
    longs = []
    for i in range(n_long):
        longs.append(asyncio.create_task(_long(session, args.url, model, args.words, seed + i)))
        await asyncio.sleep(args.gap)
    seconds = list(await asyncio.gather(*longs))
    times = await stream
    gaps = sorted((b - a) * 1000 for a, b in zip(times, times[1:], strict=False))
    return gaps, seconds


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def main_async(args: argparse.Namespace) -> None:
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        model = await _model(session, args.url)
        await _stream(session, args.url, model, 8)  # warm-up
        logger.info("| round | long prompts | ITL p50 ms | p90 | p99 | max | "
                    "long prompts' seconds |")
        logger.info("|---|---|---|---|---|---|---|")
        rounds = [("alone", 0)] + [(str(r + 1), args.long) for r in range(args.rounds)]
        for name, n_long in rounds:
            seed = int(time.time() * 1000)
            gaps, seconds = await _round(session, args, model, n_long, seed)
            logger.info("| %s | %d x %d words | %.1f | %.1f | %.1f | %.1f | %s |", name, n_long,
                        args.words, _quantile(gaps, 0.5), _quantile(gaps, 0.9),
                        _quantile(gaps, 0.99), gaps[-1],
                        " / ".join(f"{s:.1f}" for s in seconds) or "-")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--long", type=int, default=3, help="long prompts a round")
    parser.add_argument("--words", type=int, default=3000, help="words a long prompt")
    parser.add_argument("--stream-tokens", type=int, default=600)
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between long prompts")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
