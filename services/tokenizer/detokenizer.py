"""Incremental detokenization: token ids in, safe text deltas out, stop strings handled.

Decoding one token at a time is wrong in two ways: a byte-level token can hold half of a UTF-8
character (an emoji or CJK character is often split over two or three tokens), and some
tokenizers (sentencepiece ``▁``) render a token differently depending on what precedes it. So,
like vLLM, we decode a small window of ids and diff it against the window's previous text:

- ``prefix_offset`` .. ``read_offset`` are ids already turned into released text (the context);
- ``read_offset`` .. end are ids whose text is not released yet;
- ``new = decode(ids[prefix_offset:])``, ``old = decode(ids[prefix_offset:read_offset])``; when
  ``new`` is longer than ``old`` and does not end in U+FFFD (an incomplete byte sequence),
  ``new[len(old):]`` is released and both offsets move forward. Otherwise the ids wait.

Released text then passes a stop-string filter, step by step on each :meth:`push`:

1. ``pending`` (text held back) + the newly released text is searched for every stop string;
   the first one to complete (smallest end, then smallest start) ends the stream: the text
   before it is emitted, the stop string and everything after are not, ``stopped`` becomes True.
2. Otherwise the longest tail that is a prefix of some stop string stays in ``pending`` and the
   rest is emitted, so the beginning of a stop string that later completes is never sent.
3. :meth:`flush` at the end releases what is still held (an incomplete character as U+FFFD,
   a tail that turned out not to be a stop string), after the same stop check.

Invariant (tested): the concatenation of all deltas and ``flush()`` equals
``tokenizer.decode(all ids)``, cut before the first stop string when one matched.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.common.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# How many prompt ids before the first generated one serve as decoding context (as in vLLM).
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class DetokenizedDelta:
    """The result of one :meth:`IncrementalDetokenizer.push`.

    Attributes:
        text: newly releasable text (may be empty).
        stopped: a stop string completed; nothing more will be released.
        stop_string: the stop string that matched, or None.
    """

    text: str
    stopped: bool = False
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Turns one sequence's generated ids into text deltas. Not thread-safe; one per sequence."""

    __slots__ = (
        "_tokenizer", "_skip_special", "_stops", "_max_stop", "_ids", "_prefix_offset",
        "_read_offset", "_pending", "_stopped", "_stop_string", "_emitted",
    )

    def __init__(
        self,
        tokenizer: Decoder,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        for text in stop:
            if not isinstance(text, str) or not text:
                raise InvalidArgumentError("stop strings must be non-empty strings", param="stop")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._ids: list[int] = list(prompt_token_ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - PROMPT_CONTEXT_TOKENS, 0)
        self._pending = ""
        self._stopped = False
        self._stop_string: str | None = None
        self._emitted: list[str] = []

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def stop_string(self) -> str | None:
        return self._stop_string

    @property
    def text(self) -> str:
        """All text emitted so far (deltas and flush)."""
        return "".join(self._emitted)

    def push(self, token_ids: Sequence[int]) -> DetokenizedDelta:
        """Add generated ids; return the text that became safe to send."""
        if self._stopped:
            return DetokenizedDelta("", True, self._stop_string)
        self._ids.extend(token_ids)
        released = self._release(final=False)
        return self._filter(released, final=False)

    def flush(self) -> str:
        """Release everything still held; call once when the sequence ends."""
        if self._stopped:
            return ""
        released = self._release(final=True)
        return self._filter(released, final=True).text

    def _release(self, *, final: bool) -> str:
        """Text of the unread ids that is complete (never half a UTF-8 character unless final)."""
        if self._read_offset >= len(self._ids):
            return ""
        decode = self._tokenizer.decode
        old = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        new = decode(self._ids[self._prefix_offset :], self._skip_special)
        if len(new) <= len(old) or (new.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new[len(old) :]

    def _filter(self, released: str, *, final: bool) -> DetokenizedDelta:
        """Apply the stop strings to ``pending + released`` and record what is emitted."""
        text = self._pending + released
        match = self._first_stop(text)
        if match is not None:
            start, stop = match
            self._stopped, self._stop_string, self._pending = True, stop, ""
            self._emitted.append(text[:start])
            return DetokenizedDelta(text[:start], True, stop)
        hold = 0 if final else self._held_tail(text)
        self._pending = text[len(text) - hold :] if hold else ""
        out = text[: len(text) - hold]
        self._emitted.append(out)
        return DetokenizedDelta(out)

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """``(start, stop)`` of the stop string that completes first in ``text``, or None."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _held_tail(self, text: str) -> int:
        """Length of the longest tail of ``text`` that some stop string starts with."""
        for size in range(min(len(text), self._max_stop - 1), 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0
