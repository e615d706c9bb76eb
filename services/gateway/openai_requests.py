"""The OpenAI wire format, inbound: request parsing and validation for the gateway.

Requests arrive as decoded JSON (``object``) and leave as frozen dataclasses holding validated
values and a :class:`SamplingParams`; anything malformed raises :class:`InvalidArgumentError`
(HTTP 400) with OpenAI's message style, ``param`` naming the field and an OpenAI ``code``
(``missing_required_parameter``, ``invalid_type``, ``invalid_value``, ...). An unknown model raises
:class:`NotFoundError` (404, code ``model_not_found``). Nothing here talks to a backend, so the
parsing is checked in isolation and nothing is computed for a bad request (SPEC §8). The
outbound half is ``openai_responses.py``.

Conventions shared with vLLM:

1. ``null`` for an optional field means "not set".
2. Chat content parts are flattened: text parts joined with ``"\\n"``; other part types are 400.
3. Chat ``max_tokens`` / ``max_completion_tokens`` unset means "until the context is full":
   ``ChatRequest.max_tokens`` is ``None`` and ``sampling.max_tokens`` holds
   :data:`UNBOUNDED_MAX_TOKENS` until the gateway caps it by the context left after the prompt.
   Completions default to 16 tokens, like OpenAI.
4. Unknown fields are ignored (clients send many); features Tandem does not implement (tools,
   structured output, logit bias, suffix, best_of) are rejected with 400 rather than ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.errors import InvalidArgumentError, NotFoundError
from services.common.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "developer", "tool")
COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_COMPLETION_LOGPROBS = 5
UNBOUNDED_MAX_TOKENS = 2**31 - 1


# --------------------------------------------------------------------------- request types


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One conversation turn with its content flattened to text."""

    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None

    def to_dict(self) -> dict[str, str]:
        """The ``{role, content[, name]}`` mapping a chat template renders."""
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

    def texts(self) -> tuple[str, ...]:
        """Every message's text, for the input safety check."""
        return tuple(m.content for m in self.messages)


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

    def texts(self) -> tuple[str, ...]:
        """The prompt text for the input safety check (token ids are checked after decoding)."""
        return (self.prompt,) if isinstance(self.prompt, str) else ()


# --------------------------------------------------------------------------- parsing


def parse_chat_request(body: object, *, served_models: Sequence[str]) -> ChatRequest:
    """Validate a chat completions body; raise InvalidArgumentError / NotFoundError."""
    obj = _require_object(body)
    model = _parse_model(obj, served_models)
    messages = _parse_messages(obj)
    _reject_unsupported(obj, ("tools", "functions", "response_format", "logit_bias"))
    stream, include_usage = _parse_stream(obj)

    want_logprobs = _get_bool(obj, "logprobs") or False
    top_logprobs = _get_int(obj, "top_logprobs")
    if top_logprobs is not None:
        if not want_logprobs:
            raise InvalidArgumentError(
                "Invalid value for 'top_logprobs': 'logprobs' must be set to true when "
                "'top_logprobs' is used.",
                param="top_logprobs",
                code="invalid_value",
            )
        _check_range(top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    logprobs = (top_logprobs or 0) if want_logprobs else None

    max_tokens = _get_int(obj, "max_completion_tokens")
    max_param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_param = _get_int(obj, "max_tokens"), "max_tokens"
    if max_tokens is not None:
        _check_min(max_tokens, max_param, 1)

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
        user=_get_str(obj, "user"),
    )


def parse_completion_request(body: object, *, served_models: Sequence[str]) -> CompletionRequest:
    """Validate a (legacy) completions body; raise InvalidArgumentError / NotFoundError."""
    obj = _require_object(body)
    model = _parse_model(obj, served_models)
    prompt = _parse_prompt(obj)
    _reject_unsupported(obj, ("suffix", "logit_bias"))
    stream, include_usage = _parse_stream(obj)

    logprobs = _get_int(obj, "logprobs")
    if logprobs is not None:
        _check_range(logprobs, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    max_tokens = _get_int(obj, "max_tokens")
    if max_tokens is None:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    _check_min(max_tokens, "max_tokens", 1)

    sampling = _parse_sampling(obj, max_tokens=max_tokens, logprobs=logprobs)
    best_of = _get_int(obj, "best_of")
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
        echo=_get_bool(obj, "echo") or False,
        user=_get_str(obj, "user"),
    )


