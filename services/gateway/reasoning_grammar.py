"""An output grammar that holds after the reasoning, not during it (as vLLM applies one).

With a reasoning parser on (``--reasoning-parser``), the model thinks before it answers; a
grammar (``tool_choice`` required or named, ``response_format``, ``structured_outputs``) is for
the answer. :func:`after_reasoning` wraps the request's grammar into one that first lets the
thinking through, free, up to ``</think>``:

* ``qwen3``: an optional ``<think>`` … ``</think>`` block opens the reply (Qwen3 with thinking
  off, whose template closes the block in the prompt, answers at once);
* ``deepseek_r1``: the template opened ``<think>`` in the prompt, so the reply starts inside the
  reasoning; a leading ``<think>`` is allowed too.

Newlines between ``</think>`` and the answer are free. The answer is the original grammar, whole,
as a sub-grammar (llguidance's ``@name`` reference), so any kind of grammar can be wrapped. The
markers are the tokenizer's special tokens where it has them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from services.gateway.reasoning import THINK_CLOSE, THINK_OPEN
from services.gateway.tool_parsers.base import literal_for

_ANSWER = "answer"


def after_reasoning(
    grammar: str, parser: str, special_tokens: Mapping[str, int] | None = None
) -> str:
    """``grammar`` (llguidance's serialized form, or Lark text) behind the thinking of
    ``parser``'s models; ``grammar`` itself when ``parser`` is ``none``."""
    if parser not in ("qwen3", "deepseek_r1"):
        return grammar
    literal = literal_for(special_tokens)
    thinking = f'thinking[stop={json.dumps(THINK_CLOSE)}]: /(.|\\n)*/'
    if literal(THINK_CLOSE) != json.dumps(THINK_CLOSE):  # one special token: stop on it
        thinking = f"thinking: /(.|\\n)*/ {literal(THINK_CLOSE)}"
    opener = literal(THINK_OPEN)
    if parser == "qwen3":
        start = f"start: ({opener} thinking /\\n*/)? @{_ANSWER}"
    else:
        start = f"start: {opener}? thinking /\\n*/ @{_ANSWER}"
    top: dict[str, Any] = {"grammars": [{"lark_grammar": f"{start}\n{thinking}\n"}]}
    top["grammars"] += _sub_grammars(grammar)
    return json.dumps(top)


def _sub_grammars(grammar: str) -> list[dict[str, Any]]:
    """The grammar's parts, its first (its start) named :data:`_ANSWER`."""
    try:
        parsed = json.loads(grammar)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("grammars"), list) and parsed["grammars"]:
        parts = [dict(g) for g in parsed["grammars"]]
    else:
        parts = [{"lark_grammar": grammar}]
    parts[0]["name"] = _ANSWER
    return parts
