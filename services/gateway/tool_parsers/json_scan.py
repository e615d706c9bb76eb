"""Reading JSON that is still being written: where a value ends (or that it has not yet), and
the ``{"name": ..., "arguments": {...}}`` object of the JSON call formats, field by field.

The streaming parsers need to know, of a reply cut anywhere, which of its characters belong to
a call's arguments: an object's text from its ``{`` up to the current end is a prefix of the
arguments' final text, so it can be sent as it comes. Nothing here builds values; a complete
call is checked with :func:`json.loads` before it counts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_WS = " \t\r\n"
_CLOSE = {"{": "}", "[": "]"}
_STRUCTURE = re.compile(r'["{}\[\]]')
_SCALAR = re.compile(r"[^,}\]\s]*")


class NotJson(ValueError):
    """The text cannot be the start of the expected JSON."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


Memo = dict[Any, Any]
"""Where earlier scans of the same growing text stopped (see :func:`value_end`)."""


def string_end(text: str, i: int, quote: str = '"', memo: Memo | None = None) -> int | None:
    """Index after the string that opens at ``text[i]`` (a ``quote``), None if unfinished: the
    next quote not escaped by an odd run of backslashes."""
    j = memo.get(("s", i), i + 1) if memo is not None else i + 1
    while True:
        q = text.find(quote, j)
        if q < 0:
            if memo is not None:  # no closing quote before here: the next scan starts here
                memo[("s", i)] = len(text)
            return None
        k = q - 1
        while k > i and text[k] == "\\":
            k -= 1
        if (q - 1 - k) % 2 == 0:
            return q + 1
        j = q + 1


def value_end(text: str, i: int, memo: Memo | None = None) -> int | None:
    """Index after the JSON value starting at ``text[i]``, None if it is unfinished; NotJson
    when brackets do not match.

    A stream re-reads its reply at every delta, so this must not cost a Python step per
    character: it jumps between quotes and brackets (``str.find``, regular expressions), and
    with a ``memo`` kept for one growing text it resumes where the last scan of the value
    stopped, so a long argument costs about the same per delta however long it gets."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i, '"', memo)
    if c not in _CLOSE:  # a number, true, false or null: ends at a delimiter
        j = _SCALAR.match(text, i).end()  # type: ignore[union-attr]
        return j if j < len(text) else None
    saved = memo.get(("v", i)) if memo is not None else None
    stack, j = (list(saved[0]), saved[1]) if saved is not None else ([_CLOSE[c]], i + 1)
    while True:
        found = _STRUCTURE.search(text, j)
        if found is None:
            if memo is not None:
                memo[("v", i)] = (stack, len(text))
            return None
        c, j = found.group(), found.start()
        if c == '"':
            end = string_end(text, j, '"', memo)
            if end is None:
                if memo is not None:
                    memo[("v", i)] = (stack, j)
                return None
            j = end
            continue
        if c in _CLOSE:
            stack.append(_CLOSE[c])
        elif c != stack.pop():
            raise NotJson(f"unbalanced {c!r}")
        elif not stack:
            return j + 1
        j += 1


@dataclass(slots=True)
class ObjectCall:
    """A ``{"name": ..., key: ...}`` call as far as it is written."""

    name: str | None = None
    arguments: str | None = None  # the arguments' text so far (None: not streamable yet)
    end: int | None = None  # index after the closing brace once complete


def scan_call_object(
    text: str, start: int, keys: tuple[str, ...], memo: Memo | None = None
) -> ObjectCall:
    """The call object opening at ``text[start]`` (whitespace before it skipped), whose
    arguments are under the first of ``keys`` present. NotJson when it is not one."""
    out = ObjectCall()
    i = skip_ws(text, start)
    if i >= len(text):
        return out
    if text[i] != "{":
        raise NotJson("a call is an object")
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return out
        if text[i] == "}":
            out.end = i + 1
            return out
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            raise NotJson("a key is a string")
        key_end = string_end(text, i)
        if key_end is None:
            return out
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return out
        if text[i] != ":":
            raise NotJson("':' after a key")
        i = skip_ws(text, i + 1)
        end = value_end(text, i, memo)
        if key == "name":
            if end is None:
                return out
            name = json.loads(text[i:end])
            if not isinstance(name, str):
                raise NotJson("the name is a string")
            out.name = name
        elif key in keys:
            if end is None:
                if i < len(text) and text[i] in _CLOSE:
                    out.arguments = text[i:]
                return out
            raw = text[i:end]
            try:  # arguments sent as a string of JSON text are that text
                out.arguments = json.loads(raw) if raw.startswith('"') else raw
            except ValueError as err:
                raise NotJson("a bad string") from err
        elif end is None:
            return out
        i = end


def complete_call(text: str, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """``(name, arguments)`` of a whole call object's text, or None when it is not one; string
    arguments (JSON text inside a string) are unwrapped."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in keys if k in obj), None)
    if key is None:
        return obj["name"], "{}"
    try:
        scanned = scan_call_object(text, 0, keys)
    except NotJson:
        return None
    if isinstance(obj[key], (str, dict)) and scanned.arguments is not None:
        return obj["name"], scanned.arguments
    return None
