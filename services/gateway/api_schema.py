"""The JSON bodies of the gateway's POST routes, declared once as data.

Each :class:`Body` lists its :class:`Field` values (name, JSON type, bounds, enum, default,
nullability, description, and whether Tandem refuses the feature). Three readers share these
declarations, so they cannot drift apart:

1. the parsers (``openai_requests.py``, ``openai_fields.py``, ``token_routes.py``) take from them
   the known fields (``/tokenize`` and ``/detokenize`` refuse any other), the refused features
   and the integer limits they check;
2. ``openapi.py`` builds the request schemas of ``GET /openapi.json`` from them;
3. tests/test_openapi.py checks that the keys each parser reads are exactly the declared ones and
   probes every declared bound against the parser.

Conventions:

- ``null`` means "not set" for every optional field, so each optional field is nullable.
- Unknown fields are ignored on ``/v1`` routes (``additionalProperties: true``: clients send
  many), refused with 400 ``unknown_parameter`` on ``/tokenize`` and ``/detokenize`` (as vLLM).
- Refused features (``tools``, ``suffix``, ...) are declared with ``unsupported=True``: an
  empty value (``null``, ``""``, ``[]``, ``{}``) is accepted, anything else is 400
  ``unsupported_parameter``; the schema allows only the empty values.
- Bounds the engine checks (``SamplingParams.validate``) come from ``sampling_params.py``; the
  others are the gateway's own, among them the protobuf widths (int32 counts, uint32 token ids)
  that keep an oversized integer a 400 instead of a failed gRPC call.
- Rules that span fields (``min_tokens <= max_tokens``, ``top_logprobs`` needs ``logprobs``,
  ``stream_options`` needs ``stream``, ``best_of == n``, the context window) are stated in the
  descriptions and answered with 400; a schema alone cannot express them all.
- ``#/components/schemas/ModelName`` and ``#/components/schemas/TokenId`` are referenced, not
  defined, here: ``openapi.py`` fills them in from the served model (its names, its vocabulary).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.common.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    SEED_END,
    SEED_MIN,
    SamplingParams,
)

JsonSchema = dict[str, Any]

CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "developer", "tool")
MAX_INT32 = 2**31 - 1  # the proto width of every token count (max_tokens, top_k, ...)
MAX_UINT32 = 2**32 - 1  # the proto width of a token id
MAX_COMPLETION_LOGPROBS = 5
MAX_TOOLS = 128
COMPLETION_DEFAULT_MAX_TOKENS = 16

MODEL_NAME_REF: JsonSchema = {"$ref": "#/components/schemas/ModelName"}
TOKEN_ID_REF: JsonSchema = {"$ref": "#/components/schemas/TokenId"}
_EMPTY_VALUES: tuple[JsonSchema, ...] = (
    {"type": "null"}, {"const": ""}, {"type": "array", "maxItems": 0},
    {"type": "object", "maxProperties": 0},
)  # fmt: skip
_DEFAULTS = SamplingParams()


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a request body.

    Attributes:
        type: a JSON type (``integer``, ``number``, ``boolean``, ``string``), or ``json`` for a
            composite value whose schema is ``schema``.
        required: the body must carry it (and not as ``null``).
        nullable: ``null`` is accepted and means "not set" (every optional field by default).
        minimum / maximum: inclusive bounds; ``exclusive_minimum`` makes the lower one strict.
        default: the value used when the field is absent or ``null`` (None: none to document).
        unsupported: a feature Tandem refuses (see the module docstring).
    """

    name: str
    type: str
    description: str
    required: bool = False
    nullable: bool = True
    minimum: int | float | None = None
    maximum: int | float | None = None
    exclusive_minimum: bool = False
    default: object = None
    enum: tuple[str, ...] = ()
    schema: Mapping[str, Any] | None = None
    unsupported: bool = False

    def json_schema(self) -> JsonSchema:
        """The field's JSON Schema (2020-12, as OpenAPI 3.1 uses)."""
        nullable = self.nullable and not self.required
        if self.unsupported:
            out: JsonSchema = {"anyOf": [*_EMPTY_VALUES, *([self.schema] if self.schema else [])]}
        elif self.schema is not None:
            value = dict(self.schema)
            out = {"anyOf": [value, {"type": "null"}]} if nullable else value
        else:
            out = {"type": [self.type, "null"] if nullable else self.type}
            if self.enum:
                out["enum"] = [*self.enum, *([None] if nullable else [])]
            if self.minimum is not None:
                out["exclusiveMinimum" if self.exclusive_minimum else "minimum"] = self.minimum
            if self.maximum is not None:
                out["maximum"] = self.maximum
        if self.default is not None:
            out["default"] = self.default
        out["description"] = self.description
        return out


