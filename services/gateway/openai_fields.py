"""Typed, validated reads of single fields of a decoded OpenAI request body.

Each function reads one field (or checks one value) and either returns it as the Python type the
gateway wants or raises :class:`InvalidArgumentError` (HTTP 400) in OpenAI's message style, with
``param`` naming the field and an OpenAI ``code`` (``missing_required_parameter``,
``invalid_type``, ``empty_array``, ``integer_below_min_value``, ...). ``null`` means "not set".

Why a module of its own: these readers know nothing of which request they serve, so
``openai_requests.py``, which assembles chat and completions requests from them, keeps to the
request semantics (defaults, cross-field rules, unsupported features).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from services.common.errors import InvalidArgumentError
from services.gateway.api_schema import MAX_UINT32

# --------------------------------------------------------------------------- structured fields


def require_object(body: object) -> Mapping[str, object]:
    """The request body as a JSON object; 400 for any other JSON value."""
    if not isinstance(body, dict):
        raise InvalidArgumentError(
            f"Invalid request body: expected a JSON object, but got {json_type(body)} instead.",
            param=None,
            code="invalid_type",
        )
    return body


def parse_content(raw: object, param: str, *, nullable: bool) -> str:
    """A message's content: a string or a list of text parts (joined with newlines)."""
    if raw is None:
        if nullable:  # an assistant turn that only called tools
            return ""
        raise missing(param)
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise invalid_type(param, "a string or an array of content parts", raw)
    if not raw:
        raise empty_array(param)
    texts: list[str] = []
    for j, part in enumerate(raw):
        part_param = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid_type(part_param, "an object", part)
        kind = get_str(part, "type", param=f"{part_param}.type")
        if kind is None:
            raise missing(f"{part_param}.type")
        if kind != "text":
            raise InvalidArgumentError(
                f"Invalid value: '{kind}'. Only 'text' content parts are supported.",
                param=f"{part_param}.type",
                code="invalid_value",
            )
        text = get_str(part, "text", param=f"{part_param}.text")
        if text is None:
            raise missing(f"{part_param}.text")
        texts.append(text)
    return "\n".join(texts)


def check_vocabulary(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """400 naming ``param[i]`` for the first id outside ``[0, vocab_size)`` (0: unknown, no check
    beyond the sign)."""
    for i, token in enumerate(ids):
        if token < 0 or (vocab_size and token >= vocab_size):
            raise InvalidArgumentError(
                f"Invalid '{param}[{i}]': token id {token} is outside the vocabulary "
                f"[0, {vocab_size}).",
                param=param,
                code="invalid_value",
            )


def parse_prompt(obj: Mapping[str, object]) -> str | tuple[int, ...]:
    """A string, ``[string]``, a list of token ids, or ``[[ids]]``; one prompt per request."""
    raw = obj.get("prompt")
    if raw is None:
        raise missing("prompt")
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
        raise invalid_type("prompt", "a string or an array of token ids", raw)
    if not raw:
        raise empty_array("prompt")
    if any(isinstance(x, (str, list)) for x in raw):
        raise InvalidArgumentError(
            "Batched prompts are not supported: send one prompt per request.",
            param="prompt",
            code="invalid_value",
        )
    ids: list[int] = []
    for i, x in enumerate(raw):
        if not isinstance(x, int) or isinstance(x, bool):
            raise invalid_type(f"prompt[{i}]", "an integer", x)
        if x < 0:
            raise InvalidArgumentError(
                f"Invalid 'prompt[{i}]': token ids must be non-negative, but got {x} instead.",
                param="prompt",
                code="invalid_value",
            )
        if x > MAX_UINT32:  # the gateway checks the vocabulary later, when it knows it
            raise InvalidArgumentError(
                f"Invalid 'prompt[{i}]': token id {x} is outside the vocabulary.",
                param="prompt",
                code="invalid_value",
            )
        ids.append(x)
    return tuple(ids)


def parse_stop(obj: Mapping[str, object]) -> tuple[str, ...]:
    """``stop``: a string or an array of strings, as a tuple (empty when unset)."""
    raw = obj.get("stop")
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,)
    if not isinstance(raw, list):
        raise invalid_type("stop", "a string or an array of strings", raw)
    for item in raw:
        if not isinstance(item, str):
            raise invalid_type("stop", "a string or an array of strings", item)
    return tuple(raw)


