"""Structured-output requests, compiled into the llguidance grammar the engine constrains with.

What clients send, in the forms the anchors accept:

* OpenAI's ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any
  JSON object) and ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (what
  the ``openai`` SDK's ``parse()``, Instructor and LangChain send);
* vLLM's ``structured_outputs`` object: exactly one of ``json`` (a schema), ``regex``, ``choice``
  (a list of strings), ``grammar`` (Lark, or GBNF as llama.cpp writes it);
* vLLM's older extra-body fields ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``.

At most one of these may constrain a request (400 otherwise). The result is one llguidance
grammar string (``SamplingParams.grammar``) that travels with the request to every worker that
samples for it. A grammar the library rejects is a 400 naming the field and the library's
message; one over :data:`~services.common.sampling_params.MAX_GRAMMAR_BYTES` is a 400 too.

Two steps, so that compiling never runs on the gateway's event loop:
:func:`structured_output_source` (cheap, at parse time) checks which constraint a request
carries, its types and its size (the *size budget*: a source over ``MAX_GRAMMAR_BYTES`` is
refused before anything compiles) and returns a :class:`GrammarSource`; :func:`compile_source` (the library's work: schema to grammar,
GBNF to Lark, the grammar's validation) runs in the gateway's grammar worker pool
(``grammar_pool.py``), under a time budget. :func:`parse_structured_output` does both at once,
for callers off the event loop.

JSON comes out compact, as ``json.dumps`` writes it (``", "`` and ``": "``, no other
whitespace): a small model left free to place whitespace spends tokens on it and can wander
(one put a lone comma on its own line); a fixed layout costs nothing and parses the same.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import MAX_GRAMMAR_BYTES
from services.gateway.api_schema import MAX_UINT32
from services.gateway.openai_fields import invalid_type

JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                               "key_separator": ": "}  # fmt: skip
"""llguidance's JSON compile options: the layout of ``json.dumps``."""