@dataclass(frozen=True, slots=True)
class Body:
    """A JSON object a route reads: its fields and what it does with others.

    Attributes:
        name: the schema's name under ``#/components/schemas``.
        additional_properties: True when unknown fields are ignored, False when they are 400.
        exactly_one_of: field names of which the body must hold exactly one.
    """

    name: str
    description: str
    fields: tuple[Field, ...]
    additional_properties: bool = True
    exactly_one_of: tuple[str, ...] = ()

    def __getitem__(self, name: str) -> Field:
        for field in self.fields:
            if field.name == name:
                return field
        raise KeyError(name)

    @property
    def names(self) -> frozenset[str]:
        """Every field the parser recognises."""
        return frozenset(f.name for f in self.fields)

    @property
    def unsupported(self) -> tuple[str, ...]:
        """The refused features, in declaration order."""
        return tuple(f.name for f in self.fields if f.unsupported)

    def json_schema(self) -> JsonSchema:
        out: JsonSchema = {
            "type": "object",
            "description": self.description,
            "properties": {f.name: f.json_schema() for f in self.fields},
            "additionalProperties": self.additional_properties,
        }
        required = [f.name for f in self.fields if f.required]
        if required:
            out["required"] = required
        if self.exactly_one_of:
            out["oneOf"] = [{"required": [name]} for name in self.exactly_one_of]
        return out


def _ref(body: Body) -> JsonSchema:
    return {"$ref": f"#/components/schemas/{body.name}"}


# --------------------------------------------------------------------------- nested objects

TEXT_PART = Body(
    "TextContentPart",
    "A content part. Only text parts are supported; any other type is 400.",
    (
        Field("type", "string", "The part's type.", required=True, enum=("text",)),
        Field("text", "string", "The text.", required=True),
    ),
)

CONTENT_SCHEMA: JsonSchema = {
    "anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _ref(TEXT_PART)}]
}

CHAT_MESSAGE = Body(
    "ChatMessage",
    "One conversation turn. Content parts are joined with newlines; unknown keys are ignored.",
    (
        Field("role", "string", "Who speaks.", required=True, enum=CHAT_ROLES),
        Field("content", "json", "The text, or an array of text parts; null only for an "
              "assistant turn (one that only called tools).", schema=CONTENT_SCHEMA),
        Field("name", "string", "An optional participant name, passed to the chat template."),
        Field("tool_call_id", "string", "For a tool message: the call it answers."),
        Field("tool_calls", "json", "For an assistant message: the calls it made (kept in the "
              "history the template renders).", schema={"type": "array", "items": {
                  "type": "object", "required": ["function"], "properties": {
                      "id": {"type": ["string", "null"]}, "type": {"const": "function"},
                      "function": {"type": "object", "required": ["name"], "properties": {
                          "name": {"type": "string"}, "arguments": {"type": "string"}}}}}}),
    ),
)  # fmt: skip

STREAM_OPTIONS = Body(
    "StreamOptions",
    "Streaming options; only allowed when stream is true.",
    (Field("include_usage", "boolean", "Send a last chunk with usage and no choices.",
           default=False),),  # fmt: skip
)


def chat_message_schema() -> JsonSchema:
    """``ChatMessage`` as JSON Schema: an assistant turn may omit content, the others may not."""
    fields = {f.name: f.json_schema() for f in CHAT_MESSAGE.fields}
    others = [r for r in CHAT_ROLES if r != "assistant"]
    content = {**CONTENT_SCHEMA, "description": CHAT_MESSAGE["content"].description}
    common = {"type": "object", "description": CHAT_MESSAGE.description,
              "additionalProperties": True}  # fmt: skip
    return {
        "anyOf": [
            {**common, "required": ["role", "content"],
             "properties": {**fields, "role": {"type": "string", "enum": others},
                            "content": content}},
            {**common, "required": ["role"],
             "properties": {**fields, "role": {"type": "string", "const": "assistant"}}},
        ],
    }  # fmt: skip


# --------------------------------------------------------------------------- shared fields

_MODEL = Field("model", "json", "The served model's name (GET /v1/models); another is 404 "
               "model_not_found.", required=True, schema=MODEL_NAME_REF)  # fmt: skip
