"""The decode worker's own defaults, shared by its flags (``main.py``, torch-free) and its
start-up (``server.py``), so neither imports the other."""

from __future__ import annotations

import math

from services.common.errors import InvalidArgumentError

DEFAULT_WAIT_FOR_KV_SECONDS = 30.0  # how long Generate waits for its KV (and KV waits for Generate)
DEFAULT_RESERVATION_LEASE_SECONDS = 30.0  # how long reserved blocks wait for their KV header


def check_reservation_lease(seconds: float) -> float:
    """``--reservation-lease-seconds`` must be positive and at most
    ``MAX_RESERVATION_LEASE_SECONDS`` (600); returns it."""
    from services.engine.kv_transfer.reservations import MAX_RESERVATION_LEASE_SECONDS

    if not (math.isfinite(seconds) and 0 < seconds <= MAX_RESERVATION_LEASE_SECONDS):
        raise InvalidArgumentError(
            f"--reservation-lease-seconds must be in (0, {MAX_RESERVATION_LEASE_SECONDS:g}], "
            f"got {seconds}",
            param="reservation_lease_seconds",
        )
    return seconds
