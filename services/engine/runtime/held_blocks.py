"""KV blocks that belong to a request id but to no engine sequence.

Two kinds exist: a prefill-only request's blocks after its first token (kept until its KV
transfer ends) and a decode worker's blocks for an incoming transfer (reserved before the
prefill, or allocated when its header arrives; kept until the request is handed to the engine).
Every way out — ack, failure, abort, lease expiry, a consumer that went away, shutdown — pops
the entry before freeing it, so a request's blocks are freed exactly once whichever path gets
there first. Engine thread only (no locking).

Lifecycle of an entry:
  1. ``hold(request_id, block_ids, owner)`` — the blocks are allocated (ref-counted) and parked;
     ``resize(request_id, num_blocks)`` grows or shrinks a parked entry (a reservation meeting
     its transfer's header).
  2. ``take(request_id)`` — the engine takes them over for a sequence (nothing is freed), or
     ``release(request_id)`` — they are freed (``release_if_owned`` only for the given owner).
"""

from __future__ import annotations

from services.common.errors import NotFoundError
from services.engine.core.engine import LLMEngine


class HeldBlocks:
    """Request id -> (block ids, owner) for one engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._held: dict[str, tuple[list[int], object | None]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def hold(self, request_id: str, block_ids: list[int], owner: object | None = None) -> None:
        self._held[request_id] = (list(block_ids), owner)

    def blocks(self, request_id: str) -> list[int]:
        held = self._held.get(request_id)
        if held is None:
            raise NotFoundError(f"no KV blocks are held for request {request_id!r}")
        return held[0]

    def resize(self, request_id: str, num_blocks: int) -> list[int]:
        """Make the entry exactly ``num_blocks`` long: allocate the missing blocks after those
        held (an entry is created when none is), or free the excess from the end.

        Raises:
            ResourceExhaustedError: no room for the missing blocks; nothing changed.
        """
        blocks, owner = self._held.get(request_id, ([], None))
        if num_blocks > len(blocks):
            blocks = blocks + self.engine.block_manager.allocate(num_blocks - len(blocks))
        elif num_blocks < len(blocks):
            self.engine.release_blocks(blocks[num_blocks:])
            blocks = blocks[:num_blocks]
        self._held[request_id] = (blocks, owner)
        return blocks

    def take(self, request_id: str) -> list[int]:
        """Hand the blocks over to the caller (the engine); NotFoundError when none are held."""
        blocks = self.blocks(request_id)
        del self._held[request_id]
        return blocks

    def release(self, request_id: str) -> bool:
        """Free the blocks; False when none were held (already freed or taken)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self.engine.release_blocks(held[0])
        return True

    def release_if_owned(self, request_id: str, owner: object) -> bool:
        held = self._held.get(request_id)
        return held is not None and held[1] is owner and self.release(request_id)

    def release_all(self) -> int:
        request_ids = list(self._held)
        for request_id in request_ids:
            self.release(request_id)
        return len(request_ids)