def _require_object(body: object) -> Mapping[str, object]:
    if not isinstance(body, dict):
        raise InvalidArgumentError(
            f"Invalid request body: expected a JSON object, but got {_json_type(body)} instead.",
            param=None,
            code="invalid_type",
        )
    return body


def _parse_model(obj: Mapping[str, object], served_models: Sequence[str]) -> str:
    model = _get_str(obj, "model")
    if model is None:
        raise _missing("model")
    if model not in served_models:
        raise NotFoundError(
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    return model


def _parse_messages(obj: Mapping[str, object]) -> tuple[ChatMessage, ...]:
    raw = obj.get("messages")
    if raw is None:
        raise _missing("messages")
    if not isinstance(raw, list):
        raise _invalid_type("messages", "an array", raw)
    if not raw:
        raise _empty_array("messages")
    out: list[ChatMessage] = []
    for i, item in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(item, dict):
            raise _invalid_type(param, "an object", item)
        role = _get_str(item, "role", param=f"{param}.role")
        if role is None:
            raise _missing(f"{param}.role")
        if role not in CHAT_ROLES:
            supported = ", ".join(f"'{r}'" for r in CHAT_ROLES)
            raise InvalidArgumentError(
                f"Invalid value: '{role}'. Supported values are: {supported}.",
                param=f"{param}.role",
                code="invalid_value",
            )
        content = _parse_content(
            item.get("content"), f"{param}.content", nullable=role == "assistant"
        )
        out.append(
            ChatMessage(
                role=role,
                content=content,
                name=_get_str(item, "name", param=f"{param}.name"),
                tool_call_id=_get_str(item, "tool_call_id", param=f"{param}.tool_call_id"),
            )
        )
    return tuple(out)


def _parse_content(raw: object, param: str, *, nullable: bool) -> str:
    """A message's content: a string or a list of text parts (joined with newlines)."""
    if raw is None:
        if nullable:  # an assistant turn that only called tools
            return ""
        raise _missing(param)
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise _invalid_type(param, "a string or an array of content parts", raw)
    if not raw:
        raise _empty_array(param)
    texts: list[str] = []
    for j, part in enumerate(raw):
        part_param = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _invalid_type(part_param, "an object", part)
        kind = _get_str(part, "type", param=f"{part_param}.type")
        if kind is None:
            raise _missing(f"{part_param}.type")
        if kind != "text":
            raise InvalidArgumentError(
                f"Invalid value: '{kind}'. Only 'text' content parts are supported.",
                param=f"{part_param}.type",
                code="invalid_value",
            )
        text = _get_str(part, "text", param=f"{part_param}.text")
        if text is None:
            raise _missing(f"{part_param}.text")
        texts.append(text)
    return "\n".join(texts)


def _parse_prompt(obj: Mapping[str, object]) -> str | tuple[int, ...]:
    """A string, ``[string]``, a list of token ids, or ``[[ids]]``; one prompt per request."""
    raw = obj.get("prompt")
    if raw is None:
        raise _missing("prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # a batch of exactly one prompt
    if isinstance(raw, str):
        if not raw:
            raise InvalidArgumentError(
                "Invalid 'prompt': the prompt must not be empty.",
                param="prompt",
                code="invalid_value",
            )
        return raw
    if not isinstance(raw, list):
        raise _invalid_type("prompt", "a string or an array of token ids", raw)
    if not raw:
        raise _empty_array("prompt")
    if any(isinstance(x, (str, list)) for x in raw):
        raise InvalidArgumentError(
            "Batched prompts are not supported: send one prompt per request.",
            param="prompt",
            code="invalid_value",
        )
    ids: list[int] = []
    for i, x in enumerate(raw):
        if not isinstance(x, int) or isinstance(x, bool):
            raise _invalid_type(f"prompt[{i}]", "an integer", x)
        if x < 0:
            raise InvalidArgumentError(
                f"Invalid 'prompt[{i}]': token ids must be non-negative, but got {x} instead.",
                param="prompt",
                code="invalid_value",
            )
        ids.append(x)
    return tuple(ids)


def _parse_stream(obj: Mapping[str, object]) -> tuple[bool, bool]:
    stream = _get_bool(obj, "stream") or False
    options = obj.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise _invalid_type("stream_options", "an object", options)
    if not stream:
        raise InvalidArgumentError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
            code="invalid_value",
        )
    include_usage = _get_bool(options, "include_usage", param="stream_options.include_usage")
    return stream, bool(include_usage)


def _parse_sampling(
    obj: Mapping[str, object], *, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    """The sampling fields shared by chat and completions, validated by SamplingParams."""
    top_k = _get_int(obj, "top_k")
    n = _get_int(obj, "n")
    if n is not None:
        _check_min(n, "n", 1)
    min_tokens = _get_int(obj, "min_tokens")
    if min_tokens is not None:
        _check_min(min_tokens, "min_tokens", 0)
    return SamplingParams(
        temperature=_float_or(obj, "temperature", 1.0),
        top_k=0 if top_k is None else top_k,
        top_p=_float_or(obj, "top_p", 1.0),
        min_p=_float_or(obj, "min_p", 0.0),
        repetition_penalty=_float_or(obj, "repetition_penalty", 1.0),
        presence_penalty=_float_or(obj, "presence_penalty", 0.0),
        frequency_penalty=_float_or(obj, "frequency_penalty", 0.0),
        seed=_get_int(obj, "seed"),
        max_tokens=max_tokens,
        min_tokens=0 if min_tokens is None else min_tokens,
        stop=_parse_stop(obj),
        stop_token_ids=_parse_int_list(obj, "stop_token_ids"),
        ignore_eos=_get_bool(obj, "ignore_eos") or False,
        logprobs=logprobs,
        n=1 if n is None else n,
        skip_special_tokens=_bool_or(obj, "skip_special_tokens", True),
    ).validate()


def _parse_stop(obj: Mapping[str, object]) -> tuple[str, ...]:
    raw = obj.get("stop")
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,)
    if not isinstance(raw, list):
        raise _invalid_type("stop", "a string or an array of strings", raw)
    for item in raw:
        if not isinstance(item, str):
            raise _invalid_type("stop", "a string or an array of strings", item)
    return tuple(raw)


def _parse_int_list(obj: Mapping[str, object], key: str) -> tuple[int, ...]:
    raw = obj.get(key)
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _invalid_type(key, "an array of integers", raw)
    for item in raw:
        if not isinstance(item, int) or isinstance(item, bool):
            raise _invalid_type(key, "an array of integers", item)
    return tuple(raw)


def _reject_unsupported(obj: Mapping[str, object], keys: Sequence[str]) -> None:
    """400 for features Tandem does not implement, when the client actually uses them."""
    for key in keys:
        value = obj.get(key)
        if value is None or value == "" or value == [] or value == {}:
            continue
        if key == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        raise InvalidArgumentError(
            f"Unsupported parameter: '{key}' is not supported by this server.",
            param=key,
            code="unsupported_parameter",
        )


# --------------------------------------------------------------------------- typed field access


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _missing(param: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def _invalid_type(param: str, expected: str, value: object) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"Invalid type for '{param}': expected {expected}, but got {_json_type(value)} instead.",
        param=param,
        code="invalid_type",
    )


def _empty_array(param: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"Invalid '{param}': empty array. Expected an array with minimum length 1, but got an "
        "empty array instead.",
        param=param,
        code="empty_array",
    )


def _check_min(value: int, param: str, minimum: int) -> None:
    if value < minimum:
        raise InvalidArgumentError(
            f"Invalid '{param}': integer below minimum value. Expected a value >= {minimum}, "
            f"but got {value} instead.",
            param=param,
            code="integer_below_min_value",
        )


def _check_range(value: int, param: str, minimum: int, maximum: int) -> None:
    _check_min(value, param, minimum)
    if value > maximum:
        raise InvalidArgumentError(
            f"Invalid '{param}': integer above maximum value. Expected a value <= {maximum}, "
            f"but got {value} instead.",
            param=param,
            code="integer_above_max_value",
        )


def _get_str(obj: Mapping[str, object], key: str, *, param: str | None = None) -> str | None:
    value = obj.get(key)
    if value is None or isinstance(value, str):
        return value
    raise _invalid_type(param or key, "a string", value)


def _get_bool(obj: Mapping[str, object], key: str, *, param: str | None = None) -> bool | None:
    value = obj.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise _invalid_type(param or key, "a boolean", value)


def _bool_or(obj: Mapping[str, object], key: str, default: bool) -> bool:
    value = _get_bool(obj, key)
    return default if value is None else value


def _get_int(obj: Mapping[str, object], key: str) -> int | None:
    value = obj.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise _invalid_type(key, "an integer", value)


def _float_or(obj: Mapping[str, object], key: str, default: float) -> float:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _invalid_type(key, "a decimal", value)
    return float(value)
