"""Decode side of the KV hand-off, first half: reservations ("reserve before compute").

Before a prompt is prefilled elsewhere, the gateway reserves on the decode worker the blocks its
KV will fill (``ReservationDesk.reserve``): allocated on the engine thread, held under the request
id for a lease, bound to the digest of the prompt and ``cache_salt`` the gateway serves
(``prefix_hash.reservation_digest``), bounded per caller and in total (``reservation_quota.py``).
Its holder may renew the lease while the prompt waits for a prefill worker; a lease that ends
with no header frees the blocks. The transfer that then takes the blocks is ``receiver.py``'s
(the state machine, step 0 here, is described there); both work on one table of
:class:`~services.engine.kv_transfer.receive_entry.ReceiveEntry` rows, which the receiver owns
and hands this desk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import (
    AbortedError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    TandemError,
)
from services.common.metrics import TandemMetrics
from services.engine.kv_transfer.checks import check_reservation
from services.engine.kv_transfer.receive_entry import ReceiveEntry, ReceiveState
from services.engine.kv_transfer.reservation_quota import ReservationQuota
from services.engine.runtime.engine_loop import EngineLoop

logger = logging.getLogger(__name__)

DEFAULT_RESERVATION_LEASE_SECONDS = 30.0
"""How long reserved blocks wait for their header when the caller asks for no lease."""
MAX_RESERVATION_LEASE_SECONDS = 600.0
"""Longest ``--reservation-lease-seconds`` a worker accepts."""


@dataclass(frozen=True, slots=True)
class Reservation:
    """What ``reserve`` granted: blocks held for the request, for ``lease_seconds``."""

    request_id: str
    num_blocks: int
    lease_seconds: float
    kv_blocks_free: int  # allocatable on this worker after the grant


class ReservationDesk:
    """Grants, renews and expires reservations in the receiver's table ``entries``."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        entries: dict[str, ReceiveEntry],
        notify: Callable[[], None],
        *,
        block_size: int,
        max_model_len: int,
        lease_seconds: float,
        quota: ReservationQuota,
        metrics: TandemMetrics | None,
    ) -> None:
        self.engine_loop = engine_loop
        self.entries = entries
        self.notify = notify  # wakes whoever waits on the table (the receiver's claims)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.lease_seconds = lease_seconds
        self.quota = quota
        self.metrics = metrics

    async def reserve(
        self,
        request_id: str,
        num_tokens: int,
        lease_seconds: float = 0.0,
        *,
        prompt_digest: bytes,
        caller: str = "",
        renew: bool = False,
    ) -> Reservation:
        """Hold the blocks ``num_tokens`` prompt tokens' KV will fill, before the prefill starts
        (state RESERVED), for ``lease_seconds`` (0: the worker's lease; never longer than it: a
        caller cannot hold this worker's KV longer than its operator allows). Only a header
        whose prompt and ``cache_salt`` give ``prompt_digest``
        (``prefix_hash.reservation_digest``) may take the blocks. ``renew``: move the lease of
        ``caller``'s reservation of this request, prompt and size, still waiting for its header,
        to ``lease`` from now instead (nothing allocated).

        Raises:
            InvalidArgumentError: bad arguments (``checks.check_reservation``), or the request
                id already has a reservation or a transfer here (a duplicate is refused, not
                merged: two callers must never share an id).
            ResourceExhaustedError: no room, or ``caller`` (or everyone) already holds what
                :class:`ReservationQuota` allows; nothing was allocated and nothing is kept.
            AbortedError: the request was aborted here (before or during the allocation).
            NotFoundError: ``renew`` found no such reservation waiting for its header.
        """
        check_reservation(request_id, num_tokens, lease_seconds, prompt_digest,
                          max_model_len=self.max_model_len)
        lease = self.lease_seconds if lease_seconds == 0 else min(lease_seconds, self.lease_seconds)
        num_blocks = -(-num_tokens // self.block_size)
        old = self.entries.get(request_id)
        if renew:
            return self._renew(old, request_id, num_blocks, lease, prompt_digest, caller)
        if old is not None and old.aborted:
            raise AbortedError(f"request {request_id!r} was aborted", code="aborted")
        if old is not None and old.state is not ReceiveState.FAILED:
            raise InvalidArgumentError(
                f"request {request_id!r} already has a reservation or a KV transfer here",
                param="request_id",
            )
        self._check_quota(caller, num_blocks, request_id)
        now = time.monotonic()
        entry = ReceiveEntry(request_id, ReceiveState.RESERVED, now, owns_blocks=True,
                             expires=now + lease, caller=caller, reserved_blocks=num_blocks,
                             digest=prompt_digest)  # fmt: skip
        self.entries[request_id] = entry
        try:
            await self.engine_loop.allocate_blocks(request_id, num_blocks)
        except ResourceExhaustedError:
            self.drop(entry, release=False)  # nothing was allocated
            self.count("refused")
            logger.info("KV reservation refused: no room for %d blocks", num_blocks,
                        extra={"request_id": request_id})
            raise
        except TandemError:
            self.drop(entry, release=False)  # refused: nothing was allocated
            raise
        except BaseException:  # cancelled: the allocation may still complete
            self.drop(entry, release=True)
            raise
        if self.entries.get(request_id) is not entry or entry.state is ReceiveState.FAILED:
            # Aborted (or expired) during the allocation; its release was queued after it.
            raise entry.error or AbortedError(f"request {request_id!r} was aborted", code="aborted")
        self.count("granted")
        return Reservation(request_id, num_blocks, lease, self.engine_loop.stats.num_blocks_free)

    def _renew(self, entry: ReceiveEntry | None, request_id: str, num_blocks: int, lease: float,
               digest: bytes, caller: str) -> Reservation:  # fmt: skip
        """Extend ``caller``'s reservation ``entry`` (see ``reserve``'s ``renew``)."""
        if (entry is None or entry.state is not ReceiveState.RESERVED or entry.aborted
                or entry.caller != caller or entry.digest != digest
                or entry.reserved_blocks != num_blocks):  # fmt: skip
            raise NotFoundError(f"request {request_id!r} holds no reservation here to renew "
                                "(expired, aborted, another caller's, or already taken by its KV)")
        entry.expires = max(entry.expires, time.monotonic() + lease)
        self.count("renewed")
        return Reservation(request_id, num_blocks, lease, self.engine_loop.stats.num_blocks_free)

    def _check_quota(self, caller: str, num_blocks: int, request_id: str) -> None:
        """Raise ResourceExhaustedError when the reservation would pass a quota bound."""
        by_caller = total = 0
        for entry in self.entries.values():
            if entry.state is ReceiveState.RESERVED:
                total += entry.reserved_blocks
                if entry.caller == caller:
                    by_caller += entry.reserved_blocks
        try:
            self.quota.check(num_blocks=num_blocks, held_by_caller=by_caller, held_total=total,
                             pool_blocks=self.engine_loop.stats.num_blocks_total,
                             largest_prompt_blocks=self._largest_prompt_blocks)  # fmt: skip
        except ResourceExhaustedError as err:
            self.count("refused")
            logger.info("KV reservation refused: %s", err.message, extra={"request_id": request_id})
            raise

    @property
    def _largest_prompt_blocks(self) -> int:
        """Blocks the longest prompt this worker accepts needs (a quota never refuses it alone)."""
        return -(-(self.max_model_len - 1) // self.block_size)

    def drop(self, entry: ReceiveEntry, *, release: bool) -> None:
        """Forget a reservation still waiting for its header (no tombstone); free its blocks
        when ``release``. A no-op once a header took the entry over or it failed."""
        if self.entries.get(entry.request_id) is not entry:
            return
        if entry.state is not ReceiveState.RESERVED:
            return
        del self.entries[entry.request_id]
        entry.state = ReceiveState.FAILED
        if release:
            self.engine_loop.release_nowait(entry.request_id)
        self.notify()

    def expire(self, entry: ReceiveEntry, now: float) -> None:
        """Free reservation ``entry`` when its lease ended by ``now``."""
        if now < entry.expires:
            return
        self.drop(entry, release=True)
        self.count("expired")
        logger.warning("KV reservation expired: no header within its lease",
                       extra={"request_id": entry.request_id})  # fmt: skip

    def count(self, outcome: str) -> None:
        """Count one reservation outcome in ``tandem:kv_reservations_total``."""
        if self.metrics is not None:
            self.metrics.kv_reservations.labels(outcome=outcome).inc()
