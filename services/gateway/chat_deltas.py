"""The chat renderer's output read back as a few typed steps, for the fronts that re-shape it.

The Responses and Anthropic Messages renderers do not parse the model's text themselves: they
drive the chat renderer (``renderers.ChatRenderer``, which owns reasoning and tool-call parsing)
and read what it wrote, OpenAI ``chat.completion.chunk`` deltas while streaming and one
``chat.completion`` at the end otherwise, as a list of :class:`Step` values:

* ``reasoning`` / ``text``: a piece of the reasoning or of the answer;
* ``call``: a tool call begins (its id and name; ``text`` holds arguments sent with them);
* ``arguments``: more of the arguments of call ``call_index``;
* ``finish``: the choice ended, ``text`` holding the chat ``finish_reason``.

Both forms give the same steps, so each front builds its output items with one state machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

StepKind = Literal["reasoning", "text", "call", "arguments", "finish"]


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a reply (see the module docstring)."""

    kind: StepKind
    text: str = ""
    call_index: int = 0
    call_id: str = ""
    name: str = ""


def _first_choice(obj: Mapping[str, object]) -> Mapping[str, object] | None:
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    return choices[0]


def chunk_steps(chunk: Mapping[str, object]) -> list[Step]:
    """The steps of one ``chat.completion.chunk`` (choice 0; fronts serve one choice)."""
    choice = _first_choice(chunk)
    if choice is None:
        return []
    delta = choice.get("delta")
    steps: list[Step] = []
    if isinstance(delta, dict):
        reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            steps.append(Step("reasoning", reasoning))
        content = delta.get("content")
        if isinstance(content, str) and content:
            steps.append(Step("text", content))
        for call in delta.get("tool_calls") or []:
            steps += _call_steps(call)
    reason = choice.get("finish_reason")
    if isinstance(reason, str):
        steps.append(Step("finish", reason))
    return steps


def _call_steps(call: Mapping[str, object]) -> list[Step]:
    index = call.get("index", 0)
    index = index if isinstance(index, int) else 0
    function = call.get("function")
    function = function if isinstance(function, dict) else {}
    arguments = function.get("arguments")
    arguments = arguments if isinstance(arguments, str) else ""
    call_id = call.get("id")
    if isinstance(call_id, str) and call_id:
        name = function.get("name")
        return [Step("call", arguments, index, call_id, name if isinstance(name, str) else "")]
    return [Step("arguments", arguments, index)] if arguments else []


def response_steps(response: Mapping[str, object]) -> list[Step]:
    """The steps of a whole ``chat.completion`` (choice 0), in stream order: reasoning, text,
    each call, the finish."""
    choice = _first_choice(response)
    if choice is None:
        return [Step("finish", "stop")]
    message = choice.get("message")
    message = message if isinstance(message, dict) else {}
    steps: list[Step] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        steps.append(Step("reasoning", reasoning))
    content = message.get("content")
    if isinstance(content, str) and content:
        steps.append(Step("text", content))
    for index, call in enumerate(message.get("tool_calls") or []):
        steps += _call_steps({**call, "index": index})
    reason = choice.get("finish_reason")
    steps.append(Step("finish", reason if isinstance(reason, str) else "stop"))
    return steps
