"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version``, shaped like vLLM's.

Clients use them to count tokens before sending (``/tokenize`` renders a chat with the model's
template exactly as ``/v1/chat/completions`` would, without truncating it) and to turn ids back
into text. Both go to the tokenizer service, are authenticated, rate limited (requests per client)
and admitted like ``/v1`` routes (their bodies read within the body budget, then an admission
slot taken for the tokenizer call), and answer errors in OpenAI's shape:

- ``/tokenize`` ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true}``, optional ``"model"`` and ``"return_token_strs"`` →
  ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` null unless asked; each
  entry as logprobs render tokens: the vocabulary's text, or ``token_id:<id>`` without one).
- ``/detokenize`` ``{"tokens": [int, ...]}``, optional ``"model"`` → ``{"prompt": str}``.
- ``/version`` → ``{"version": "<tandem's version>"}`` (no authentication, as in vLLM).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version

from aiohttp import web

from services.common.errors import InvalidArgumentError
from services.common.pb import common_pb2, tokenizer_pb2
from services.gateway.api_schema import DETOKENIZE, MAX_UINT32, TOKENIZE
from services.gateway.client_limits import check_request_rate, client_id, read_body_in_budget
from services.gateway.openai_fields import (
    bool_or,
    check_vocabulary,
    get_str,
    missing,
    parse_int_list,
    require_object,
)
from services.gateway.openai_requests import (
    check_served_model,
    parse_chat_template_kwargs,
    parse_messages,
)
from services.gateway.state import STATE_KEY, GatewayState

_TOKENIZE_KEYS = TOKENIZE.names  # declared in api_schema.py, documented by GET /openapi.json
_DETOKENIZE_KEYS = DETOKENIZE.names


async def _body(
    request: web.Request, allowed: frozenset[str], held: contextlib.ExitStack
) -> tuple[GatewayState, Mapping[str, object]]:
    """Authenticate, count the request, read and check the body, take an admission slot (the
    body lease and the slot join ``held``)."""
    state = request.app[STATE_KEY]
    api_key = state.auth.check(request.headers.get("Authorization"))
    client = client_id(api_key, request)
    check_request_rate(state, client)
    obj = require_object(await read_body_in_budget(state, request, held, client))
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise InvalidArgumentError(f"Unrecognized request argument supplied: {unknown[0]}",
                                   param=unknown[0], code="unknown_parameter")  # fmt: skip
    await state.require_model_info()  # the served names and the vocabulary come from it
    model = get_str(obj, "model")
    if model is not None:
        check_served_model(model, state.served_names)
    held.enter_context(state.admission.try_acquire(client))
    return state, obj


async def tokenize(request: web.Request) -> web.Response:
    with contextlib.ExitStack() as held:
        state, obj = await _body(request, _TOKENIZE_KEYS, held)
        return await _tokenize(state, obj)


async def _tokenize(state: GatewayState, obj: Mapping[str, object]) -> web.Response:
    if ("prompt" in obj) == ("messages" in obj):
        raise InvalidArgumentError("Give exactly one of 'prompt' and 'messages'.",
                                   param="prompt" if "messages" not in obj else "messages")
    if "messages" in obj:
        messages = [common_pb2.ChatMessage(role=m.role, content=m.content)
                    for m in parse_messages(obj)]  # fmt: skip
        kwargs = parse_chat_template_kwargs(obj)  # as a chat completion renders its messages
        call = tokenizer_pb2.TokenizeRequest(
            chat=tokenizer_pb2.ChatMessages(messages=messages),
            add_generation_prompt=bool_or(obj, "add_generation_prompt", True),
            add_special_tokens=bool_or(obj, "add_special_tokens", False),
            chat_template_kwargs_json=json.dumps(kwargs) if kwargs else "",
        )
    else:
        prompt = get_str(obj, "prompt")
        if prompt is None:
            raise missing("prompt")
        call = tokenizer_pb2.TokenizeRequest(
            text=prompt, add_special_tokens=bool_or(obj, "add_special_tokens", True))
    # Counting must not fail on a prompt too long to generate after: give it the largest
    # context the tokenizer allows, so only a prompt longer than any context is refused.
    call.context_length = 1 << 30
    reply = await state.tokenizers.tokenize(call)
    ids = list(reply.token_ids)
    strs = None
    if bool_or(obj, "return_token_strs", False):
        strs = [state.token_texts.render(t)[0] for t in ids]
    context = state.model_info.context_length if state.model_info is not None else 0
    return web.json_response({"count": len(ids), "max_model_len": context or None,
                              "tokens": ids, "token_strs": strs})  # fmt: skip


async def detokenize(request: web.Request) -> web.Response:
    with contextlib.ExitStack() as held:
        state, obj = await _body(request, _DETOKENIZE_KEYS, held)
        return await _detokenize(state, obj)


async def _detokenize(state: GatewayState, obj: Mapping[str, object]) -> web.Response:
    if obj.get("tokens") is None:
        raise missing("tokens")
    ids = parse_int_list(obj, "tokens", maximum=MAX_UINT32)
    check_vocabulary(ids, state.model_info.vocab_size if state.model_info is not None else 0,
                     "tokens")  # fmt: skip
    text = await state.tokenizers.detokenize(ids, skip_special_tokens=False)
    return web.json_response({"prompt": text})


def tandem_version() -> str:
    try:
        return version("tandem")
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "0+unknown"


async def version_route(_: web.Request) -> web.Response:
    return web.json_response({"version": tandem_version()})