_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True, eq=False)
class GrammarSource:
    """One request's output constraint, checked but not compiled yet.

    Attributes:
        kind: ``json`` (``value`` a schema: an object or a bool), ``regex`` or ``grammar``
            (``value`` the text; Lark or GBNF), ``choice`` (``value`` a list of strings),
            ``lark`` (Lark the gateway wrote: a tool-call grammar).
        value: as ``kind`` says; plain JSON data, so it pickles to a worker process.
        param: the request field it came from (a 400 names it).
    """

    kind: str
    value: Any
    param: str

    @property
    def key(self) -> str:
        """A digest naming the compiled result: equal for equal constraints, whatever their
        key order (the compiled-grammar caches' key)."""
        text = json.dumps([self.kind, self.value], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def parse_structured_output(obj: Mapping[str, object]) -> str | None:
    """The request's output grammar, compiled here (None when unconstrained); 400 for a
    malformed or rejected one, or for more than one constraint. Compiles on the calling thread:
    the gateway's handlers use :func:`structured_output_source` and the grammar pool instead."""
    source = structured_output_source(obj)
    return None if source is None else compile_source(source)


def structured_output_source(obj: Mapping[str, object]) -> GrammarSource | None:
    """The request's output constraint, checked (types, one constraint at most, size) and not
    compiled; None when unconstrained. 400 (InvalidArgumentError) for a malformed one."""
    found: list[GrammarSource] = []
    response_format = obj.get("response_format")
    if response_format is not None:
        source = _response_format(response_format)
        if source is not None:
            found.append(source)
    structured = obj.get("structured_outputs")
    if structured is not None:
        found.append(_structured_outputs(structured))
    for kind in _STRUCTURED_KINDS:
        name = f"guided_{kind}"
        if obj.get(name) is not None:
            found.append(_source(kind, obj[name], name))
    if len(found) > 1:
        names = ", ".join(f"'{source.param.split('.')[0]}'" for source in found)
        raise InvalidArgumentError(f"Only one output constraint may be given; got {names}.",
                                   param=found[1].param.split(".")[0],
                                   code="invalid_value")  # fmt: skip
    if not found:
        return None
    return found[0]


def compile_source(source: GrammarSource) -> str:
    """The llguidance grammar of ``source`` (the library's work: run it off the event loop);
    400 naming the field when the library rejects it or the result is too large."""
    grammar = _compile(source.kind, source.value, source.param)
    _validate(grammar, _top_param(source.param))
    return grammar


def _top_param(param: str) -> str:
    """The param a rejected grammar's 400 names: the top-level field (as before the split)."""
    return param.split(".")[0]


def _response_format(value: object) -> GrammarSource | None:
    if not isinstance(value, dict):
        raise invalid_type("response_format", "an object", value)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_source({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid_type("response_format.json_schema", "an object", spec)
        schema = spec.get("schema")
        if schema is None:  # OpenAI's own default: any JSON object
            schema = {"type": "object"}
        if not isinstance(schema, (dict, bool)):
            raise invalid_type("response_format.json_schema.schema", "an object", schema)
        return _json_source(schema, "response_format.json_schema.schema")
    raise InvalidArgumentError(
        f"Invalid value: {json.dumps(kind)}. Supported values are: 'text', 'json_object' and "
        "'json_schema'.", param="response_format.type", code="invalid_value",
    )  # fmt: skip


def _structured_outputs(value: object) -> GrammarSource:
    if not isinstance(value, dict):
        raise invalid_type("structured_outputs", "an object", value)
    kinds = [k for k in _STRUCTURED_KINDS if value.get(k) is not None]
    if len(kinds) != 1:
        raise InvalidArgumentError(
            "'structured_outputs' must hold exactly one of 'json', 'regex', 'choice' and "
            "'grammar'.", param="structured_outputs", code="invalid_value",
        )  # fmt: skip
    kind = kinds[0]
    return _source(kind, value[kind], f"structured_outputs.{kind}")


def _source(kind: str, value: object, param: str) -> GrammarSource:
    """Type and size checks of one constraint (nothing compiled)."""
    if kind == "json":
        if isinstance(value, str):
            if len(value) > MAX_GRAMMAR_BYTES:
                raise _too_large(param)
            try:
                value = json.loads(value)
            except ValueError as err:
                raise InvalidArgumentError(f"'{param}' is not valid JSON: {err}", param=param,
                                           code="invalid_value") from err  # fmt: skip
        if not isinstance(value, (dict, bool)):
            raise invalid_type(param, "a JSON schema object", value)
        return _json_source(value, param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise invalid_type(param, "a non-empty array of non-empty strings", value)
        if sum(len(c) + 1 for c in value) > MAX_GRAMMAR_BYTES:
            raise _too_large(param)
        return GrammarSource(kind, list(value), param)
    if not isinstance(value, str) or not value:
        raise invalid_type(param, "a non-empty string", value)
    if len(value.encode()) > MAX_GRAMMAR_BYTES:
        raise _too_large(param)
    return GrammarSource(kind, value, param)


def _json_source(schema: dict[str, Any] | bool, param: str) -> GrammarSource:
    if len(json.dumps(schema)) > MAX_GRAMMAR_BYTES:
        raise _too_large(param)
    return GrammarSource("json", schema, param)


def _compile(kind: str, value: Any, param: str) -> str:
    import llguidance

    if kind == "json":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(value, overrides=JSON_LAYOUT)
        except ValueError as err:
            raise InvalidArgumentError(f"Invalid schema for '{param}': {err}", param=param,
                                       code="invalid_value") from err  # fmt: skip
    if kind == "choice":
        pattern = "|".join(re.escape(choice) for choice in value)
        return llguidance.LLMatcher.grammar_from_regex(f"({pattern})")
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "lark":  # Lark the gateway wrote itself (tool calls: tool_calls.py)
        return llguidance.LLMatcher.grammar_from_lark(value)
    if "::=" in value:  # GBNF, llama.cpp's grammar format
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            value = gbnf_to_lark(value)
        except Exception as err:  # noqa: BLE001 - the converter's message is the answer
            raise InvalidArgumentError(f"'{param}' is not a valid GBNF grammar: {err}",
                                       param=param, code="invalid_value") from err  # fmt: skip
    return llguidance.LLMatcher.grammar_from_lark(value)


def _validate(grammar: str, param: str) -> None:
    """The library's own check (its message is the 400's), and the size bound."""
    import llguidance

    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise _too_large(param)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        what = "Invalid tool parameters" if param == "tools" else (
            f"Invalid output constraint in '{param}'")
        raise InvalidArgumentError(f"{what}: {error.strip()}", param=param,
                                   code="invalid_value")  # fmt: skip


def _too_large(param: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"The output constraint in '{param}' is too large (over {MAX_GRAMMAR_BYTES} bytes).",
        param=param, code="invalid_value",
    )  # fmt: skip


def parse_logit_bias(obj: Mapping[str, object]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (``{"token id": bias}``) as sorted pairs; the bounds are
    SamplingParams.validate's, the vocabulary the engine's."""
    raw = obj.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise invalid_type("logit_bias", "an object mapping token ids to numbers", raw)
    out: list[tuple[int, float]] = []
    for key, value in raw.items():
        if not isinstance(key, str) or not key.isdigit() or int(key) > MAX_UINT32:
            raise InvalidArgumentError(f"Invalid key in 'logit_bias': {json.dumps(key)} is not a "
                                       "token id.", param="logit_bias", code="invalid_value")  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid_type(f"logit_bias.{key}", "a number", value)
        out.append((int(key), float(value)))
    return tuple(sorted(out))
