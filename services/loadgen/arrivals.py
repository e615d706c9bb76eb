"""When each request of a rate level is sent: a Poisson process, seeded.

A level at ``--request-rate R`` sends its requests at the arrival times of a Poisson process of
rate R per second: gaps drawn independently from an exponential distribution with mean 1/R, the
first request at time 0 (as vLLM's benchmark does). ``R = inf`` sends every request at once.
The same seed gives the same times, so two servers compared in one run see the same schedule.
"""

from __future__ import annotations

import math
import random

from services.common.errors import InvalidArgumentError


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """Send offsets in seconds from the level start, non-decreasing, ``count`` of them."""
    if not rate > 0:
        raise InvalidArgumentError(f"a request rate must be positive (or inf), not {rate}")
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(count):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets
