"""One request's row in the decode side's KV hand-off table: its state and what it holds.

Shared by the two halves that work on that table — the reservations (``reservations.py``: reserve,
renew, quota, expiry) and the transfers (``receiver.py``: header, chunks, commit, claim) — so
neither has to import the other. The state machine itself is described in ``receiver.py``.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from services.common.errors import TandemError
from services.engine.kv_transfer.payload import PrefilledRequest


class ReceiveState(enum.Enum):
    RESERVED = "reserved"
    ALLOCATED = "allocated"
    RECEIVING = "receiving"
    COMMITTED = "committed"
    RUNNING = "running"
    FAILED = "failed"


HOLDING = (ReceiveState.RESERVED, ReceiveState.ALLOCATED, ReceiveState.RECEIVING,
           ReceiveState.COMMITTED)  # fmt: skip
"""The states in which an entry's request holds KV blocks on this worker."""


@dataclass(slots=True)
class ReceiveEntry:
    request_id: str
    state: ReceiveState
    since: float
    ready: PrefilledRequest | None = None
    error: TandemError | None = None
    aborted: bool = False
    owns_blocks: bool = False
    task: asyncio.Task[object] | None = None
    expires: float = 0.0  # RESERVED: when the lease ends (time.monotonic)
    caller: str = ""  # RESERVED: who reserved (reservation_quota.py)
    reserved_blocks: int = 0  # RESERVED: how many blocks the reservation holds
    digest: bytes = b""  # RESERVED: the prompt and cache_salt it binds (reservation_digest)
