"""Per-client rate limiting and global admission control for the gateway (docs/request-lifecycle.md step 1, docs/errors.md).

Both refuse instead of queueing: an over-limit request gets HTTP 429 with ``Retry-After`` before
any work is started.

1. :class:`TokenBucket` — ``rate_per_s`` tokens refill continuously up to ``burst``; a request
   takes ``cost`` of them. The clock is injectable so tests can step time exactly.
2. :class:`RateLimiter` — one bucket per client (an API key's id, or ``ip:<address>`` for an
   anonymous client), ``per minute`` sustained and ``burst`` at once, counting ``unit``:
   requests (cost 1 each) or model tokens (the gateway charges prompt tokens plus
   ``max_tokens`` at admission and :meth:`RateLimiter.refund` gives back what was not
   generated). ``acquire(key, cost)`` returns or raises :class:`RateLimitError` whose
   ``retry_after`` is the exact time until the bucket holds ``cost`` again. Idle buckets that
   have refilled are dropped, so memory stays bounded by the clients active within one refill
   period.
3. :class:`AdmissionLimiter` — at most ``max_in_flight`` requests in the whole gateway;
   ``try_acquire()`` returns an :class:`AdmissionSlot` (release it, or use it as a context
   manager) or raises RateLimitError(retry_after=1).

Everything runs on the gateway's single event loop, so no locks are needed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from services.common.errors import InvalidArgumentError, ResourceExhaustedError
from services.gateway.release_once import ReleaseOnce

logger = logging.getLogger(__name__)

Clock = Callable[[], float]

_SWEEP_EVERY = 1024
_EPSILON = 1e-9


class RateLimitError(ResourceExhaustedError):
    """HTTP 429 with a ``Retry-After`` of ``retry_after`` seconds (rounded up in the header)."""

    def __init__(
        self,
        message: str,
        *,
        retry_after: float,
        param: str | None = None,
        code: str | None = "rate_limit_exceeded",
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.retry_after = retry_after


class TokenBucket:
    """A continuously refilling bucket of at most ``burst`` tokens."""

    def __init__(self, rate_per_s: float, burst: float, *, clock: Clock = time.monotonic) -> None:
        if not rate_per_s > 0 or not math.isfinite(rate_per_s):
            raise InvalidArgumentError("rate must be a positive number", param="rate_per_s")
        if not burst >= 1 or not math.isfinite(burst):
            raise InvalidArgumentError("burst must be at least 1", param="burst")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._stamp = clock()

    @property
    def tokens(self) -> float:
        """Tokens available now."""
        self._refill()
        return self._tokens

    def try_take(self, cost: float = 1.0) -> float:
        """Take ``cost`` tokens if available and return 0.0; otherwise take nothing and return
        the seconds until ``cost`` tokens will be available."""
        self._refill()
        if self._tokens + _EPSILON >= cost:  # tolerate float drift from many small refills
            self._tokens = max(0.0, self._tokens - cost)
            return 0.0
        return (cost - self._tokens) / self.rate_per_s

    def give(self, amount: float) -> None:
        """Put ``amount`` back (never above ``burst``)."""
        self._refill()
        self._tokens = min(self.burst, self._tokens + max(0.0, amount))

    def is_full(self) -> bool:
        return self.tokens >= self.burst

    def _refill(self) -> None:
        now = self._clock()
        elapsed = now - self._stamp
        if elapsed > 0:
            self._tokens = min(self.burst, self._tokens + elapsed * self.rate_per_s)
        self._stamp = now


class RateLimiter:
    """A token bucket per key: ``requests_per_minute`` units sustained, ``burst`` at once.

    ``unit`` names what is counted in messages ("requests", "tokens"); the parameter keeps its
    historical name whatever the unit.
    """

    def __init__(
        self,
        requests_per_minute: float,
        burst: float,
        *,
        unit: str = "requests",
        clock: Clock = time.monotonic,
    ) -> None:
        if not requests_per_minute > 0 or not math.isfinite(requests_per_minute):
            raise InvalidArgumentError(
                "requests_per_minute must be a positive number", param="requests_per_minute"
            )
        if not burst >= 1 or not math.isfinite(burst):
            raise InvalidArgumentError("burst must be at least 1", param="burst")
        self.requests_per_minute = requests_per_minute
        self.burst = burst
        self.unit = unit
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._calls = 0

    def acquire(self, key: str, cost: float = 1.0) -> None:
        """Count ``cost`` units for ``key``; raise RateLimitError when its bucket lacks them
        (taking nothing), or when ``cost`` exceeds ``burst`` (no wait would help)."""
        self._calls += 1
        if self._calls % _SWEEP_EVERY == 0:
            self._sweep()
        if cost > self.burst + _EPSILON:
            raise RateLimitError(
                f"Request too large: it needs {cost:g} {self.unit} and the limit is "
                f"{self.burst:g} {self.unit} at once ({self.requests_per_minute:g} per minute). "
                "Ask for fewer max_tokens or send a shorter prompt.",
                retry_after=60.0,
                code="request_too_large",
            )
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = TokenBucket(self.requests_per_minute / 60.0, self.burst, clock=self._clock)
            self._buckets[key] = bucket
        wait = bucket.try_take(cost)
        if wait > 0:
            raise RateLimitError(
                f"Rate limit reached: {self.requests_per_minute:g} {self.unit} per minute. "
                f"Please try again in {wait:.3g}s.",
                retry_after=wait,
            )

    def refund(self, key: str, amount: float) -> None:
        """Give ``amount`` units back to ``key`` (a charge that turned out too high)."""
        bucket = self._buckets.get(key)
        if bucket is not None and amount > 0:
            bucket.give(amount)

    def __len__(self) -> int:
        return len(self._buckets)

    def _sweep(self) -> None:
        """Forget buckets that have refilled: a new bucket would be identical."""
        full = [key for key, bucket in self._buckets.items() if bucket.is_full()]
        for key in full:
            del self._buckets[key]


class AdmissionSlot(ReleaseOnce):
    """One admitted request; ``release()`` is idempotent. Also a (async) context manager."""

    __slots__ = ("_limiter", "_client")

    def __init__(self, limiter: AdmissionLimiter, client: str) -> None:
        super().__init__()
        self._limiter = limiter
        self._client = client

    def _give_back(self) -> None:
        self._limiter._release(self._client)


class AdmissionLimiter:
    """At most ``max_in_flight`` requests at once in the gateway, and at most ``per_client`` of
    them from one client (an API key, or one address without keys), so one client's flood of
    slow streams cannot take every slot from the others; no queue."""

    RETRY_AFTER_S = 1.0

    def __init__(self, max_in_flight: int, per_client: int | None = None) -> None:
        if max_in_flight < 1:
            raise InvalidArgumentError("max_in_flight must be at least 1", param="max_in_flight")
        if per_client is not None and per_client < 1:
            raise InvalidArgumentError("the per-client in-flight cap must be at least 1",
                                       param="max_in_flight_per_client")  # fmt: skip
        self.max_in_flight = max_in_flight
        self.per_client = per_client
        self._in_flight = 0
        self._by_client: dict[str, int] = {}

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def try_acquire(self, client: str = "") -> AdmissionSlot:
        """Admit one request of ``client`` or raise RateLimitError (429, Retry-After: 1)."""
        held = self._by_client.get(client, 0)
        if self.per_client is not None and held >= self.per_client:
            raise RateLimitError(
                f"This client already has {held} requests in flight, the most one client may "
                "have at once. Please retry when one has finished.",
                retry_after=self.RETRY_AFTER_S,
                code="client_concurrency",
            )
        if self._in_flight >= self.max_in_flight:
            raise RateLimitError(
                f"The server is at capacity ({self.max_in_flight} requests in flight). "
                "Please retry shortly.",
                retry_after=self.RETRY_AFTER_S,
                code="server_overloaded",
            )
        self._in_flight += 1
        self._by_client[client] = held + 1
        return AdmissionSlot(self, client)

    def _release(self, client: str) -> None:
        self._in_flight -= 1
        left = self._by_client.get(client, 1) - 1
        if left > 0:
            self._by_client[client] = left
        else:
            self._by_client.pop(client, None)
