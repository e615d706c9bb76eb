"""Content safety for the gateway: an input check before any compute, and a streaming output
filter that never lets a violating phrase reach the client, not even its first character.

The contract (any implementation, rule-based today, a classifier model later):

1. ``SafetyPolicy.check_input(texts)`` is awaited once per request, before tokenization, with the
   prompt or every message's text. A verdict with ``allowed=False`` is answered with HTTP 400,
   code ``content_policy_violation`` (see :func:`content_policy_error`).
2. ``SafetyPolicy.stream_filter()`` returns a fresh :class:`OutputFilter` per generated choice.
   The gateway pushes every text delta through ``push`` and sends only ``text_to_send``; after the
   last delta it calls ``finish`` and sends that text too.
3. An output filter holds back the tail it cannot judge yet. Everything it returns is final:
   once returned, text is never recalled. On a violation it returns only the text before the
   violation, ``blocked=True`` and the category; every later call returns ``("", blocked=True)``.
   The gateway then ends the choice with ``finish_reason: "content_filter"``.
4. ``push`` and ``finish`` are synchronous and cheap (called once per token on the event loop).

:class:`RuleBasedPolicy` reads a JSON file::

    {"categories": {"malware": {"terms": ["write a keylogger"],
                                "patterns": ["ransomware\\\\s+builder"], "max_len": 40}}}

Terms match case-insensitively on word boundaries (a space in a term matches any one whitespace
character). Patterns are Python regexes, compiled case-insensitively; ``max_len`` declares the
longest text a category's patterns can match (default :data:`DEFAULT_PATTERN_MAX_LEN`), and the
file's author keeps patterns within it. ``max_match_len`` is the longest span any rule must see,
including the one character after a term that decides its trailing word boundary.

How much the stream filter holds back (so that text streams as soon as it is known safe):

* terms: only the tail that is the beginning of some term (at a word boundary) — checked with
  one regex of every term's prefixes anchored at the end of the buffer; ordinary text is sent at
  once, and ``"how to make a pi"`` waits until it can no longer become a blocked phrase;
* patterns: Python regexes cannot report a *partial* match, so when a policy has patterns the
  last ``max_len - 1`` characters are held back (a bounded, larger delay — prefer terms).

A match that touches the end of the buffer is treated as possible until the next character (or
``finish``) settles it, and nothing from its start on is sent.
"""

from __future__ import annotations

import json
import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from services.common.errors import FailedPreconditionError, InvalidArgumentError

logger = logging.getLogger(__name__)

DEFAULT_POLICY_FILE = "default_safety_policy.json"
DEFAULT_PATTERN_MAX_LEN = 64
OFF_VALUES = frozenset({"off", "none", "disabled", "false", "0"})


@dataclass(frozen=True, slots=True)
class SafetyVerdict:
    """The outcome of an input check; ``category``/``reason`` are set when not allowed."""

    allowed: bool
    category: str | None = None
    reason: str | None = None


ALLOWED = SafetyVerdict(allowed=True)


@dataclass(frozen=True, slots=True)
class FilterResult:
    """What an output filter lets through now; ``blocked`` is sticky once set."""

    text_to_send: str
    blocked: bool = False
    category: str | None = None


class OutputFilter(ABC):
    """A per-choice streaming filter (see the module docstring for the contract)."""

    @abstractmethod
    def push(self, delta: str) -> FilterResult:
        """Take the next generated text; return what is now safe to send."""

    @abstractmethod
    def finish(self) -> FilterResult:
        """The stream ended: judge and release the held-back tail."""


class SafetyPolicy(ABC):
    """A content policy: an input check and a factory of output filters."""

    name: str = "policy"

    @abstractmethod
    async def check_input(self, texts: Sequence[str]) -> SafetyVerdict:
        """Judge the request's texts before any compute."""

    @abstractmethod
    def stream_filter(self) -> OutputFilter:
        """A fresh filter for one generated choice."""


def content_policy_error(verdict: SafetyVerdict, *, param: str | None) -> InvalidArgumentError:
    """The 400 the gateway answers for a blocked input (``param`` is ``messages`` or ``prompt``)."""
    category = verdict.category or "unspecified"
    return InvalidArgumentError(
        f"The request was rejected by the content policy (category: {category}).",
        param=param,
        code="content_policy_violation",
    )


# --------------------------------------------------------------------------- allow-all


class PassThroughFilter(OutputFilter):
    """Sends every delta at once."""

    def push(self, delta: str) -> FilterResult:
        return FilterResult(delta)

    def finish(self) -> FilterResult:
        return FilterResult("")


