"""The body of ``POST /v1/embeddings``: its declaration (:data:`EMBEDDINGS`, a
:class:`~services.gateway.api_schema.Body` like the other routes', which ``GET /openapi.json``
documents) and its parser, which reads exactly the declared fields.

OpenAI's shape: ``input`` is a string, an array of strings, an array of token ids, or an array of
token-id arrays (at most :data:`MAX_INPUTS` items, none empty); ``dimensions`` keeps that many
leading dimensions (checked against the model's size by the worker); ``encoding_format`` is
``float`` or ``base64`` (little-endian float32 bytes); ``user`` is accepted and unused. Unknown
fields are ignored, as on the other ``/v1`` routes. Every refusal is an InvalidArgumentError
naming its field (400), an unknown model a NotFoundError (404).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.errors import InvalidArgumentError
from services.gateway.api_schema import (
    MAX_INT32,
    MAX_UINT32,
    MODEL_NAME_REF,
    TOKEN_ID_REF,
    Body,
    Field,
)
from services.gateway.openai_fields import (
    check_range,
    empty_array,
    get_int,
    get_str,
    invalid_type,
    missing,
    require_object,
)
from services.gateway.openai_requests import check_served_model

MAX_INPUTS = 2048
"""Most items in one ``input`` array (OpenAI's limit)."""
ENCODING_FORMATS = ("float", "base64")

_TEXT = {"type": "string", "minLength": 1}
_IDS = {"type": "array", "minItems": 1, "items": TOKEN_ID_REF}
INPUT_SCHEMA = {
    "anyOf": [
        _TEXT,
        {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": _TEXT},
        _IDS,
        {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": _IDS},
    ]
}

EMBEDDINGS = Body(
    "CreateEmbeddingRequest",
    "POST /v1/embeddings: pooled final hidden states of each input (the model's pooling: last "
    "token or mean, L2-normalised unless the model's sentence-transformers config says "
    "otherwise). Unknown fields are ignored.",
    (
        Field("model", "json", "The served model's name (GET /v1/models); another is 404 "
              "model_not_found.", required=True, schema=MODEL_NAME_REF),
        Field("input", "json", "A text, an array of texts, an array of token ids, or an array of "
              f"token-id arrays (at most {MAX_INPUTS} items, none empty). Each item must fit the "
              "model's context (400 context_length_exceeded, param input).", required=True,
              schema=INPUT_SCHEMA),
        Field("dimensions", "integer", "Keep this many leading dimensions, then re-normalise "
              "(Matryoshka); above the model's embedding size is 400.", minimum=1,
              maximum=MAX_INT32),
        Field("encoding_format", "string", "float: arrays of numbers; base64: each vector's "
              "little-endian float32 bytes, base64-encoded (as OpenAI).", enum=ENCODING_FORMATS,
              default="float"),
        Field("user", "string", "An end-user id; accepted and not used."),
    ),
)  # fmt: skip

EmbeddingInput = str | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """A validated ``/v1/embeddings`` body."""

    model: str
    inputs: tuple[EmbeddingInput, ...]
    dimensions: int | None = None
    encoding_format: str = "float"
    user: str | None = None

    def texts(self) -> tuple[str, ...]:
        return tuple(item for item in self.inputs if isinstance(item, str))


def parse_embedding_request(body: object, *, served_models: Sequence[str]) -> EmbeddingRequest:
    """Validate a ``/v1/embeddings`` body (see the module docstring)."""
    obj = require_object(body)
    model = get_str(obj, "model")
    if model is None:
        raise missing("model")
    check_served_model(model, served_models)
    inputs = _parse_input(obj)
    dimensions = get_int(obj, "dimensions")
    if dimensions is not None:
        check_range(dimensions, "dimensions", 1, MAX_INT32)
    encoding = get_str(obj, "encoding_format") or "float"
    if encoding not in ENCODING_FORMATS:
        raise InvalidArgumentError(
            f"Invalid 'encoding_format': expected one of {', '.join(ENCODING_FORMATS)}, but got "
            f"{encoding!r} instead.", param="encoding_format", code="invalid_value",
        )  # fmt: skip
    return EmbeddingRequest(model=model, inputs=inputs, dimensions=dimensions,
                            encoding_format=encoding, user=get_str(obj, "user"))  # fmt: skip


def _parse_input(obj: Mapping[str, object]) -> tuple[EmbeddingInput, ...]:
    raw = obj.get("input")
    if raw is None:
        raise missing("input")
    if isinstance(raw, str):
        return (_text(raw, "input"),)
    if not isinstance(raw, list):
        raise invalid_type("input", "a string or an array", raw)
    if not raw:
        raise empty_array("input")
    if all(_is_int(x) for x in raw):
        return (_token_ids(raw, "input"),)
    if len(raw) > MAX_INPUTS:
        raise InvalidArgumentError(
            f"Invalid 'input': at most {MAX_INPUTS} items per request, but got {len(raw)}.",
            param="input", code="invalid_value",
        )  # fmt: skip
    items: list[EmbeddingInput] = []
    kind = str if isinstance(raw[0], str) else list  # one kind per array, as OpenAI's schema
    for i, item in enumerate(raw):
        if not isinstance(item, kind):
            expected = "an array of strings" if kind is str else "an array of token-id arrays"
            raise invalid_type("input", expected, item)
        if isinstance(item, str):
            items.append(_text(item, f"input[{i}]"))
        else:
            if not item:
                raise empty_array("input")
            items.append(_token_ids(item, f"input[{i}]"))
    return tuple(items)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(value: str, where: str) -> str:
    if not value:
        raise InvalidArgumentError(f"Invalid '{where}': the input must not be empty.",
                                   param="input", code="invalid_value")  # fmt: skip
    return value


def _token_ids(values: list[object], where: str) -> tuple[int, ...]:
    ids: list[int] = []
    for j, x in enumerate(values):
        if not isinstance(x, int) or isinstance(x, bool):
            raise invalid_type("input", f"an integer at {where}[{j}]", x)
        if not 0 <= x <= MAX_UINT32:  # the vocabulary is checked once the gateway knows it
            raise InvalidArgumentError(
                f"Invalid '{where}[{j}]': token id {x} is outside the vocabulary.",
                param="input", code="invalid_value",
            )  # fmt: skip
        ids.append(x)
    return tuple(ids)
