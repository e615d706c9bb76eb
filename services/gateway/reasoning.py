"""Reasoning text split from the answer: ``<think>…</think>`` becomes ``reasoning_content``.

Reasoning models write their thinking before the answer between two markers; clients built for
vLLM's and DeepSeek's APIs read it from ``message.reasoning_content`` (streamed:
``delta.reasoning_content``) and the answer alone from ``content``. Parsers
(``--reasoning-parser`` on the gateway):

* ``qwen3``: the reply may open with ``<think>``; what lies before ``</think>`` is reasoning. A
  reply that does not open with it (Qwen3 with thinking off) is all answer.
* ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the reply starts inside
  the reasoning (a leading ``<think>`` is dropped) until ``</think>``; a reply that never closes
  it is all reasoning, as DeepSeek's API reports it.

Streamed text is held back only while it could be the start of a marker, so reasoning and answer
flow as they are generated.
"""

from __future__ import annotations

from services.gateway.tool_calls import partial_marker

REASONING_PARSERS = ("none", "qwen3", "deepseek_r1")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningSplitter:
    """One choice's stream: text in, ``(reasoning, answer)`` deltas out."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS[1:]:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self.parser = parser
        self._pending = ""
        self._state = "start"  # start -> thinking -> answer
        self._answering = False
        self.reasoning = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        reasoning, answer = "", ""
        while True:
            if self._state == "start":
                head = self._pending.lstrip()
                if not head or (THINK_OPEN.startswith(head) and head != THINK_OPEN):
                    return reasoning, answer  # not yet known whether it opens a think block
                if head.startswith(THINK_OPEN):
                    self._pending = head[len(THINK_OPEN) :]
                    self._state = "thinking"
                else:
                    self._state = "thinking" if self.parser == "deepseek_r1" else "answer"
                continue
            if self._state == "thinking":
                end = self._pending.find(THINK_CLOSE)
                if end < 0:
                    keep = partial_marker(self._pending, THINK_CLOSE)
                    cut = len(self._pending) - keep
                    reasoning += self._pending[:cut]
                    self._pending = self._pending[cut:]
                    break
                reasoning += self._pending[:end]
                self._pending = self._pending[end + len(THINK_CLOSE) :]
                self._state = "answer"
                continue
            if not self._answering:  # the newlines between the think block and the answer
                self._pending = self._pending.lstrip("\n")
                if not self._pending:
                    break
                self._answering = True
            answer += self._pending
            self._pending = ""
            break
        self.reasoning += reasoning
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What was held back at the end: reasoning inside an unclosed block, else answer."""
        pending, self._pending = self._pending, ""
        if self._state == "thinking":
            self.reasoning += pending
            return pending, ""
        return "", pending


def split_reasoning(text: str, parser: str) -> tuple[str, str]:
    """``(reasoning, answer)`` of a whole reply."""
    splitter = ReasoningSplitter(parser)
    reasoning, answer = splitter.feed(text)
    more_reasoning, more_answer = splitter.finish()
    return reasoning + more_reasoning, answer + more_answer

