"""Render a model's Jinja chat template the way ``transformers.apply_chat_template`` does.

Chat templates are untrusted code shipped with a model, so they run in jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks`` on, and with the same
helpers transformers provides (``transformers/utils/chat_template_utils.py``):

- the filter ``tojson`` (no HTML escaping, non-ASCII kept, optional ``indent``/``separators``);
- the globals ``raise_exception(message)`` (here: an :class:`InvalidArgumentError`, since a
  template raises on conversations it cannot render, e.g. roles out of order),
  ``strftime_now(format)``, a safe ``dict`` and a ``namespace`` that refuses ``_``-names;
- the ``loopcontrols`` extension (``break``/``continue``) and a ``{% generation %}`` block tag
  that just renders its body.

Each template source is compiled once (cached by its text). Rendering, step by step:

1. :func:`validate_messages` checks the conversation: a non-empty list of dicts with a string
   ``role`` and a string ``content``; keys whose value is None are dropped, as transformers does.
2. The template is rendered with ``messages``, ``add_generation_prompt``, ``tools=None``,
   ``documents=None``, the named special tokens (``bos_token``, ``eos_token``, ``unk_token``,
   ``pad_token``) and any extra variables (which override the special tokens).
3. Errors raised while rendering become :class:`InvalidArgumentError` (``param="messages"``); a
   template that does not compile is a :class:`ModelLoadError`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.errors import InvalidArgumentError, ModelLoadError

logger = logging.getLogger(__name__)

Message = dict[str, Any]

# Gemma 3's chat template (``tokenizer_config.json`` of google/gemma-3-*-it), for Gemma GGUF files
# that carry none: a system message is folded into the first user turn, the assistant's role is
# ``model``, every turn ends with ``<end_of_turn>``.
GEMMA_CHAT_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


class ChatTemplate:
    """A compiled chat template. Cheap to construct: compilation is cached per template text."""

    __slots__ = ("source", "_template")

    def __init__(self, source: str) -> None:
        if not isinstance(source, str) or not source:
            raise ModelLoadError("a chat template must be a non-empty string")
        self.source = source
        self._template = _compile(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        special_tokens: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> str:
        """Render ``messages`` (validated first) to the prompt text.

        Args:
            messages: the conversation, ``[{"role": str, "content": str}, ...]``.
            add_generation_prompt: append the header that starts the assistant's reply.
            special_tokens: template variables such as ``{"bos_token": "<s>"}``.
            **extra: more template variables (e.g. ``tools``, ``enable_thinking``); they override
                ``special_tokens`` of the same name.
        """
        chat = validate_messages(messages)
        variables: dict[str, Any] = {"tools": None, "documents": None}
        variables.update(special_tokens or {})
        variables.update(extra)
        variables["messages"] = chat
        variables["add_generation_prompt"] = bool(add_generation_prompt)
        try:
            return self._template.render(**variables)
        except InvalidArgumentError:
            raise
        except jinja2.TemplateError as exc:
            raise InvalidArgumentError(
                f"the chat template cannot render these messages: {exc}", param="messages"
            ) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise InvalidArgumentError(
                f"the chat template failed on these messages: {exc}", param="messages"
            ) from exc


def validate_messages(messages: Any) -> list[Message]:
    """A clean copy of ``messages``; InvalidArgumentError(param="messages") naming the problem."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgumentError("messages must be a non-empty list", param="messages")
    chat: list[Message] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidArgumentError(f"messages[{index}] must be an object", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidArgumentError(
                f"messages[{index}].role must be a non-empty string", param="messages"
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise InvalidArgumentError(
                f"messages[{index}].content must be a string", param="messages"
            )
        chat.append({str(k): v for k, v in message.items() if v is not None})
    return chat


def _raise_exception(message: str) -> NoReturn:
    raise InvalidArgumentError(
        f"the chat template rejected the messages: {message}", param="messages"
    )


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` for templates without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` that refuses underscore names (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors jinja2.utils.Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace: {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text; we only render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"the model's chat template does not compile: {exc}") from exc
