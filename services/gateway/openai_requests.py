"""The OpenAI wire format, inbound: request parsing and validation for the gateway.

Requests arrive as decoded JSON (``object``) and leave as frozen dataclasses holding validated
values and a :class:`SamplingParams`; anything malformed raises :class:`InvalidArgumentError`
(HTTP 400) with OpenAI's message style, ``param`` naming the field and an OpenAI ``code``
(``missing_required_parameter``, ``invalid_type``, ``invalid_value``, ...). An unknown model raises
:class:`NotFoundError` (404, code ``model_not_found``). Nothing here talks to a backend, so the
parsing is checked in isolation and nothing is computed for a bad request (docs/errors.md). Reading
and type-checking single fields is ``openai_fields.py``; the outbound half is
``openai_responses.py``.

Conventions shared with vLLM:

1. ``null`` for an optional field means "not set".
2. Chat content parts are flattened: text parts joined with ``"\\n"``; other part types are 400.
3. Chat ``max_tokens`` / ``max_completion_tokens`` unset means "until the context is full":
   ``ChatRequest.max_tokens`` is ``None`` and ``sampling.max_tokens`` holds
   :data:`UNBOUNDED_MAX_TOKENS` until the gateway caps it by the context left after the prompt.
   Completions default to 16 tokens, like OpenAI.
4. Unknown fields are ignored (clients send many); features Tandem does not implement
   (``functions``, suffix, best_of) are rejected with 400 rather than ignored. Output constraints
   (``response_format``, ``structured_outputs``, ``guided_*``) and ``logit_bias`` are
   ``structured_outputs.py``'s.

The fields, the refused features and the integer limits checked here are declared once in
``api_schema.py``, which ``GET /openapi.json`` documents (tests/test_openapi.py checks that the
keys read here are exactly the declared ones).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from services.common.errors import InvalidArgumentError, NotFoundError
from services.common.sampling_params import SamplingParams
from services.gateway.api_schema import (
    CHAT_COMPLETION,
    CHAT_ROLES,
    COMPLETION,
    COMPLETION_DEFAULT_MAX_TOKENS,
    MAX_INT32,
    MAX_UINT32,
    SAMPLING_FIELDS,
    Field,
)
from services.gateway.openai_fields import (
    bool_or,
    check_max,
    check_min,
    empty_array,
    float_or,
    get_bool,
    get_int,
    get_str,
    invalid_type,
    missing,
    parse_content,
    parse_int_list,
    parse_prompt,
    parse_stop,
    require_object,
)
from services.gateway.structured_outputs import (
    GrammarSource,
    parse_logit_bias,
    structured_output_source,
)
from services.gateway.tool_calls import (
    ToolCall,
    ToolsRequest,
    parse_message_tool_calls,
    parse_tools,
)

UNBOUNDED_MAX_TOKENS = MAX_INT32
_SAMPLING = {f.name: f for f in SAMPLING_FIELDS}


# --------------------------------------------------------------------------- request types


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One conversation turn with its content flattened to text."""

    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()

    def to_dict(self) -> dict[str, str]:
        """The ``{role, content[, name]}`` mapping a chat template renders (tool calls aside)."""
        out = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body.

    Attributes:
        max_tokens: what the client asked for (``max_completion_tokens`` wins over
            ``max_tokens``); ``None`` means until the context is full, in which case
            ``sampling.max_tokens`` is :data:`UNBOUNDED_MAX_TOKENS` until the gateway caps it.
        logprobs: whether logprobs were requested; ``sampling.logprobs`` holds ``top_logprobs``
            (0 when only ``logprobs: true``) and is ``None`` when not requested.
    """

    model: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams
    max_tokens: int | None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    user: str | None = None
    tools: ToolsRequest | None = None
    chat_template_kwargs: Mapping[str, object] | None = None  # vLLM's: more template variables
    # the output constraint, not compiled yet: the handler compiles it in the grammar pool
    # (grammar_pool.py) into ``sampling.grammar``, off the event loop
    grammar_source: GrammarSource | None = None

    def texts(self) -> tuple[str, ...]:
        """Every message's text (and earlier calls' arguments), for the input safety check."""
        calls = tuple(c.arguments for m in self.messages for c in m.tool_calls)
        return tuple(m.content for m in self.messages) + calls


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated ``POST /v1/completions`` body.

    Attributes:
        prompt: the prompt text, or its token ids when the client sent ids.
        sampling: ``sampling.logprobs`` is the requested ``logprobs`` (0..5) or ``None``.
    """

    model: str
    prompt: str | tuple[int, ...]
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    user: str | None = None
    grammar_source: GrammarSource | None = None  # as ChatRequest's

    def texts(self) -> tuple[str, ...]:
        """The prompt text for the input safety check (token ids are checked after decoding)."""
        return (self.prompt,) if isinstance(self.prompt, str) else ()


# --------------------------------------------------------------------------- parsing


