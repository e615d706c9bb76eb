"""Tool-call formats, one small class per format in its own file, registered here by name
(``--tool-call-parser``): a new format is one file and one entry in :data:`PARSERS`.

Each class implements :class:`~services.gateway.tool_parsers.base.ToolParser`: a scan of the
reply so far (content, and calls with their names and growing arguments) and the Lark rules that
force a reply to be calls. ``auto`` picks the format from the model's chat template
(:func:`choose_format`).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.tool_parsers.base import Tool, ToolParser
from services.gateway.tool_parsers.deepseek_v3 import CALLS_BEGIN, DeepSeekV3Parser
from services.gateway.tool_parsers.hermes import OPEN as HERMES_OPEN
from services.gateway.tool_parsers.hermes import HermesParser
from services.gateway.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonParser
from services.gateway.tool_parsers.mistral import MARK as MISTRAL_MARK
from services.gateway.tool_parsers.mistral import MistralParser
from services.gateway.tool_parsers.pythonic import PythonicParser
from services.gateway.tool_parsers.qwen3_coder import FUNCTION, PARAMETER, Qwen3CoderParser

PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (HermesParser, Llama3JsonParser, MistralParser, Qwen3CoderParser, PythonicParser,
                DeepSeekV3Parser)
}  # fmt: skip
TOOL_CALL_PARSERS = ("auto", *PARSERS)


def new_parser(fmt: str, tools: Sequence[Tool] = ()) -> ToolParser:
    """A fresh parser of format ``fmt`` for one choice (``tools``: the request's, whose schemas
    type the values of formats that write them as text)."""
    try:
        return PARSERS[fmt](tools)
    except KeyError:
        raise ValueError(f"unknown tool-call format {fmt!r}") from None


def template_renders_tools(chat_template: str) -> bool:
    """Whether the model's own template takes ``tools`` (else Tandem writes the instructions)."""
    return "tools" in chat_template


def choose_format(flag: str, chat_template: str) -> str:
    """The tool-call format of ``--tool-call-parser``, ``auto`` reading the chat template: the
    markers it writes calls with, in the order that tells the formats apart (Qwen3-Coder's
    template also holds ``<tool_call>``; Llama 3.2's pythonic one also ``<|python_tag|>``)."""
    if flag != "auto":
        return flag
    if not template_renders_tools(chat_template):
        return "hermes"  # Tandem's own instructions (no tool support)
    if MISTRAL_MARK in chat_template:
        return "mistral"
    if CALLS_BEGIN in chat_template:
        return "deepseek_v3"
    if FUNCTION in chat_template and PARAMETER in chat_template:
        return "qwen3_coder"
    if HERMES_OPEN in chat_template:
        return "hermes"
    if "[func_name1(" in chat_template:
        return "pythonic"
    if any(mark in chat_template for mark in (PYTHON_TAG, "<|eom_id|>", '"parameters"')):
        return "llama3_json"
    return "hermes"
