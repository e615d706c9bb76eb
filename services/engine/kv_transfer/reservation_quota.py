"""Bounds on the KV a decode worker holds for ``Reserve`` calls, per caller and in total.

A reservation holds blocks before any KV exists (``receiver.py``, state RESERVED), so without a
bound one caller could reserve the whole pool: every remote prefill would then wait and get 503,
and running requests would find no block to grow into and be preempted. Two bounds, as fractions
of the pool (``--max-reserved-fraction``, ``--max-reserved-per-caller``):

1. all reservations together hold at most ``total_fraction`` of the pool, so running requests
   always keep the rest to grow into;
2. one caller's reservations hold at most ``caller_fraction`` of it, so one caller cannot starve
   another. A caller is the identity its certificate proves (``peer_roles.caller_identity``: its
   URI SANs and the certificate's digest), not its address: opening connections from other
   ports or hosts does not make it another caller (without TLS the peer's host stands in).

Both bounds count from a caller's first reservation: nothing is exempt, so the total bound is a
bound. So that one long prompt is never refused forever by a small fraction, neither bound is
ever below the blocks of the longest prompt the worker accepts (``largest_prompt_blocks``): a
caller holding nothing may always reserve one prompt while the others' reservations leave room
under the total. Callers are only the deployment's gateways (mutual TLS, ``Reserve`` is the
gateway role's). A refusal is ``RESOURCE_EXHAUSTED`` at once, which the gateway treats like a
full worker (another worker, a wait, or 503 ``decode_capacity``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from services.common.errors import InvalidArgumentError, ResourceExhaustedError

logger = logging.getLogger(__name__)

DEFAULT_MAX_RESERVED_FRACTION = 0.5
DEFAULT_MAX_RESERVED_PER_CALLER = 0.25


@dataclass(frozen=True, slots=True)
class ReservationQuota:
    """The two bounds, as fractions of the KV pool in ``(0, 1]``."""

    total_fraction: float = DEFAULT_MAX_RESERVED_FRACTION
    caller_fraction: float = DEFAULT_MAX_RESERVED_PER_CALLER

    def validate(self) -> ReservationQuota:
        for name, flag in (("total_fraction", "max_reserved_fraction"),
                           ("caller_fraction", "max_reserved_per_caller")):  # fmt: skip
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 < value <= 1):
                raise InvalidArgumentError(
                    f"--{flag.replace('_', '-')} must be in (0, 1], got {value}", param=flag)
        return self

    def check(
        self,
        *,
        num_blocks: int,
        held_by_caller: int,
        held_total: int,
        pool_blocks: int,
        largest_prompt_blocks: int = 1,
    ) -> None:
        """Allow a reservation of ``num_blocks`` or raise ResourceExhaustedError.

        Args:
            num_blocks: what the new reservation needs.
            held_by_caller / held_total: blocks already reserved by its caller / by everyone.
            pool_blocks: the worker's KV pool.
            largest_prompt_blocks: the blocks of the longest prompt the worker accepts; neither
                bound is below it (capped at the pool).
        """
        floor = max(1, min(largest_prompt_blocks, pool_blocks))
        caller_cap = max(floor, math.floor(self.caller_fraction * pool_blocks))
        total_cap = max(floor, math.floor(self.total_fraction * pool_blocks))
        if held_by_caller + num_blocks > caller_cap:
            raise ResourceExhaustedError(
                f"this caller already holds {held_by_caller} reserved KV blocks; another "
                f"{num_blocks} would pass its bound of {caller_cap} (--max-reserved-per-caller)",
                code="reservation_quota",
            )
        if held_total + num_blocks > total_cap:
            raise ResourceExhaustedError(
                f"{held_total} KV blocks are already reserved; another {num_blocks} would pass "
                f"the bound of {total_cap} (--max-reserved-fraction)",
                code="reservation_quota",
            )