def parse_chat_request(body: object, *, served_models: Sequence[str]) -> ChatRequest:
    """Validate a chat completions body; raise InvalidArgumentError / NotFoundError."""
    obj = require_object(body)
    model = _parse_model(obj, served_models)
    messages = parse_messages(obj)
    _reject_unsupported(obj, CHAT_COMPLETION.unsupported)
    stream, include_usage = _parse_stream(obj)
    tools = parse_tools(obj)

    want_logprobs = get_bool(obj, "logprobs") or False
    top_logprobs = get_int(obj, "top_logprobs")
    if top_logprobs is not None:
        if not want_logprobs:
            raise InvalidArgumentError(
                "Invalid value for 'top_logprobs': 'logprobs' must be set to true when "
                "'top_logprobs' is used.",
                param="top_logprobs",
                code="invalid_value",
            )
        _check_bounds(top_logprobs, CHAT_COMPLETION["top_logprobs"])
    logprobs = (top_logprobs or 0) if want_logprobs else None

    max_tokens = _bounded_int(obj, CHAT_COMPLETION["max_completion_tokens"])
    if max_tokens is None:
        max_tokens = _bounded_int(obj, CHAT_COMPLETION["max_tokens"])

    sampling = _parse_sampling(
        obj,
        max_tokens=UNBOUNDED_MAX_TOKENS if max_tokens is None else max_tokens,
        logprobs=logprobs,
    )
    return ChatRequest(
        model=model,
        messages=messages,
        sampling=sampling,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        logprobs=want_logprobs,
        user=get_str(obj, "user"),
        tools=tools,
        chat_template_kwargs=parse_chat_template_kwargs(obj),
        grammar_source=structured_output_source(obj),
    )


_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt")


def parse_chat_template_kwargs(obj: Mapping[str, object]) -> Mapping[str, object] | None:
    """vLLM's ``chat_template_kwargs``: more variables for the chat template (e.g. Qwen3's
    ``{"enable_thinking": false}``); not the ones the server sets itself."""
    raw = obj.get("chat_template_kwargs")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise invalid_type("chat_template_kwargs", "an object", raw)
    taken = [key for key in _TEMPLATE_OWN if key in raw]
    if taken:
        raise InvalidArgumentError(
            f"'chat_template_kwargs' cannot set {taken[0]!r}: it comes from the request itself.",
            param=f"chat_template_kwargs.{taken[0]}",
            code="invalid_value",
        )
    return dict(raw) or None


def parse_completion_request(body: object, *, served_models: Sequence[str]) -> CompletionRequest:
    """Validate a (legacy) completions body; raise InvalidArgumentError / NotFoundError."""
    obj = require_object(body)
    model = _parse_model(obj, served_models)
    prompt = parse_prompt(obj)
    _reject_unsupported(obj, COMPLETION.unsupported)
    stream, include_usage = _parse_stream(obj)

    logprobs = _bounded_int(obj, COMPLETION["logprobs"])
    max_tokens = _bounded_int(obj, COMPLETION["max_tokens"])
    if max_tokens is None:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS

    sampling = _parse_sampling(obj, max_tokens=max_tokens, logprobs=logprobs)
    echo = get_bool(obj, "echo") or False
    if echo and logprobs is not None and sampling.prompt_logprobs is None:
        sampling = replace(sampling, prompt_logprobs=logprobs)  # the prompt's tokens are scored
    best_of = get_int(obj, "best_of")
    if best_of is not None and best_of != sampling.n:
        raise InvalidArgumentError(
            "Unsupported parameter: 'best_of' must equal 'n' (server-side best-of sampling is "
            "not supported).",
            param="best_of",
            code="unsupported_parameter",
        )
    return CompletionRequest(
        model=model,
        prompt=prompt,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        echo=echo,
        user=get_str(obj, "user"),
        grammar_source=structured_output_source(obj),
    )


def _parse_model(obj: Mapping[str, object], served_models: Sequence[str]) -> str:
    model = get_str(obj, "model")
    if model is None:
        raise missing("model")
    check_served_model(model, served_models)
    return model


def check_served_model(model: str, served_models: Sequence[str]) -> None:
    """OpenAI's 404 ``model_not_found`` unless ``model`` is one of the served names."""
    if model not in served_models:
        raise NotFoundError(
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )


def parse_messages(obj: Mapping[str, object]) -> tuple[ChatMessage, ...]:
    raw = obj.get("messages")
    if raw is None:
        raise missing("messages")
    if not isinstance(raw, list):
        raise invalid_type("messages", "an array", raw)
    if not raw:
        raise empty_array("messages")
    out: list[ChatMessage] = []
    for i, item in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(item, dict):
            raise invalid_type(param, "an object", item)
        role = get_str(item, "role", param=f"{param}.role")
        if role is None:
            raise missing(f"{param}.role")
        if role not in CHAT_ROLES:
            supported = ", ".join(f"'{r}'" for r in CHAT_ROLES)
            raise InvalidArgumentError(
                f"Invalid value: '{role}'. Supported values are: {supported}.",
                param=f"{param}.role",
                code="invalid_value",
            )
        content = parse_content(
            item.get("content"), f"{param}.content", nullable=role == "assistant"
        )
        out.append(
            ChatMessage(
                role=role,
                content=content,
                name=get_str(item, "name", param=f"{param}.name"),
                tool_call_id=get_str(item, "tool_call_id", param=f"{param}.tool_call_id"),
                tool_calls=_message_tool_calls(item, role, param),
            )
        )
    return tuple(out)