def parse_int_list(
    obj: Mapping[str, object], key: str, *, maximum: int | None = None
) -> tuple[int, ...]:
    """An array of integers, each at most ``maximum`` when given, as a tuple (empty when unset)."""
    raw = obj.get(key)
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise invalid_type(key, "an array of integers", raw)
    for item in raw:
        if not isinstance(item, int) or isinstance(item, bool):
            raise invalid_type(key, "an array of integers", item)
        if maximum is not None:
            check_max(item, key, maximum)
    return tuple(raw)


# --------------------------------------------------------------------------- typed field access


def json_type(value: object) -> str:
    """How OpenAI's messages name the JSON type of ``value`` (``an integer``, ``null``, ...)."""
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


def missing(param: str) -> InvalidArgumentError:
    """The error for a required field that is absent or null."""
    return InvalidArgumentError(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def invalid_type(param: str, expected: str, value: object) -> InvalidArgumentError:
    """The error for a field of the wrong JSON type."""
    return InvalidArgumentError(
        f"Invalid type for '{param}': expected {expected}, but got {json_type(value)} instead.",
        param=param,
        code="invalid_type",
    )


def empty_array(param: str) -> InvalidArgumentError:
    """The error for an array that must not be empty."""
    return InvalidArgumentError(
        f"Invalid '{param}': empty array. Expected an array with minimum length 1, but got an "
        "empty array instead.",
        param=param,
        code="empty_array",
    )


def check_min(value: int, param: str, minimum: int) -> None:
    """400 unless ``value >= minimum``."""
    if value < minimum:
        raise InvalidArgumentError(
            f"Invalid '{param}': integer below minimum value. Expected a value >= {minimum}, "
            f"but got {value} instead.",
            param=param,
            code="integer_below_min_value",
        )


def check_max(value: int, param: str, maximum: int) -> None:
    """400 unless ``value <= maximum``."""
    if value > maximum:
        raise InvalidArgumentError(
            f"Invalid '{param}': integer above maximum value. Expected a value <= {maximum}, "
            f"but got {value} instead.",
            param=param,
            code="integer_above_max_value",
        )


def check_range(value: int, param: str, minimum: int, maximum: int) -> None:
    """400 unless ``minimum <= value <= maximum``."""
    check_min(value, param, minimum)
    check_max(value, param, maximum)


def get_str(obj: Mapping[str, object], key: str, *, param: str | None = None) -> str | None:
    """A string field, or None when unset."""
    value = obj.get(key)
    if value is None or isinstance(value, str):
        return value
    raise invalid_type(param or key, "a string", value)


def get_bool(obj: Mapping[str, object], key: str, *, param: str | None = None) -> bool | None:
    """A boolean field, or None when unset."""
    value = obj.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise invalid_type(param or key, "a boolean", value)


def bool_or(obj: Mapping[str, object], key: str, default: bool) -> bool:
    """A boolean field, or ``default`` when unset."""
    value = get_bool(obj, key)
    return default if value is None else value


def get_int(obj: Mapping[str, object], key: str) -> int | None:
    """An integer field (booleans are refused), or None when unset."""
    value = obj.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise invalid_type(key, "an integer", value)


def float_or(obj: Mapping[str, object], key: str, default: float) -> float:
    """A number field as a float (booleans are refused), or ``default`` when unset."""
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise invalid_type(key, "a decimal", value)
    try:
        return float(value)
    except OverflowError:  # an integer literal beyond any float: infinite, refused by the caller
        return math.inf if value > 0 else -math.inf
