"""The compiled-grammar cache that the gateway and the engine both use.

Structured outputs are compiled twice, in two processes: the gateway turns a request's
constraint (a JSON schema, a regex, a choice list, a Lark/GBNF grammar) into an llguidance
grammar string and validates it (``services/gateway/grammar_pool.py``), and every worker that
samples for the request builds an ``LLMatcher`` from that string against the model's tokenizer
(``services/engine/core/grammar.py``). Both are expensive for a large schema (a 36 KB schema's
validation took 0.36 s on one core, holding the GIL), and both repeat for every request of an
application that sends the same schema each time.

What is shared, and what cannot be:

- *Shared*: this one cache type and its keying. The gateway keys its cache by a digest of the
  constraint's source (:attr:`~services.gateway.structured_outputs.GrammarSource.key`, key order
  ignored) and stores the grammar string, or the 400 it earned (a rejected or too-slow schema is
  refused again at once, without recompiling). The engine keys its cache by :func:`grammar_key`
  of that grammar string and stores the compiled fresh matcher. Because equal sources give
  byte-equal grammar strings (the gateway's compile is deterministic), the gateway's cache hit
  is also the engine's: a schema is compiled once per process, not once per request.
- *Not shared*: the compiled objects themselves. The gateway and each worker are separate
  processes (often separate machines), and an ``LLMatcher`` is a native object bound to the
  worker's tokenizer (which the gateway does not load): it can be neither pickled nor sent.

Bounded by entries and by the bytes of the values' sizes as the caller counts them, least
recently used first out. Not thread-safe: each owner touches its cache from one thread (the
gateway's event loop; the engine thread).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


def grammar_key(text: str) -> str:
    """The cache key of a grammar (or any source) text: its SHA-256, hex."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class GrammarCache(Generic[V]):
    """A least-recently-used map of at most ``max_entries`` values and ``max_bytes`` counted
    bytes (the size each :meth:`put` declares)."""

    def __init__(self, max_entries: int, max_bytes: int | None = None) -> None:
        if max_entries < 1:
            raise ValueError("a grammar cache holds at least one entry")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> V | None:
        """The value under ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: str, value: V, size: int = 0) -> None:
        """Keep ``value`` under ``key``, dropping the least recently used past the bounds (a
        value larger than ``max_bytes`` alone is not kept)."""
        if self.max_bytes is not None and size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[1]
        self._entries[key] = (value, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or (
            self.max_bytes is not None and self._bytes > self.max_bytes
        ):
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped
