"""The tokenizer replicas the gateway calls, and the retry that makes any one of them optional.

The tokenizer service is stateless (a request carries everything it needs), so any replica can
answer any call. ``--tokenizer`` entries follow DNS exactly as the worker pools do
(``membership.py``: a name stands for every address it resolves to, re-resolved), and this
pool keeps what the gateway knows of each replica:

1. its health, from a ``grpc.health.v1`` check of every replica every ``interval_s`` in the
   background (``/ready`` reads what the last check found, so one hung replica never holds up
   the gateway's readiness probe), and from the calls themselves (a failed call marks its
   replica down);
2. whether it serves *the* model: the first replica asked for ``GetModelInfo`` fixes the model
   (protocol version and fingerprint) for the gateway's life; every replica is asked once before
   its first call (again after it was down: a restart may run another build), and one that
   speaks another protocol or reports another fingerprint is refused (shown in ``/ready``) and
   gets no call.

A call (Tokenize, Detokenize, GetModelInfo) goes to the replicas not known to be down in turn
(round-robin, so equal replicas share the load; a replica not checked yet counts as up), then to
the others (one that just came back serves before its next health check). A replica that fails
with UNAVAILABLE (down, draining, deadline
passed) or whose call was cancelled on its side (it stopped mid-call) is marked down and the
call is retried on the next one, each replica at most once: every tokenizer call only reads, so
repeating one is safe. Only when every replica failed does the request get 503. Any other error
(a prompt too long, a bad id) is the request's own and is answered at once: another replica
would say the same.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from services.common.errors import AbortedError, UnavailableError
from services.common.pb import tokenizer_pb2
from services.common.periodic import Periodic
from services.common.protocol import check_peer
from services.gateway.backend import TokenizerClient

logger = logging.getLogger(__name__)

T = TypeVar("T")
INCOMPATIBLE_CODE = "backend_incompatible"
"""``UnavailableError.code`` of a replica refused for its protocol or model."""
UNAVAILABLE_CODE = "backend_unavailable"


@dataclass(slots=True)
class TokenizerReplica:
    """What the pool knows about one tokenizer replica (mutated only by the pool)."""

    client: TokenizerClient
    healthy: bool = False  # SERVING at its last health check, and no call failed since
    down: bool = False  # its last health check or call failed
    polled: bool = False  # whether its health was ever checked
    status: str = "not checked yet"  # the last health answer, or why the replica is down
    checked: bool = False  # whether its model was compared with the pool's
    refused: str | None = None  # why it serves another protocol or model

    @property
    def address(self) -> str:
        return self.client.address

    def describe(self) -> dict[str, object]:
        """A JSON-able summary for ``/ready``."""
        out: dict[str, object] = {"address": self.address, "healthy": self.healthy and
                                  self.refused is None, "status": self.status}  # fmt: skip
        if self.refused is not None:
            out["error"] = f"refused: {self.refused}"
        elif not self.healthy:
            out["error"] = self.status
        return out


class TokenizerPool:
    """Every tokenizer replica the ``--tokenizer`` entries stand for; calls with retry."""

    def __init__(self, clients: Sequence[TokenizerClient], *, interval_s: float = 1.0) -> None:
        self._replicas = [TokenizerReplica(c) for c in clients]
        self._turn = itertools.count()
        self.model_info: tokenizer_pb2.ModelInfo | None = None  # the model every replica serves
        self._poller = Periodic(self.poll_once, interval_s, "tokenizer health poll")

    # ---- membership -----------------------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self._replicas]

    def replicas(self) -> tuple[TokenizerReplica, ...]:
        return tuple(self._replicas)

    def set_members(self, clients: Sequence[TokenizerClient]) -> None:
        """Make ``clients`` the pool (DNS re-resolved); known replicas keep their state."""
        known = {r.address: r for r in self._replicas}
        pool = [known.get(c.address) or TokenizerReplica(c) for c in clients]
        added = [r.address for r in pool if r.address not in known]
        dropped = sorted(set(known) - {r.address for r in pool})
        if added or dropped:
            logger.info("tokenizer pool changed: added %s, dropped %s", added or "none",
                        dropped or "none")  # fmt: skip
        self._replicas = pool

    def healthy_count(self) -> int:
        return sum(1 for r in self._replicas if r.healthy and r.refused is None)

    # ---- health ---------------------------------------------------------------------------
    async def poll_once(self) -> None:
        """Check every replica's health concurrently."""
        await asyncio.gather(*(self._poll(r) for r in self._replicas))

    async def poll_new(self) -> None:
        """Check the health of the replicas never checked yet (new members, or all of them
        before the first background check)."""
        await asyncio.gather(*(self._poll(r) for r in self._replicas if not r.polled))

    async def _poll(self, replica: TokenizerReplica) -> None:
        status = await replica.client.health()
        replica.polled = True
        was_healthy = replica.healthy
        replica.healthy = status == "SERVING"
        replica.down = not replica.healthy
        replica.status = status
        if not replica.healthy:
            # A restarted replica may run another build: compare its model again when it is back.
            replica.checked, replica.refused = False, None
        if was_healthy != replica.healthy:
            log = logger.info if replica.healthy else logger.warning
            log("tokenizer %s", "up" if replica.healthy else "down",
                extra={"worker": replica.address, "role": "tokenizer", "error": status})

    def mark_down(self, replica: TokenizerReplica, error: UnavailableError | AbortedError) -> None:
        """Try ``replica`` last until its next good health check (after it failed a call)."""
        if not replica.down:
            logger.warning("tokenizer marked down", extra={
                "worker": replica.address, "role": "tokenizer", "error": error.message})
        replica.healthy = False
        replica.down = True
        replica.status = error.message

    async def start(self) -> None:
        """Check every replica's health every ``interval_s`` in the background. Calls do not wait
        for the first check: a replica not checked yet is tried like a healthy one."""
        self._poller.start()

    async def stop(self) -> None:
        await self._poller.stop()

    # ---- calls ----------------------------------------------------------------------------
    def ordered(self) -> list[TokenizerReplica]:
        """Healthy (or not yet checked) replicas first, rotating from call to call; then those
        that failed their last check or call; refused ones last."""
        if not self._replicas:
            return []
        start = next(self._turn) % len(self._replicas)
        rotated = self._replicas[start:] + self._replicas[:start]
        return sorted(rotated, key=lambda r: (r.refused is not None, r.down))

    async def call(self, fn: Callable[[TokenizerClient], Awaitable[T]]) -> T:
        """``fn(client)`` on one replica after another until one answers (see the module).

        Raises:
            UnavailableError: every replica failed or was refused (the last failure's message;
                code ``backend_incompatible`` when it was a refusal).
            TandemError: the replica's own answer to a bad request, at once.
        """
        last: UnavailableError | AbortedError | None = None
        tried = 0
        for replica in self.ordered():
            tried += 1
            try:
                await self._check_model(replica)
                return await fn(replica.client)
            except (UnavailableError, AbortedError) as err:
                if err.code != INCOMPATIBLE_CODE:
                    self.mark_down(replica, err)
                last = err
                logger.debug("tokenizer %s failed (%s); trying another", replica.address,
                             err.message)  # fmt: skip
        if last is None:
            raise UnavailableError("no tokenizer replica is configured", code=UNAVAILABLE_CODE)
        where = f" (all {tried} tokenizer replicas failed)" if tried > 1 else ""
        code = last.code if last.code == INCOMPATIBLE_CODE else UNAVAILABLE_CODE
        raise UnavailableError(f"{last.message}{where}", code=code)

    async def _check_model(self, replica: TokenizerReplica) -> None:
        """Ask ``replica`` for its model once and refuse it unless it is the pool's model (the
        first replica asked decides)."""
        if replica.refused is not None:
            raise UnavailableError(f"the tokenizer {replica.address} is refused: "
                                   f"{replica.refused}", code=INCOMPATIBLE_CODE)  # fmt: skip
        if replica.checked:
            return
        info = await replica.client.model_info()
        why = check_peer(info.protocol_version)
        expected = self.model_info
        if why is None and expected is not None and (
                info.model_fingerprint != expected.model_fingerprint):  # fmt: skip
            why = (f"it serves model {info.model_fingerprint or '(unknown)'} and the other "
                   f"replicas {expected.model_fingerprint or '(unknown)'}")
        if why is not None:
            replica.refused = why
            logger.warning("tokenizer refused", extra={
                "worker": replica.address, "role": "tokenizer", "error": why})
            raise UnavailableError(f"the tokenizer service is refused: {why}",
                                   code=INCOMPATIBLE_CODE)  # fmt: skip
        replica.checked = True
        if self.model_info is None:
            self.model_info = info

    async def tokenize(
        self, request: tokenizer_pb2.TokenizeRequest
    ) -> tokenizer_pb2.TokenizeResponse:
        return await self.call(lambda client: client.tokenize(request))

    async def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool = True
    ) -> str:
        return await self.call(
            lambda client: client.detokenize(token_ids, skip_special_tokens=skip_special_tokens)
        )

    async def fetch_model_info(self) -> tokenizer_pb2.ModelInfo:
        """The model's facts, from the first replica that serves the pool's model.

        Raises:
            UnavailableError: no replica answered, or every one that did was refused.
        """
        if self.model_info is not None:
            return self.model_info
        await self.call(lambda client: _nothing())
        if self.model_info is None:  # pragma: no cover - call() set it or raised
            raise UnavailableError("the tokenizer reported no model", code=UNAVAILABLE_CODE)
        return self.model_info

    def describe(self) -> list[dict[str, object]]:
        """Every replica's summary, for ``/ready``."""
        return [r.describe() for r in self._replicas]


async def _nothing() -> None:
    """The call :meth:`TokenizerPool.fetch_model_info` makes once a replica's model is checked."""
