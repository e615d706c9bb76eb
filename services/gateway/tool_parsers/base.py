"""What every tool-call format shares: the request's tools, a parsed call, and the one streaming
interface every format's parser implements.

A format parser is a small class (one file per format, registered by name in ``__init__.py``)
that knows two things about its format:

1. ``scan(text, final, truncated)``: read the reply so far and say which of it is content and
   which calls it holds, each call with its name once complete and its arguments as JSON text
   that only ever grows (a prefix of the final arguments) — ``None`` while nothing of them can
   be sent yet;
2. ``grammar(tools, parallel, literal)``: the Lark rules (the rule ``calls`` is the start) that
   make a reply a call of ``tools`` — one, or one or more when ``parallel``.

:class:`ToolParser` turns the scans into a stream, one choice per parser object: text deltas in
(:meth:`ToolParser.feed`, then :meth:`ToolParser.finish`), :class:`StreamDelta` out — content
text, and call deltas as OpenAI streams them (the call's id and name first, then fragments of
its arguments). Re-reading the reply at each delta keeps every format's parser a plain function
of the text, and the whole-reply answer (:meth:`ToolParser.parse`) the same scan, once.

A reply cut by ``max_tokens`` (``truncated``) keeps its complete calls; the call it was cut in
is dropped, neither a call nor content.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from services.gateway.structured_outputs import JSON_LAYOUT

Literal = Callable[[str], str]
"""Writes a marker as a Lark terminal: its special token (``<[id]>``) where the tokenizer has
one, else the quoted text."""


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]
    function: Mapping[str, Any] = field(default_factory=dict)  # as the client sent it

    def to_openai(self) -> dict[str, Any]:
        """The ``{"type": "function", "function": {...}}`` object a chat template renders: the
        client's own, key order included (templates print it with ``tojson``)."""
        function = dict(self.function) or {"name": self.name, "description": self.description,
                                           "parameters": dict(self.parameters)}  # fmt: skip
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolsRequest:
    """The request's tools; ``choice`` is ``"none"``, ``"auto"``, ``"required"`` or a name."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether tools are rendered and calls parsed."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice != "auto"

    @property
    def chosen(self) -> tuple[Tool, ...]:
        """The tools a forced reply may call: all for ``required``, the named one otherwise."""
        return tuple(t for t in self.tools if self.choice in ("required", "auto", t.name))

    @property
    def many(self) -> bool:
        """Whether a forced reply may hold several calls: never for a named function (OpenAI
        and vLLM return exactly one), else as ``parallel_tool_calls`` says."""
        return self.parallel and self.choice in ("required", "auto")


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        if index is not None:
            out["index"] = index
        return out


@dataclass(frozen=True, slots=True)
class ScannedCall:
    """One call as far as the reply shows it."""

    name: str | None  # None until the name is complete
    arguments: str | None  # JSON text so far, only ever growing; None: nothing sendable yet
    complete: bool = False


@dataclass(slots=True)
class Scan:
    content: str  # the reply's content so far (only ever growing)
    calls: list[ScannedCall]


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A streamed piece of call ``index``: its id and name first, then argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass(slots=True)
class _Sent:
    id: str
    name: str
    arguments: str = ""


class ToolParser(ABC):
    """One choice's tool-call parser (see the module docstring for the contract)."""

    name: ClassVar[str]

    def __init__(self, tools: Sequence[Tool] = ()) -> None:
        self.tools = {t.name: t for t in tools}
        self._text = ""
        self._content = 0  # characters of content already sent
        self._sent: list[_Sent] = []
        self.calls: list[ToolCall] = []  # complete calls, in order
        self.memo: dict[Any, Any] = {}  # where scans of this reply stopped (json_scan.py)

    # ------------------------------------------------------------------ what a format defines

    @abstractmethod
    def scan(self, text: str, final: bool, truncated: bool) -> Scan:
        """Content and calls of ``text``; ``final``: the reply ended (release what was held
        back, drop or keep an unfinished call as ``truncated`` says)."""

    @classmethod
    @abstractmethod
    def grammar(cls, tools: Sequence[Tool], parallel: bool, literal: Literal) -> str:
        """Lark rules whose rule ``calls`` is exactly the format's calls of ``tools``."""

    # ------------------------------------------------------------------ the stream

    def feed(self, text: str) -> StreamDelta:
        """Content and call pieces that ``text`` (the next delta of the reply) makes final."""
        self._text += text
        return self._emit(self.scan(self._text, final=False, truncated=False))

    def finish(self, truncated: bool = False) -> StreamDelta:
        """At the end of the reply: what was held back. ``truncated``: cut by ``max_tokens``."""
        return self._emit(self.scan(self._text, final=True, truncated=truncated))

    def parse(self, text: str, truncated: bool = False) -> tuple[str, list[ToolCall]]:
        """``(content, calls)`` of a whole reply."""
        self._text, self.memo = text, {}
        scan = self.scan(text, final=True, truncated=truncated)
        self._emit(scan)
        return scan.content.strip(), list(self.calls)

    def cached(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per ``key`` for this reply (a finished call's parse: the stream
        re-reads the reply at every delta, a finished call does not change)."""
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def _emit(self, scan: Scan) -> StreamDelta:
        out = StreamDelta(content=scan.content[self._content :])
        self._content = max(self._content, len(scan.content))
        for index, call in enumerate(scan.calls):
            if index > len(self._sent) or call.name is None:
                break
            if index == len(self._sent):
                self._sent.append(_Sent(new_call_id(), call.name))
                out.calls.append(CallDelta(index, id=self._sent[index].id, name=call.name))
            sent = self._sent[index]
            if call.arguments is not None and call.arguments.startswith(sent.arguments):
                piece = call.arguments[len(sent.arguments) :]
                if piece:
                    sent.arguments = call.arguments
                    out.calls.append(CallDelta(index, arguments=piece))
            if call.complete and index == len(self.calls):
                self.calls.append(ToolCall(call.name, call.arguments or "{}", sent.id))
        return out


# ---------------------------------------------------------------------- shared helpers


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (the text a
    stream must hold back: it may yet become the marker)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def literal_for(special_tokens: Mapping[str, int] | None) -> Literal:
    """The :data:`Literal` of a tokenizer whose special tokens are ``special_tokens``."""
    tokens = special_tokens or {}

    def literal(text: str) -> str:
        token = tokens.get(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    return literal


def call_schema(tools: Sequence[Tool], key: str) -> dict[str, Any]:
    """The JSON schema of one ``{"name": ..., key: {...}}`` call of any of ``tools``."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name},
                                                         key: dict(t.parameters)},
                       "required": ["name", key], "additionalProperties": False}
                      for t in tools]}  # fmt: skip


