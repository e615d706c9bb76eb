"""Stored Responses-API responses: what ``store: true`` keeps, for ``previous_response_id`` and
``GET`` / ``DELETE /v1/responses/{id}``.

A bounded, in-memory map in the gateway process (one per application, on the aiohttp app under
:data:`RESPONSE_STORE_KEY`): nothing is written to disk and nothing is shared between gateway
replicas, so a continuation must reach the replica that stored its predecessor (or send the
whole conversation statelessly). Two limits keep its memory bounded:

1. every entry expires ``ttl_s`` after it was stored (``--response-store-ttl``);
2. at most ``max_entries`` are kept (``--response-store-max-entries``); storing one more evicts
   the oldest. ``max_entries`` 0 turns storing off: ``store: true`` then keeps nothing.

Each entry holds the response object as it was returned and the conversation that led to it
(chat-completions messages, its own reply last), which a continuation extends.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from aiohttp import web

from services.gateway.openai_responses import JsonDict

@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response: the object returned, the conversation through its reply, and the
    API key that created it (only that key may read or delete it)."""

    response: JsonDict
    conversation: tuple[Mapping[str, object], ...]
    owner: str
    stored_at: float


class ResponseStore:
    """A TTL'd, size-bounded map of response id -> :class:`StoredResponse`."""

    def __init__(
        self, *, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        if not ttl_s > 0:
            raise ValueError("the response store's TTL must be positive")
        if max_entries < 0:
            raise ValueError("the response store's size must be >= 0")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(
        self, response_id: str, response: JsonDict, conversation: Sequence[Mapping[str, object]],
        *, owner: str,
    ) -> None:  # fmt: skip
        """Keep ``response`` (evicting the oldest entry when full)."""
        if self.max_entries == 0:
            return
        self._expire()
        self._entries.pop(response_id, None)
        self._entries[response_id] = StoredResponse(response, tuple(conversation), owner,
                                                    self._clock())  # fmt: skip
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str, *, owner: str) -> StoredResponse | None:
        """The live entry for ``response_id`` stored by ``owner``, or None."""
        self._expire()
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, response_id: str, *, owner: str) -> bool:
        """Forget ``response_id``; False when there was no such live entry of ``owner``."""
        if self.get(response_id, owner=owner) is None:
            return False
        del self._entries[response_id]
        return True

    def _expire(self) -> None:
        """Drop the entries past their TTL (the oldest come first)."""
        cutoff = self._clock() - self.ttl_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at > cutoff:
                break
            self._entries.popitem(last=False)


RESPONSE_STORE_KEY = web.AppKey("tandem_response_store", ResponseStore)
"""Where the application keeps its :class:`ResponseStore` (set by ``app.build_app``)."""
