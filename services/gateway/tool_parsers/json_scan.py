"""Reading JSON that is still being written: where a value ends (or that it has not yet), and
the ``{"name": ..., "arguments": {...}}`` object of the JSON call formats, field by field.

The streaming parsers need to know, of a reply cut anywhere, which of its characters belong to
a call's arguments: an object's text from its ``{`` up to the current end is a prefix of the
arguments' final text, so it can be sent as it comes. Nothing here builds values; a complete
call is checked with :func:`json.loads` before it counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"
_CLOSE = {"{": "}", "[": "]"}


class NotJson(ValueError):
    """The text cannot be the start of the expected JSON."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index after the JSON string that opens at ``text[i]`` (a quote), None if unfinished."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index after the JSON value starting at ``text[i]``, None if it is unfinished; NotJson
    when brackets do not match."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c not in _CLOSE:  # a number, true, false or null: ends at a delimiter
        j = i
        while j < len(text) and text[j] not in ",}]" + _WS:
            j += 1
        return j if j < len(text) else None
    stack = [_CLOSE[c]]
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == '"':
            end = string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if c in _CLOSE:
            stack.append(_CLOSE[c])
        elif c in "}]":
            if c != stack.pop():
                raise NotJson(f"unbalanced {c!r}")
            if not stack:
                return j + 1
        j += 1
    return None


@dataclass(slots=True)
class ObjectCall:
    """A ``{"name": ..., key: ...}`` call as far as it is written."""

    name: str | None = None
    arguments: str | None = None  # the arguments' text so far (None: not streamable yet)
    end: int | None = None  # index after the closing brace once complete


def scan_call_object(text: str, start: int, keys: tuple[str, ...]) -> ObjectCall:
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
        end = value_end(text, i)
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
