"""API-key auth, the per-key token-bucket rate limiter (fake clock, exact retry_after) and the
global admission limiter."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    TandemError,
)
from services.gateway.auth import ANONYMOUS, ApiKeyAuth, AuthenticationError, key_id
from services.gateway.rate_limit import (
    AdmissionLimiter,
    RateLimiter,
    RateLimitError,
    TokenBucket,
)


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --------------------------------------------------------------------------- auth


def test_auth_disabled_without_keys() -> None:
    auth = ApiKeyAuth.from_sources(None, None)
    assert not auth.enabled
    assert auth.check(None) == ANONYMOUS
    assert auth.check("Bearer whatever") == ANONYMOUS
    assert not ApiKeyAuth.from_sources(None, " , ").enabled


def test_auth_keys_from_file_and_env(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("# keys\nsk-file-key-0001\n\n  sk-file-key-0002  \n", encoding="utf-8")
    auth = ApiKeyAuth.from_sources(keys_file, "sk-env-key-0003, sk-env-key-0004,")
    assert auth.enabled
    for key in ("sk-file-key-0001", "sk-file-key-0002", "sk-env-key-0003", "sk-env-key-0004"):
        assert auth.check(f"Bearer {key}") == key_id(key)
    assert auth.check("bearer   sk-env-key-0003 ") == key_id("sk-env-key-0003")
    assert key_id("sk-env-key-0003").startswith("key-")
    assert "sk-env" not in key_id("sk-env-key-0003")
    assert key_id("a") != key_id("b")


@pytest.mark.parametrize(
    "header", [None, "", "Bearer", "Bearer   ", "Basic abc", "sk-env-key-0003"]
)
def test_auth_missing_key(header: str | None) -> None:
    auth = ApiKeyAuth.from_sources(None, "sk-env-key-0003")
    with pytest.raises(AuthenticationError) as info:
        auth.check(header)
    err = info.value
    assert isinstance(err, TandemError)
    assert err.http_status == 401 and err.error_type == "invalid_request_error"
    assert err.message.startswith("You didn't provide an API key.")
    assert err.to_openai()["error"]["code"] is None


def test_auth_wrong_key_is_never_quoted() -> None:
    auth = ApiKeyAuth.from_sources(None, "sk-right-key-000000")
    with pytest.raises(AuthenticationError) as info:
        auth.check("Bearer sk-wrong-key-123456789")
    err = info.value
    assert err.code == "invalid_api_key" and err.http_status == 401
    assert err.message == "Incorrect API key provided."  # no fragment of it: messages are logged
    assert "6789" not in err.message and "sk-" not in err.message
    with pytest.raises(AuthenticationError) as info:
        auth.check("Bearer short")
    assert "short" not in info.value.message


def test_auth_bad_keys_file(tmp_path: Path) -> None:
    with pytest.raises(FailedPreconditionError):
        ApiKeyAuth.from_sources(tmp_path / "missing.txt", None)
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing here\n\n", encoding="utf-8")
    with pytest.raises(FailedPreconditionError):
        ApiKeyAuth.from_sources(empty, "sk-env")


# --------------------------------------------------------------------------- token bucket


def test_token_bucket_exact_refill() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=2.0, burst=3, clock=clock)
    assert [bucket.try_take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.try_take() == 0.5  # one token at 2/s
    clock.advance(0.25)
    assert bucket.try_take() == 0.25  # half a token there, half to go
    clock.advance(0.25)
    assert bucket.try_take() == 0.0
    clock.advance(100)
    assert bucket.tokens == 3  # never above burst
    assert bucket.try_take(cost=3) == 0.0
    assert bucket.try_take(cost=2) == 1.0


def test_token_bucket_validates() -> None:
    with pytest.raises(InvalidArgumentError):
        TokenBucket(0, 1)
    with pytest.raises(InvalidArgumentError):
        TokenBucket(1, 0.5)


# --------------------------------------------------------------------------- rate limiter


def test_rate_limiter_per_key_with_exact_retry_after() -> None:
    clock = FakeClock()
    limiter = RateLimiter(requests_per_minute=60, burst=2, clock=clock)  # 1 request/s
    limiter.acquire("key-a")
    limiter.acquire("key-a")
    with pytest.raises(RateLimitError) as info:
        limiter.acquire("key-a")
    err = info.value
    assert err.retry_after == 1.0
    assert isinstance(err, ResourceExhaustedError)
    assert (err.http_status, err.code) == (429, "rate_limit_exceeded")
    assert err.error_type == "rate_limit_error"
    limiter.acquire("key-b")  # another key has its own bucket
    clock.advance(0.25)
    with pytest.raises(RateLimitError) as info:
        limiter.acquire("key-a")
    assert info.value.retry_after == 0.75  # a refused request takes nothing
    clock.advance(0.75)
    limiter.acquire("key-a")
    with pytest.raises(RateLimitError):
        limiter.acquire("key-a")


def test_rate_limiter_forgets_refilled_buckets() -> None:
    clock = FakeClock()
    limiter = RateLimiter(requests_per_minute=600, burst=1, clock=clock)
    for i in range(1000):
        limiter.acquire(f"k{i}")
    assert len(limiter) == 1000
    clock.advance(1.0)  # every bucket is full again
    for _ in range(24):
        limiter.acquire("hot")
        clock.advance(0.1)
    assert len(limiter) <= 2


def test_rate_limiter_validates() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        RateLimiter(requests_per_minute=0, burst=1)
    assert info.value.param == "requests_per_minute"
    with pytest.raises(InvalidArgumentError):
        RateLimiter(requests_per_minute=10, burst=0)


# --------------------------------------------------------------------------- admission


async def test_admission_limiter() -> None:
    limiter = AdmissionLimiter(max_in_flight=2)
    first = limiter.try_acquire()
    async with limiter.try_acquire():
        assert limiter.in_flight == 2
        with pytest.raises(RateLimitError) as info:
            limiter.try_acquire()
        assert info.value.retry_after == 1 and info.value.http_status == 429
        assert limiter.in_flight == 2  # a refusal does not queue or count
    assert limiter.in_flight == 1
    first.release()
    first.release()  # idempotent
    assert limiter.in_flight == 0
    with limiter.try_acquire():
        assert limiter.in_flight == 1
    assert limiter.in_flight == 0


async def test_admission_slot_released_on_error() -> None:
    limiter = AdmissionLimiter(max_in_flight=1)
    with pytest.raises(ValueError):
        async with limiter.try_acquire():
            raise ValueError("boom")
    assert limiter.in_flight == 0
    with pytest.raises(InvalidArgumentError):
        AdmissionLimiter(0)