class AllowAllPolicy(SafetyPolicy):
    """Safety turned off: everything is allowed and nothing is held back."""

    name = "off"

    async def check_input(self, texts: Sequence[str]) -> SafetyVerdict:
        return ALLOWED

    def stream_filter(self) -> OutputFilter:
        return PassThroughFilter()


# --------------------------------------------------------------------------- rule-based


@dataclass(frozen=True, slots=True)
class RuleCategory:
    """One category's compiled rules and the longest span they can need to see."""

    name: str
    regex: re.Pattern[str]
    max_match_len: int
    terms: tuple[str, ...] = ()
    pattern_max_len: int = 0  # 0 when the category has no patterns


class RuleBasedPolicy(SafetyPolicy):
    """Terms and regexes per category, loaded from JSON (see the module docstring)."""

    name = "rules"

    def __init__(self, categories: Sequence[RuleCategory]) -> None:
        self.categories = tuple(categories)
        self.max_match_len = max((c.max_match_len for c in self.categories), default=1)
        self.pattern_hold = max(
            (c.pattern_max_len - 1 for c in self.categories if c.pattern_max_len), default=0
        )
        terms = sorted({t for c in self.categories for t in c.terms}, key=len, reverse=True)
        self.longest_term = max((len(t) for t in terms), default=0)
        self.term_prefix = (
            re.compile(rf"(?<!\w)(?:{'|'.join(_prefix_regex(t) for t in terms)})\Z", re.IGNORECASE)
            if terms
            else None
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> RuleBasedPolicy:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FailedPreconditionError(
                f"Cannot read safety policy {path}: {exc}", param="safety_policy"
            ) from exc
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: object, *, source: str = "<dict>") -> RuleBasedPolicy:
        """Build from the parsed JSON; raise FailedPreconditionError on a malformed policy."""
        cats = raw.get("categories") if isinstance(raw, dict) else None
        if not isinstance(cats, dict):
            raise _policy_error(source, 'expected {"categories": {name: {...}}}')
        return cls([_compile_category(name, spec, source) for name, spec in cats.items()])

    async def check_input(self, texts: Sequence[str]) -> SafetyVerdict:
        for text in texts:
            hit = self.first_match(text)
            if hit is not None:
                logger.info("input blocked by safety policy (category %s)", hit[1].name)
                return SafetyVerdict(False, hit[1].name, f"matched a {hit[1].name} rule")
        return ALLOWED

    def stream_filter(self) -> OutputFilter:
        return RuleOutputFilter(self)

    def first_match(self, text: str, pos: int = 0) -> tuple[re.Match[str], RuleCategory] | None:
        """The earliest-starting non-empty match at or after ``pos`` over all categories."""
        best: tuple[re.Match[str], RuleCategory] | None = None
        for cat in self.categories:
            m = cat.regex.search(text, pos)
            while m is not None and m.end() == m.start():  # zero-width: marks no text
                m = cat.regex.search(text, m.start() + 1)
            if m is not None and (best is None or m.start() < best[0].start()):
                best = (m, cat)
        return best


class RuleOutputFilter(OutputFilter):
    """The hold-back buffer over a :class:`RuleBasedPolicy`.

    ``_buf`` holds a little already-sent context (for leading word boundaries) followed by the
    unsent text, which starts at ``_sent``.
    """

    def __init__(self, policy: RuleBasedPolicy) -> None:
        self._policy = policy
        self._buf = ""
        self._sent = 0
        self._blocked: str | None = None

    def push(self, delta: str) -> FilterResult:
        if self._blocked is not None:
            return FilterResult("", True, self._blocked)
        self._buf += delta
        return self._release(final=False)

    def finish(self) -> FilterResult:
        if self._blocked is not None:
            return FilterResult("", True, self._blocked)
        return self._release(final=True)

    def _release(self, *, final: bool) -> FilterResult:
        n = len(self._buf)
        pending = n  # start of the earliest match that the next character may still undo
        pos = self._sent
        while pos < n:
            hit = self._policy.first_match(self._buf, pos)
            if hit is None:
                break
            m, cat = hit
            if final or m.end() < n:  # the character after the match is known: a violation
                return self._block(min(m.start(), pending), cat.name)
            pending = min(pending, m.start())  # touches the end: wait for the next character
            pos = m.start() + 1
        safe_end = n if final else max(self._sent, min(pending, self._hold_from(n)))
        out = self._buf[self._sent : safe_end]
        self._sent = safe_end
        self._trim()
        return FilterResult(out)

    def _hold_from(self, n: int) -> int:
        """Where the text that may still become a violation starts (``n``: nothing held)."""
        policy = self._policy
        hold_from = n - policy.pattern_hold
        if policy.term_prefix is not None:
            start = max(self._sent, n - policy.longest_term)
            m = policy.term_prefix.search(self._buf, start)
            if m is not None:
                hold_from = min(hold_from, m.start())
        return hold_from

    def _block(self, end: int, category: str) -> FilterResult:
        out = self._buf[self._sent : max(end, self._sent)]
        self._blocked = category
        self._buf = ""
        self._sent = 0
        logger.info("output blocked by safety policy (category %s)", category)
        return FilterResult(out, True, category)

    def _trim(self) -> None:
        """Drop sent text beyond what a leading word boundary needs to look at."""
        keep_from = max(0, self._sent - self._policy.max_match_len)
        if keep_from > 0:
            self._buf = self._buf[keep_from:]
            self._sent -= keep_from