_STREAM = Field("stream", "boolean", "Answer with server-sent events (text/event-stream): "
                "one chunk object per event, then `data: [DONE]`.", default=False)  # fmt: skip
_STREAM_OPTIONS = Field("stream_options", "json", STREAM_OPTIONS.description,
                        schema=_ref(STREAM_OPTIONS))  # fmt: skip
_USER = Field("user", "string", "An end-user id, for the logs; not used otherwise.")

SAMPLING_FIELDS: tuple[Field, ...] = (
    Field("temperature", "number", "0 is greedy.", minimum=0.0, maximum=MAX_TEMPERATURE,
          default=_DEFAULTS.temperature),
    Field("top_p", "number", "Nucleus sampling mass; 1 disables.", minimum=0.0,
          exclusive_minimum=True, maximum=1.0, default=_DEFAULTS.top_p),
    Field("top_k", "integer", "Keep the k most likely tokens; 0 or -1 disables.", minimum=-1,
          maximum=MAX_INT32, default=_DEFAULTS.top_k),
    Field("min_p", "number", "Drop tokens below min_p times the top probability; 0 disables.",
          minimum=0.0, maximum=1.0, default=_DEFAULTS.min_p),
    Field("repetition_penalty", "number", "Above 1 discourages tokens already in the prompt or "
          "the output (Hugging Face semantics); 1 disables.", minimum=0.0,
          exclusive_minimum=True, maximum=MAX_REPETITION_PENALTY,
          default=_DEFAULTS.repetition_penalty),
    Field("presence_penalty", "number", "OpenAI semantics.", minimum=-MAX_PENALTY,
          maximum=MAX_PENALTY, default=_DEFAULTS.presence_penalty),
    Field("frequency_penalty", "number", "OpenAI semantics.", minimum=-MAX_PENALTY,
          maximum=MAX_PENALTY, default=_DEFAULTS.frequency_penalty),
    Field("seed", "integer", "The same seed gives the same tokens whatever else is batched; "
          "64 bits, signed or not.", minimum=SEED_MIN, maximum=SEED_END - 1),
    Field("min_tokens", "integer", "EOS and stop_token_ids cannot end generation before this "
          "many tokens; at most max_tokens.", minimum=0, maximum=MAX_INT32,
          default=_DEFAULTS.min_tokens),
    Field("stop", "json", f"Up to {MAX_STOP_STRINGS} non-empty strings of at most "
          f"{MAX_STOP_CHARS} characters that end generation (not included in the output).",
          schema={"anyOf": [
              {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
              {"type": "array", "maxItems": MAX_STOP_STRINGS,
               "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}}]}),
    Field("stop_token_ids", "json", f"Up to {MAX_STOP_TOKEN_IDS} token ids that end generation "
          "besides EOS.", schema={"type": "array", "maxItems": MAX_STOP_TOKEN_IDS,
                                  "items": {"type": "integer", "minimum": 0,
                                            "maximum": MAX_UINT32}}),
    Field("ignore_eos", "boolean", "Keep generating past EOS.", default=_DEFAULTS.ignore_eos),
    Field("n", "integer", "How many choices to generate for the prompt.", minimum=1,
          maximum=MAX_N, default=_DEFAULTS.n),
    Field("skip_special_tokens", "boolean", "Drop special tokens from the output text.",
          default=_DEFAULTS.skip_special_tokens),
    Field("cache_salt", "string", "vLLM's per-tenant prefix-cache salt: this request shares "
          "cached prompt blocks only with requests of the same salt, so another tenant can "
          "neither reuse nor detect its prompt. At most 256 characters; unset: the shared "
          "cache."),
    Field("prompt_logprobs", "integer", "vLLM's field: every prompt token's logprob given the "
          "tokens before it, its rank and this many most likely alternatives (not streamed; "
          "the prompt is then computed whole, not read from the prefix cache).", minimum=0,
          maximum=MAX_TOP_LOGPROBS),
    Field("speculative", "boolean", "Tandem's extension: false decodes this request one token "
          "per step on a worker running speculative decoding (--speculative). Speculation "
          "never changes greedy output nor a seeded request's text.",
          default=_DEFAULTS.speculative),
)  # fmt: skip


_JSON_SCHEMA_VALUE: JsonSchema = {"anyOf": [{"type": "object"}, {"type": "boolean"}]}
RESPONSE_FORMAT_SCHEMA: JsonSchema = {
    "oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
        {"type": "object", "required": ["type"],
         "properties": {"type": {"const": "json_object"}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "description": {"type": "string"},
                "schema": _JSON_SCHEMA_VALUE, "strict": {"type": ["boolean", "null"]}}}}},
    ],
}  # fmt: skip
_CHOICES: JsonSchema = {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}
STRUCTURED_OUTPUTS_SCHEMA: JsonSchema = {
    "type": "object", "minProperties": 1,
    "description": "vLLM's structured_outputs: exactly one of json, regex, choice, grammar.",
    "properties": {
        "json": {"anyOf": [_JSON_SCHEMA_VALUE, {"type": "string"}]},
        "regex": {"type": "string", "minLength": 1},
        "choice": _CHOICES,
        "grammar": {"type": "string", "minLength": 1},
    },
}  # fmt: skip

STRUCTURED_FIELDS: tuple[Field, ...] = (
    Field("response_format", "json", "Constrain the output: {\"type\": \"text\"} (none), "
          "\"json_object\" (any JSON object) or \"json_schema\" with json_schema.schema (the "
          "output validates against it). A schema the grammar library rejects is 400.",
          schema=RESPONSE_FORMAT_SCHEMA),
    Field("structured_outputs", "json", "vLLM's form: exactly one of json (a schema), regex, "
          "choice (strings) and grammar (Lark, or GBNF). At most one output constraint per "
          "request.", schema=STRUCTURED_OUTPUTS_SCHEMA),
    Field("guided_json", "json", "vLLM's older form of structured_outputs.json.",
          schema={"anyOf": [_JSON_SCHEMA_VALUE, {"type": "string"}]}),
    Field("guided_regex", "string", "vLLM's older form of structured_outputs.regex."),
    Field("guided_choice", "json", "vLLM's older form of structured_outputs.choice.",
          schema=_CHOICES),
    Field("guided_grammar", "string", "vLLM's older form of structured_outputs.grammar."),
    Field("logit_bias", "json", f"Token id (as a string) -> a value in [-{MAX_LOGIT_BIAS:g}, "
          f"{MAX_LOGIT_BIAS:g}] added to its logit before sampling; at most "
          f"{MAX_LOGIT_BIAS_ENTRIES} tokens, each in the vocabulary.",
          schema={"type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
                  "propertyNames": {"pattern": "^[0-9]{1,10}$"},
                  "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                           "maximum": MAX_LOGIT_BIAS}}),
)  # fmt: skip


def _unsupported(name: str, what: str, schema: JsonSchema | None = None) -> Field:
    return Field(name, "json", f"Not supported ({what}): any value but null or an empty one is "
                 "400 unsupported_parameter.", unsupported=True, schema=schema)  # fmt: skip


# --------------------------------------------------------------------------- request bodies

CHAT_COMPLETION = Body(
    "ChatCompletionRequest",
    "POST /v1/chat/completions. Unknown fields are ignored.",
    (
        _MODEL,
        Field("messages", "json", "The conversation, rendered with the model's chat template. "
              "Too long for the context: the oldest whole turns are dropped (system messages and "
              "the last user turn are kept), or 400 context_length_exceeded.", required=True,
              schema={"type": "array", "minItems": 1, "items": _ref(CHAT_MESSAGE)}),
        _STREAM,
        _STREAM_OPTIONS,
        Field("logprobs", "boolean", "Return each output token's logprob.", default=False),
        Field("top_logprobs", "integer", "Also return this many most likely alternatives per "
              "position; needs logprobs true.", minimum=0, maximum=MAX_TOP_LOGPROBS),
        Field("max_completion_tokens", "integer", "Most tokens to generate; unset: until the "
              "context is full.", minimum=1, maximum=MAX_INT32),
        Field("max_tokens", "integer", "The older name of max_completion_tokens (which wins "
              "when both are set).", minimum=1, maximum=MAX_INT32),
        *SAMPLING_FIELDS,
        _USER,
        Field("tools", "json", f"Functions the model may call (at most {MAX_TOOLS}), rendered with "
              "the model's chat template; its calls come back as message.tool_calls with "
              "finish_reason tool_calls.", schema={"type": "array", "maxItems": MAX_TOOLS,
                  "items": {"type": "object", "required": ["type", "function"], "properties": {
                      "type": {"const": "function"},
                      "function": {"type": "object", "required": ["name"], "properties": {
                          "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                          "description": {"type": "string"},
                          "parameters": {"type": "object"}}}}}}),
        Field("tool_choice", "json", "none (no tools rendered), auto (the model decides), "
              "required (always a call) or {\"type\": \"function\", \"function\": "
              "{\"name\"}} (that call); required and named are enforced by the grammar.",
              schema={"anyOf": [{"enum": ["none", "auto", "required"]},
                                {"type": "object", "required": ["type", "function"]}]}),
        Field("parallel_tool_calls", "boolean", "Allow more than one call per reply (unset: "
              "allowed); a named tool_choice always gets exactly one."),
        Field("chat_template_kwargs", "json", "vLLM's field: more variables for the model's chat "
              "template, e.g. Qwen3's {\"enable_thinking\": false}; not messages, tools or "
              "add_generation_prompt.", schema={"type": "object"}),
        _unsupported("functions", "the deprecated function calling; use tools"),
        *STRUCTURED_FIELDS,
    ),
)  # fmt: skip

COMPLETION = Body(
    "CompletionRequest",
    "POST /v1/completions. Unknown fields are ignored.",
    (
        _MODEL,
        Field("prompt", "json", "One prompt: a string, token ids, or a batch of exactly one of "
              "either. prompt plus max_tokens must fit in the context (else 400 "
              "context_length_exceeded).", required=True, schema={"anyOf": [
                  {"type": "string", "minLength": 1},
                  {"type": "array", "minItems": 1, "items": TOKEN_ID_REF},
                  {"type": "array", "minItems": 1, "maxItems": 1,
                   "items": {"type": "string", "minLength": 1}},
                  {"type": "array", "minItems": 1, "maxItems": 1,
                   "items": {"type": "array", "minItems": 1, "items": TOKEN_ID_REF}},
              ]}),
        _STREAM,
        _STREAM_OPTIONS,
        Field("logprobs", "integer", "Return each output token's logprob and this many most "
              "likely alternatives (with echo, the prompt's tokens' too; not streamed then).",
              minimum=0,
              maximum=MAX_COMPLETION_LOGPROBS),
        Field("max_tokens", "integer", "Most tokens to generate.", minimum=1, maximum=MAX_INT32,
              default=COMPLETION_DEFAULT_MAX_TOKENS),
        Field("echo", "boolean", "Put the prompt's text before the completion.", default=False),
        Field("best_of", "integer", "Must equal n: server-side best-of is not supported.",
              minimum=1, maximum=MAX_N),
        *SAMPLING_FIELDS,
        _USER,
        _unsupported("suffix", "insertion"),
        *STRUCTURED_FIELDS,
    ),
)  # fmt: skip

TOKENIZE = Body(
    "TokenizeRequest",
    "POST /tokenize (vLLM's): exactly one of prompt and messages; unknown fields are 400 "
    "unknown_parameter. Counts the whole prompt, without the context-window truncation of chat "
    "completions.",
    (
        Field("model", "json", "When given, the served model's name.", schema=MODEL_NAME_REF),
        Field("prompt", "string", "A text, encoded as /v1/completions would.", nullable=False),
        Field("messages", "json", "A conversation, rendered with the chat template as "
              "/v1/chat/completions would.", nullable=False,
              schema={"type": "array", "minItems": 1, "items": _ref(CHAT_MESSAGE)}),
        Field("add_special_tokens", "boolean", "Add the tokenizer's special tokens (BOS); "
              "default true for prompt, false for messages (the template has them)."),
        Field("add_generation_prompt", "boolean", "End a conversation with the assistant's "
              "header.", default=True),
        Field("chat_template_kwargs", "json", "With messages: more variables for the chat "
              "template, as on /v1/chat/completions (not messages, tools or "
              "add_generation_prompt).", schema={"type": "object"}),
        Field("return_token_strs", "boolean", "Also return each token's text.", default=False),
    ),
    additional_properties=False,
    exactly_one_of=("prompt", "messages"),
)  # fmt: skip

DETOKENIZE = Body(
    "DetokenizeRequest",
    "POST /detokenize (vLLM's); unknown fields are 400 unknown_parameter.",
    (
        Field("model", "json", "When given, the served model's name.", schema=MODEL_NAME_REF),
        Field("tokens", "json", "Token ids, each in the vocabulary.", required=True,
              schema={"type": "array", "items": TOKEN_ID_REF}),
    ),
    additional_properties=False,
)  # fmt: skip

REQUEST_BODIES: tuple[Body, ...] = (CHAT_COMPLETION, COMPLETION, TOKENIZE, DETOKENIZE)
NESTED_BODIES: tuple[Body, ...] = (TEXT_PART, STREAM_OPTIONS)  # ChatMessage: chat_message_schema
