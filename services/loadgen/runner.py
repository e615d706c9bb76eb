"""Runs one load level against one server and times it.

- Concurrency level C: C workers, each sending its next request as soon as its previous one
  finished, until the level's requests are used up; at most C are in flight at any time.
- Rate level R: request i is sent at the i-th arrival time of a seeded Poisson process of rate R
  (``arrivals.py``) whether or not earlier ones finished; ``max_concurrency`` (when given) holds
  a request back until fewer than that many are in flight, as vLLM's ``--max-concurrency``.

The level's duration runs from its first send to its last request's end, failures included;
throughputs divide by it. A tqdm bar on stderr counts finished requests.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import nullcontext
from dataclasses import replace

from tqdm import tqdm

from services.loadgen.arrivals import poisson_arrivals
from services.loadgen.record import RequestRecord
from services.loadgen.results import Level
from services.loadgen.workload import RequestSpec

Send = Callable[[RequestSpec], Awaitable[RequestRecord]]


async def run_level(
    send: Send,
    specs: Sequence[RequestSpec],
    level: Level,
    *,
    seed: int = 0,
    max_concurrency: int | None = None,
    progress: bool = True,
    description: str = "",
) -> tuple[float, list[RequestRecord]]:
    """``(duration in seconds, records in send order)``; ``send`` stamps ``sent_s`` with the
    absolute ``perf_counter`` and this makes it relative to the level's start."""
    records: list[RequestRecord | None] = [None] * len(specs)
    bar = tqdm(total=len(specs), desc=description or level.label, file=sys.stderr,
               disable=not progress, leave=False, unit="req")  # fmt: skip
    start = time.perf_counter()

    async def one(index: int) -> None:
        record = await send(specs[index])
        records[index] = replace(record, index=index, sent_s=record.sent_s - start)
        bar.update(1)

    try:
        if level.kind == "concurrency":
            await _closed_loop(one, len(specs), int(level.value))
        else:
            offsets = poisson_arrivals(level.value, len(specs), seed)
            await _open_loop(one, offsets, start, max_concurrency)
    finally:
        bar.close()
    duration = time.perf_counter() - start
    return duration, [r for r in records if r is not None]


async def _closed_loop(one: Callable[[int], Awaitable[None]], count: int, workers: int) -> None:
    indices = iter(range(count))

    async def worker() -> None:
        for index in indices:  # shared: each index is taken by exactly one worker
            await one(index)

    await asyncio.gather(*(worker() for _ in range(max(1, min(workers, count)))))


async def _open_loop(
    one: Callable[[int], Awaitable[None]],
    offsets: Sequence[float],
    start: float,
    max_concurrency: int | None,
) -> None:
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(index: int) -> None:
        async with limit if limit is not None else nullcontext():
            await one(index)

    tasks = []
    for index, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0 and not math.isinf(delay):
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(index)))
    await asyncio.gather(*tasks)