def _message_tool_calls(item: Mapping[str, object], role: str, param: str) -> tuple[ToolCall, ...]:
    calls = parse_message_tool_calls(item.get("tool_calls"), f"{param}.tool_calls")
    if calls and role != "assistant":
        raise InvalidArgumentError("Only assistant messages may carry 'tool_calls'.",
                                   param=f"{param}.tool_calls", code="invalid_value")  # fmt: skip
    return calls


def _parse_stream(obj: Mapping[str, object]) -> tuple[bool, bool]:
    stream = get_bool(obj, "stream") or False
    options = obj.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise invalid_type("stream_options", "an object", options)
    if not stream:
        raise InvalidArgumentError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
            code="invalid_value",
        )
    include_usage = get_bool(options, "include_usage", param="stream_options.include_usage")
    return stream, bool(include_usage)


def _parse_sampling(
    obj: Mapping[str, object], *, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    """The sampling fields shared by chat and completions, validated by SamplingParams."""
    # SamplingParams.validate checks the other declared bounds (top_k's minimum, n's maximum,
    # min_tokens <= max_tokens, the floats, seed) with its own messages.
    top_k = get_int(obj, "top_k")
    if top_k is not None:
        _check_bounds(top_k, _SAMPLING["top_k"], lower=False)
    n = get_int(obj, "n")
    if n is not None:
        _check_bounds(n, _SAMPLING["n"], upper=False)
    min_tokens = get_int(obj, "min_tokens")
    if min_tokens is not None:
        _check_bounds(min_tokens, _SAMPLING["min_tokens"], upper=False)
    return SamplingParams(
        temperature=float_or(obj, "temperature", 1.0),
        top_k=0 if top_k is None else top_k,
        top_p=float_or(obj, "top_p", 1.0),
        min_p=float_or(obj, "min_p", 0.0),
        repetition_penalty=float_or(obj, "repetition_penalty", 1.0),
        presence_penalty=float_or(obj, "presence_penalty", 0.0),
        frequency_penalty=float_or(obj, "frequency_penalty", 0.0),
        seed=get_int(obj, "seed"),
        max_tokens=max_tokens,
        min_tokens=0 if min_tokens is None else min_tokens,
        stop=parse_stop(obj),
        stop_token_ids=parse_int_list(obj, "stop_token_ids", maximum=MAX_UINT32),
        ignore_eos=get_bool(obj, "ignore_eos") or False,
        logprobs=logprobs,
        n=1 if n is None else n,
        skip_special_tokens=bool_or(obj, "skip_special_tokens", True),
        logit_bias=parse_logit_bias(obj),
        cache_salt=get_str(obj, "cache_salt") or "",
        speculative=bool_or(obj, "speculative", True),
        prompt_logprobs=_bounded_int(obj, _SAMPLING["prompt_logprobs"]),
    ).validate()


def refuse_streamed_prompt_logprobs(parsed: ChatRequest | CompletionRequest) -> None:
    """400 for prompt logprobs (``prompt_logprobs``, or ``echo`` with ``logprobs``) in a streamed
    request, as vLLM: they arrive with the prefill's reply, not token by token. (A rule across
    fields, checked after parsing, as ``--max-tokens-limit`` is.)"""
    if parsed.stream and parsed.sampling.prompt_logprobs is not None:
        echoed = isinstance(parsed, CompletionRequest) and parsed.echo
        param = "echo" if echoed and parsed.sampling.logprobs is not None else "prompt_logprobs"
        what = "'echo' with 'logprobs'" if param == "echo" else "'prompt_logprobs'"
        raise InvalidArgumentError(
            f"{what} is not available when 'stream' is true; ask with stream false.",
            param=param,
            code="unsupported_parameter",
        )


def _bounded_int(obj: Mapping[str, object], field: Field) -> int | None:
    """An integer field checked against both of its declared bounds, or None when unset."""
    value = get_int(obj, field.name)
    if value is not None:
        _check_bounds(value, field)
    return value


def _check_bounds(value: int, field: Field, *, lower: bool = True, upper: bool = True) -> None:
    """400 (OpenAI's wording) outside the field's declared bounds; ``lower`` / ``upper`` False
    leaves that side to SamplingParams.validate."""
    if lower and field.minimum is not None:
        check_min(value, field.name, int(field.minimum))
    if upper and field.maximum is not None:
        check_max(value, field.name, int(field.maximum))


def _reject_unsupported(obj: Mapping[str, object], keys: Sequence[str]) -> None:
    """400 for features Tandem does not implement, when the client actually uses them."""
    for key in keys:
        value = obj.get(key)
        if value is None or value == "" or value == [] or value == {}:
            continue
        raise InvalidArgumentError(
            f"Unsupported parameter: '{key}' is not supported by this server.",
            param=key,
            code="unsupported_parameter",
        )
