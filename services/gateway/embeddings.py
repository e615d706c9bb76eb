"""``POST /v1/embeddings``: OpenAI's embeddings, computed by the prefill workers' ``Embed`` RPC.

Embeddings need no decode: a prefill worker runs the inputs through the model and pools the
final hidden states (``services/prefill/embedding_queue.py``). The flow shares the edge of the
generation routes (``client_limits.py``, the admission slot, the token bucket, the request log):

1. authenticate the API key (401) and count the request against its client's rate limit (429);
2. read the body within the body budget (429 / 413 / 408) and validate it
   (``embedding_request.py``: 400 naming the field, 404 for an unknown model);
3. take an admission slot (429 when the gateway is full; nothing is queued);
4. tokenize each text on the tokenizer service (the tokenizer's own special tokens, as
   ``transformers`` encodes by default), check token-id inputs against the vocabulary, and every
   input against the context (400 ``context_length_exceeded``, param ``input``); charge the
   client's token bucket the inputs' tokens;
5. send all inputs in one ``Embed`` call to the least-loaded healthy prefill worker (another
   one once if it is UNAVAILABLE), racing the client disconnecting (then the call is cancelled
   and the worker drops what it still queues);
6. answer ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
   "usage"}``, each vector a float array or, with ``encoding_format: base64``, its
   little-endian float32 bytes in base64;
7. always: release the slot and the body lease, refund the tokens of a request that failed, and
   close the :class:`~services.gateway.request_log.RequestRecord` (log line + metrics).

The safety policy does not read embedding inputs: it guards what models generate and the
prompts that lead to it, and an embedding generates nothing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import struct
import time
import uuid
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from services.common.errors import InvalidArgumentError, TandemError, UnavailableError
from services.common.pb import prefill_pb2, tokenizer_pb2
from services.gateway.api_schema import JsonSchema
from services.gateway.client_limits import check_request_rate, client_id, read_body_in_budget
from services.gateway.disconnect import watch_disconnect
from services.gateway.embedding_request import (
    EMBEDDINGS,
    EmbeddingRequest,
    parse_embedding_request,
)
from services.gateway.openai_fields import check_vocabulary
from services.gateway.request_log import OUTCOME_DISCONNECTED, RequestRecord
from services.gateway.sse import ClientDisconnected
from services.gateway.state import STATE_KEY, GatewayState

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away
TOKENIZE_CONCURRENCY = 16  # Tokenize calls one request keeps in flight
EMBED_ATTEMPTS = 2  # prefill workers one request tries (the second after an UNAVAILABLE)


def new_embedding_id() -> str:
    return f"embd-{uuid.uuid4().hex}"


async def embeddings(request: web.Request) -> web.Response:
    """The route; see the module docstring."""
    state = request.app[STATE_KEY]
    record = RequestRecord(new_embedding_id(), "embeddings")
    charged = 0
    client = ""
    held = contextlib.ExitStack()
    try:
        record.api_key = state.auth.check(request.headers.get("Authorization"))
        client = client_id(record.api_key, request)
        check_request_rate(state, client)
        info = await state.require_model_info()
        body = await read_body_in_budget(state, request, held, client)
        parsed = parse_embedding_request(body, served_models=state.served_names)
        record.model = parsed.model
        held.enter_context(state.admission.try_acquire(client))
        state.metrics.num_requests_running.inc()
        held.callback(state.metrics.num_requests_running.dec)
        inputs = await _token_inputs(state, record, parsed, info)
        total = sum(len(ids) for ids in inputs)
        if state.token_limiter is not None:
            state.token_limiter.acquire(client, total)
            charged = total
        reply = await _embed(request, state, record, inputs, parsed.dimensions)
        record.prompt_tokens = reply.num_prompt_tokens
        charged = 0  # every charged token was computed
        return web.json_response(embedding_response(parsed, reply),
                                 headers={"X-Request-Id": record.request_id})  # fmt: skip
    except ClientDisconnected:
        record.outcome, record.status = OUTCOME_DISCONNECTED, CLIENT_CLOSED_REQUEST
        return web.Response(status=CLIENT_CLOSED_REQUEST)
    except asyncio.CancelledError:  # server shutdown past its grace period
        record.outcome, record.status = OUTCOME_DISCONNECTED, CLIENT_CLOSED_REQUEST
        record.error = "cancelled by the server"
        raise
    except TandemError as err:
        record.fail(err.http_status, err.message, before_compute=not record.dispatched)
        if err.http_status == 429:
            state.metrics.record_throttled(err.code)
        raise
    except Exception as exc:
        record.fail(500, f"{type(exc).__name__}: {exc}", before_compute=False)
        raise
    finally:
        held.close()
        if charged and state.token_limiter is not None:
            state.token_limiter.refund(client, charged)
        record.close(state.metrics)


async def _token_inputs(
    state: GatewayState, record: RequestRecord, parsed: EmbeddingRequest,
    info: tokenizer_pb2.ModelInfo,
) -> list[tuple[int, ...]]:  # fmt: skip
    """Every input as token ids, checked against the vocabulary and the context."""
    gate = asyncio.Semaphore(TOKENIZE_CONCURRENCY)

    async def encode(text: str) -> tuple[int, ...]:
        async with gate:  # the largest context the tokenizer allows: this route checks its own
            reply = await state.tokenizers.tokenize(tokenizer_pb2.TokenizeRequest(
                text=text, add_special_tokens=True, context_length=1 << 30))
        return tuple(reply.token_ids)

    started = time.monotonic()
    texts = [item for item in parsed.inputs if isinstance(item, str)]
    encoded = iter(await asyncio.gather(*(encode(t) for t in texts)))
    if texts:
        record.tokenize_s = time.monotonic() - started
    inputs = [next(encoded) if isinstance(item, str) else item for item in parsed.inputs]
    limit = info.context_length
    for i, ids in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input[{i}]"
        if not ids:
            raise InvalidArgumentError(f"Invalid '{where}': it has no tokens.", param="input",
                                       code="invalid_value")  # fmt: skip
        check_vocabulary(ids, info.vocab_size, "input")
        if limit and len(ids) > limit:
            raise InvalidArgumentError(
                f"This model's maximum context length is {limit} tokens, however you requested "
                f"{len(ids)} tokens in {where}. Please reduce your input.",
                param="input", code="context_length_exceeded",
            )  # fmt: skip
    return inputs


async def _embed(
    request: web.Request, state: GatewayState, record: RequestRecord,
    inputs: Sequence[tuple[int, ...]], dimensions: int | None,
) -> prefill_pb2.EmbedResponse:  # fmt: skip
    """One ``Embed`` call on a prefill worker, raced against the client leaving."""
    call = prefill_pb2.EmbedRequest(
        request_id=record.request_id, dimensions=dimensions or 0,
        inputs=[prefill_pb2.EmbedInput(token_ids=ids) for ids in inputs],
        deadline_unix=time.time() + state.config.timeouts.prefill_s,
    )  # fmt: skip
    router = state.router
    tried: set[str] = set()
    error: UnavailableError | None = None
    record.dispatched = True
    gone = watch_disconnect(request)
    try:
        for _ in range(EMBED_ATTEMPTS):
            ranked = router.ranked("prefill", exclude=tried)
            if not ranked:
                break
            worker = ranked[0]
            with router.lease(worker):
                task = asyncio.ensure_future(worker.client.embed(call))
                try:
                    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not task.done():
                        raise ClientDisconnected("the client went away")
                    return task.result()
                except UnavailableError as err:  # the next worker, if any, tries
                    router.mark_down(worker, err)
                    tried.add(worker.address)
                    error = err
                finally:
                    task.cancel()  # no-op once done; else the worker drops the queued inputs
    finally:
        gone.cancel()
    raise error or UnavailableError(
        f"no healthy prefill worker is available to compute embeddings (of "
        f"{len(router.workers('prefill'))} configured); please retry shortly",
        code="no_healthy_workers",
    )  # fmt: skip


def embedding_response(
    parsed: EmbeddingRequest, reply: prefill_pb2.EmbedResponse
) -> dict[str, Any]:
    """OpenAI's embeddings object for the worker's ``reply``."""
    data = [
        {"object": "embedding", "index": i,
         "embedding": _encode(item.values, parsed.encoding_format)}
        for i, item in enumerate(reply.embeddings)
    ]  # fmt: skip
    tokens = int(reply.num_prompt_tokens)
    return {"object": "list", "data": data, "model": parsed.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


def _encode(values: Sequence[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: little-endian float32, base64
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return list(values)


# --------------------------------------------------------------------------- GET /openapi.json


def embedding_schemas() -> dict[str, JsonSchema]:
    """The request and response schemas ``openapi.py`` documents for this route."""
    count = {"type": "integer", "minimum": 0}
    item = {
        "type": "object", "required": ["object", "index", "embedding"],
        "additionalProperties": False,
        "properties": {
            "object": {"const": "embedding"}, "index": count,
            "embedding": {"anyOf": [
                {"type": "array", "items": {"type": "number"}},
                {"type": "string", "description": "base64 of little-endian float32 values"},
            ]},
        },
    }  # fmt: skip
    response = {
        "type": "object", "required": ["object", "data", "model", "usage"],
        "additionalProperties": False,
        "description": "One vector per input, in order (index).",
        "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": item},
            "model": {"type": "string"},
            "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"],
                      "additionalProperties": False,
                      "properties": {"prompt_tokens": count, "total_tokens": count}},
        },
    }  # fmt: skip
    return {EMBEDDINGS.name: EMBEDDINGS.json_schema(), "CreateEmbeddingResponse": response}


def embeddings_operation(errors: dict[str, Any]) -> dict[str, Any]:
    """The ``/v1/embeddings`` path item; ``errors``: its documented error responses."""
    ok = {
        "description": "The embeddings. Header X-Request-Id carries the request's id.",
        "headers": {"X-Request-Id": {"schema": {"type": "string"}}},
        "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/CreateEmbeddingResponse"}}},
    }  # fmt: skip
    return {"post": {
        "summary": "Embeddings", "operationId": "createEmbedding",
        "security": [{"bearerAuth": []}],
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{EMBEDDINGS.name}"}}}},
        "responses": {"200": ok, **errors},
    }}  # fmt: skip