def _compile_category(name: object, spec: object, source: str) -> RuleCategory:
    if not isinstance(name, str) or not isinstance(spec, dict):
        raise _policy_error(source, f"category {name!r} must map a name to an object")
    terms = spec.get("terms", [])
    patterns = spec.get("patterns", [])
    if not _is_str_list(terms) or not _is_str_list(patterns):
        raise _policy_error(source, f"category {name!r}: terms/patterns must be lists of strings")
    max_len = spec.get("max_len", DEFAULT_PATTERN_MAX_LEN)
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise _policy_error(source, f"category {name!r}: max_len must be a positive integer")
    parts: list[str] = []
    normalized: list[str] = []
    longest = 1
    for term in terms:
        words = term.split()
        if not words:
            raise _policy_error(source, f"category {name!r}: empty term")
        body = r"\s".join(re.escape(w) for w in words)
        parts.append(rf"(?<!\w){body}(?!\w)")
        normalized.append(" ".join(words))
        longest = max(longest, len(" ".join(words)) + 1)  # +1: the boundary character after it
    for pattern in patterns:
        try:
            compiled = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            detail = f"category {name!r}: bad pattern {pattern!r}: {exc}"
            raise _policy_error(source, detail) from exc
        if compiled.fullmatch("") is not None:
            raise _policy_error(source, f"category {name!r}: pattern {pattern!r} matches ''")
        parts.append(f"(?:{pattern})")
    if patterns:
        longest = max(longest, max_len)
    if not parts:
        raise _policy_error(source, f"category {name!r} has no terms or patterns")
    try:
        regex = re.compile("|".join(parts), re.IGNORECASE)
    except re.error as exc:  # e.g. a global inline flag such as (?i) inside one pattern
        raise _policy_error(source, f"category {name!r}: {exc}") from exc
    return RuleCategory(
        name=name,
        regex=regex,
        max_match_len=longest,
        terms=tuple(normalized),
        pattern_max_len=max_len if patterns else 0,
    )


def _prefix_regex(term: str) -> str:
    """A regex matching every non-empty prefix of ``term`` (a space matches any whitespace):
    ``abc`` → ``a(?:b(?:c)?)?``."""
    pieces = [r"\s" if ch == " " else re.escape(ch) for ch in term]
    out = ""
    for piece in reversed(pieces[1:]):
        out = f"(?:{piece}{out})?"
    return pieces[0] + out


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _policy_error(source: str, detail: str) -> FailedPreconditionError:
    return FailedPreconditionError(
        f"Invalid safety policy {source}: {detail}", param="safety_policy"
    )


# --------------------------------------------------------------------------- loading


def default_policy_path() -> Path:
    """The policy file shipped next to this module."""
    return Path(str(resources.files(__package__ or "services.gateway") / DEFAULT_POLICY_FILE))


def load_policy(path: str | os.PathLike[str] | None) -> SafetyPolicy:
    """``None`` (or ``"default"``) loads the shipped policy; ``"off"`` disables safety."""
    if isinstance(path, str) and path.strip().lower() in OFF_VALUES:
        logger.warning("safety policy disabled")
        return AllowAllPolicy()
    if path is None or (isinstance(path, str) and path.strip().lower() == "default"):
        path = default_policy_path()
    policy = RuleBasedPolicy.from_file(path)
    logger.info(
        "safety policy %s: %d categories, hold-back %d chars",
        path,
        len(policy.categories),
        policy.max_match_len - 1,
    )
    return policy