def json_rule(schema: Mapping[str, Any]) -> str:
    """A Lark ``%json`` item for ``schema``, in ``json.dumps``'s layout as every output JSON is
    (structured_outputs.py): a small model left free to place whitespace wanders off in it."""
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}"


def repeated(call: str, parallel: bool, separator: str = '"\\n"') -> str:
    """The ``calls`` rule: one ``call``, or several between ``separator`` s."""
    return f"calls: {call} ({separator} {call})*\n" if parallel else f"calls: {call}\n"


def whitespace_only(text: str) -> bool:
    return not text.strip()


def scan_tagged(
    text: str, final: bool, truncated: bool, open_: str, close: str,
    partial: Callable[[int, str], ScannedCall | None],
    whole: Callable[[int, int, str], ScannedCall | None],
) -> Scan:
    """The scan of a format whose calls are ``open_ ... close`` blocks with content between
    them (``hermes``, ``qwen3_coder``): ``partial(body_start, body)`` reads an unclosed block of
    a stream still running, ``whole(start, end, body)`` a closed one (or the last block of a
    finished text), None when it is no call; a block that is no call is content, unless it is
    the unclosed tail of a cut reply. Whitespace between calls is not content."""
    content: list[str] = []
    calls: list[ScannedCall] = []
    pos = 0
    while True:
        start = text.find(open_, pos)
        if start < 0:
            tail = text[pos:]
            if not final:
                tail = tail[: len(tail) - partial_marker(tail, open_)]
            if not calls or not whitespace_only(tail):
                content.append(tail)
            break
        before = text[pos:start]
        if not calls or not whitespace_only(before):
            content.append(before)
        body_start = start + len(open_)
        end = text.find(close, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        if end < 0 and not final:
            call = partial(body_start, body)
            if call is not None:
                calls.append(call)
            break
        call = whole(start, end, body)
        if call is not None:
            calls.append(call)
        elif end >= 0 or not truncated:  # not a call after all: it was text
            content.append(text[start : end + len(close)] if end >= 0 else text[start:])
        if end < 0:
            break
        pos = end + len(close)
    return Scan("".join(content), calls)
