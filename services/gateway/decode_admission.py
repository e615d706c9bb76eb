"""Decode admission: reserve a decode worker's KV room before a remote prefill starts ("reserve
before compute", docs/kv-handoff.md), so no prefill work is thrown away for lack of decode memory.

A prompt prefilled on a prefill worker ships its KV to one decode worker; if that worker has no
room when the KV arrives, the prefill was wasted. So a choice first asks for room
(``Decode.Reserve``), and :meth:`DecodeAdmission.admit` returns the worker that granted it:

1. Ask the preferred decode worker (the router's pick), then every other healthy one, best
   first (``Router.ranked``), for room for this prompt under this ``cache_salt`` (the
   reservation carries their digest, ``prefix_hash.reservation_digest``: the worker then takes
   KV under the request id for that prompt and salt only, so a sender cannot bring another). The first that grants is where the choice runs; its reservation is
   then the choice's (the KV header takes it over; the choice's Abort frees it on every other
   exit).
2. A refusal (RESOURCE_EXHAUSTED: no room, nothing reserved) moves on to the next worker. A
   worker that fails otherwise (unreachable, a deadline, a server error) is skipped for the rest
   of this admission, marked down when unreachable, and sent an Abort in case it granted before
   the failure surfaced. Bad input (INVALID_ARGUMENT) fails the request at once.
3. When every worker refused, the request waits in this admission queue: it asks again after
   50 ms, doubling up to 1 s between rounds, for at most ``timeout_s``
   (``--decode-admission-timeout``), then fails with 503 ``decode_capacity``
   (:class:`DecodeCapacityError`). Requests that had to wait count in
   ``tandem:decode_admission_waits_total``, those answered ``decode_capacity`` in
   ``tandem:decode_admission_timeouts_total``.
4. Cancellation (the client went away) at any point leaves nothing reserved: a Reserve call cut
   short is followed by an Abort to its worker, in a task that outlives the cancellation.

A worker that predates ``Reserve`` (UNIMPLEMENTED) is admitted without a reservation: its KV is
placed when it arrives, as before. Local prefill (the decode worker prefills the prompt itself)
needs no admission: that worker's scheduler waits for blocks without wasting any work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass

from services.common.errors import (
    InvalidArgumentError,
    ResourceExhaustedError,
    TandemError,
    UnavailableError,
)
from services.gateway.config import DEFAULT_DECODE_ADMISSION_TIMEOUT_S
from services.gateway.router import PromptKeys, Router, WorkerState
from services.gateway.worker_errors import WorkerDown, worker_error

logger = logging.getLogger(__name__)

DECODE_CAPACITY_CODE = "decode_capacity"
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0


class DecodeCapacityError(UnavailableError):
    """No decode worker had room for the request's KV in time (HTTP 503, code
    ``decode_capacity``, with ``Retry-After``)."""

    def __init__(self, message: str, *, retry_after: float = MAX_BACKOFF_S) -> None:
        super().__init__(message, code=DECODE_CAPACITY_CODE)
        self.retry_after = retry_after


def _nothing() -> None:
    pass


@dataclass(frozen=True, slots=True)
class _Ask:
    """One reservation request: its id, its prompt's length and the prompt and salt's digest."""

    request_id: str
    num_tokens: int
    prompt_digest: bytes


@dataclass(frozen=True, slots=True)
class DecodeAdmission:
    """Where a remote-prefill choice reserves its decode room (see the module lifecycle).

    Attributes:
        router: the decode pool, best first.
        spawn: runs a coroutine to completion even if the caller is cancelled (the Aborts).
        timeout_s: longest wait for room when every worker refused (0: fail at once).
        count_wait / count_timeout: the admission metrics.
        first_backoff_s / max_backoff_s: the pause between rounds, doubling.
    """

    router: Router
    spawn: Callable[[Coroutine[object, object, object]], None]
    timeout_s: float = DEFAULT_DECODE_ADMISSION_TIMEOUT_S
    count_wait: Callable[[], None] = _nothing
    count_timeout: Callable[[], None] = _nothing
    first_backoff_s: float = FIRST_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S

    async def admit(
        self,
        request_id: str,
        num_tokens: int,
        preferred: WorkerState,
        *,
        prompt_digest: bytes,
        prefill: WorkerState | None = None,
        prompt: PromptKeys | None = None,
    ) -> WorkerState:
        """The decode worker that reserved room for ``num_tokens`` prompt tokens' KV under
        ``request_id``, ``preferred`` first; the caller owns the reservation from here.
        ``prompt_digest`` binds it to the prompt and its ``cache_salt``
        (``prefix_hash.reservation_digest``).

        ``prefill``, the worker that will compute the prompt, counts the request as in flight
        meanwhile (a router lease), so a burst that chose at once still spreads over the pool.
        ``prompt`` ranks the other workers by its cached prefix too (``Router.ranked``).

        Raises:
            DecodeCapacityError: every worker refused for ``timeout_s`` (503 ``decode_capacity``).
            UnavailableError: no healthy decode worker is left to ask.
            InvalidArgumentError: the worker refused the request itself (nothing reserved).
        """
        ask = _Ask(request_id, num_tokens, prompt_digest)
        if prefill is None:
            return await self._admit(ask, preferred, prompt)
        with self.router.lease(prefill):
            return await self._admit(ask, preferred, prompt)

    async def _admit(
        self, ask: _Ask, preferred: WorkerState, prompt: PromptKeys | None
    ) -> WorkerState:
        request_id, num_tokens = ask.request_id, ask.num_tokens
        deadline = time.monotonic() + self.timeout_s
        backoff = self.first_backoff_s
        skipped: set[str] = set()
        waited = False
        while True:
            asked = False
            for worker in self._candidates(preferred, skipped, prompt):
                asked = True
                if await self._reserve(worker, ask, skipped):
                    return worker
            if not asked:
                raise UnavailableError(
                    "no healthy decode worker is available to reserve KV room; please retry "
                    "shortly", code="no_healthy_workers",
                )  # fmt: skip
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.count_timeout()
                raise DecodeCapacityError(
                    f"no decode worker has room for this request's KV ({num_tokens} prompt "
                    f"tokens; waited {self.timeout_s:g}s); please retry shortly"
                )
            if not waited:
                waited = True
                self.count_wait()
                logger.info("every decode worker is full; waiting for room",
                            extra={"request_id": request_id})  # fmt: skip
            await asyncio.sleep(min(backoff, remaining))
            backoff = min(backoff * 2, self.max_backoff_s)

    def _candidates(
        self, preferred: WorkerState, skipped: set[str], prompt: PromptKeys | None
    ) -> Iterator[WorkerState]:
        """``preferred``, then the others best first (ranked only once it refused)."""
        if preferred.healthy and preferred.address not in skipped:
            yield preferred
        yield from self.router.ranked("decode", exclude={preferred.address, *skipped},
                                      prompt=prompt)  # fmt: skip

    async def _reserve(self, worker: WorkerState, ask: _Ask, skipped: set[str]) -> bool:
        """Ask one worker; True when it granted (or predates Reserve). The ask counts as one of
        the gateway's requests on the worker (a router lease), so a burst that picks at once
        still spreads: the caller leases the worker that granted right after, with no pause."""
        request_id = ask.request_id
        try:
            with self.router.lease(worker):
                await worker.client.reserve(request_id, ask.num_tokens,
                                            prompt_digest=ask.prompt_digest)  # fmt: skip
        except ResourceExhaustedError:
            return False  # no room: nothing was reserved
        except InvalidArgumentError:
            raise  # the request's own fault: nothing was reserved
        except TandemError as err:
            skipped.add(worker.address)
            self.spawn(worker.client.abort(request_id, "gateway: reservation failed"))
            if isinstance(worker_error(err, worker), WorkerDown):
                self.router.mark_down(worker, err)
            logger.warning("decode reservation failed; trying another worker",
                           extra={"request_id": request_id, "worker": worker.address,
                                  "error": err.message})  # fmt: skip
            return False
        except BaseException:  # cancelled mid-call: the worker may have granted already
            self.spawn(worker.client.abort(request_id, "gateway: request ended while reserving"))
            raise
        return True
