"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one request flow for both.

Per request (docs/request-lifecycle.md), in order, each step refusing before any compute when it fails:

1. authenticate the API key (401) and count the request against its client's rate limit (the
   key, or the peer IP address without auth; 429 + Retry-After);
2. read and validate the body, once the global body budget holds it (429 when it does not;
   400 naming ``param``; 413 above the size limit; 408 when it arrives too slowly; 404 for an
   unknown model; 400 for a ``max_tokens`` above ``--max-tokens-limit``);
3. check the input against the safety policy (400 ``content_policy_violation``);
4. take an admission slot (429 + Retry-After when the gateway is full; nothing is queued);
5. tokenize on the tokenizer service (chat template, context window; chats with no max_tokens
   get ``--default-max-tokens``, never more than the context left after the prompt), then
   charge the client's token bucket prompt + ``n`` × ``max_tokens`` (``--rate-limit-tpm``;
   what was not generated is given back in step 8);
6. run the ``n`` choices (:class:`~services.gateway.request_run.RequestRun`), racing every wait
   against the client disconnecting;
7. answer: one JSON object, or an SSE stream opened at the first token (so failures before it
   are still proper HTTP errors), ending with an optional usage chunk and ``[DONE]``;
8. always: release the slot and the body lease, refund unused tokens, cancel what still runs
   (each choice aborts itself on its workers), and close the :class:`~services.gateway.request_log.RequestRecord` (log line + metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass

from aiohttp import web

from services.common.errors import InvalidArgumentError, TandemError
from services.common.pb import common_pb2, tokenizer_pb2
from services.common.sampling_params import SamplingParams
from services.gateway.client_limits import check_request_rate, client_id, read_body_in_budget
from services.gateway.config import GatewayConfig
from services.gateway.disconnect import watch_disconnect
from services.gateway.front import Front, FrontRenderer
from services.gateway.http_errors import INTERNAL_ERROR_MESSAGE
from services.gateway.openai_fields import check_vocabulary
from services.gateway.openai_requests import (
    ChatRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
    refuse_streamed_prompt_logprobs,
)
from services.gateway.openai_responses import new_chat_completion_id, new_completion_id, usage_dict
from services.gateway.reasoning_grammar import after_reasoning
from services.gateway.renderers import ChatRenderer, CompletionRenderer, Renderer
from services.gateway.request_log import OUTCOME_DISCONNECTED, RequestRecord
from services.gateway.request_run import RequestRun
from services.gateway.safety import content_policy_error
from services.gateway.sse import ClientDisconnected, SSEWriter, current_writer
from services.gateway.state import STATE_KEY, GatewayState
from services.gateway.tenant_salt import tenant_cache_salt
from services.gateway.tool_calls import (
    ToolsRequest,
    choose_format,
    hermes_instructions,
    hermes_text,
    template_renders_tools,
    tool_grammar_source,
)

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away


@dataclass(frozen=True, slots=True)
class _Job:
    """A validated, tokenized request ready to run."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    renderer: Renderer
    stream: bool
    include_usage: bool
    front: Front | None = None  # another API's framing (front.py); None: OpenAI's chunks


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, RequestRecord(new_chat_completion_id(), "chat"))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, RequestRecord(new_completion_id(), "completions"))


async def serve_front(
    request: web.Request, record: RequestRecord, front: Front
) -> web.StreamResponse:
    """The same flow for another API (``front.py``): its parser, renderer, framing and errors."""
    return await _serve(request, record, front)


async def _serve(
    request: web.Request, record: RequestRecord, front: Front | None = None
) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    slot = None
    charged = 0
    client = ""
    held = contextlib.ExitStack()
    try:
        header = front.authorization(request) if front else request.headers.get("Authorization")
        record.api_key = state.auth.check(header)
        client = client_id(record.api_key, request)
        check_request_rate(state, client)
        info = await state.require_model_info()
        body = await read_body_in_budget(state, request, held, client)
        parsed: ChatRequest | CompletionRequest
        if front is not None:
            parsed = front.parse(body, state.served_names)
        elif record.endpoint == "chat":
            parsed = parse_chat_request(body, served_models=state.served_names)
        else:
            parsed = parse_completion_request(body, served_models=state.served_names)
        record.model, record.stream = parsed.model, parsed.stream
        salt = tenant_cache_salt(record.api_key, parsed.sampling.cache_salt)  # tenant_salt.py
        parsed = dataclasses.replace(
            parsed, sampling=dataclasses.replace(parsed.sampling, cache_salt=salt))
        _check_max_tokens_limit(parsed, state.config)
        refuse_streamed_prompt_logprobs(parsed)
        if parsed.grammar_source is not None:  # compiled in the worker pool, not on this loop
            grammar = await state.grammars.compile(parsed.grammar_source)
            parsed = dataclasses.replace(
                parsed, sampling=dataclasses.replace(parsed.sampling, grammar=grammar))
        check_vocabulary([t for t, _ in parsed.sampling.logit_bias], info.vocab_size, "logit_bias")
        input_param = front.input_param if front else _input_param(parsed)
        await _check_input(state, parsed.texts(), input_param)
        slot = state.admission.try_acquire(client)
        state.metrics.num_requests_running.inc()
        if isinstance(parsed, ChatRequest):
            job = await _prepare_chat(state, parsed, info, record)
            if front is not None and isinstance(job.renderer, ChatRenderer):
                renderer = front.renderer(job.renderer, parsed, len(job.prompt_ids))
                job = dataclasses.replace(job, renderer=renderer, front=front)
        else:
            job = await _prepare_completion(state, parsed, info, record)
        if state.token_limiter is not None:
            cost = len(job.prompt_ids) + job.params.n * job.params.max_tokens
            state.token_limiter.acquire(client, cost)
            charged = cost
        return await _run(request, state, record, job)
    except ClientDisconnected:
        # Return rather than raise: aiohttp logs any exception a handler raises as an error with
        # a traceback, while a response for a closed connection is dropped quietly.
        record.outcome = OUTCOME_DISCONNECTED
        record.status = CLIENT_CLOSED_REQUEST
        writer = current_writer(request)
        if writer is not None and writer.prepared:
            return writer.response
        return web.Response(status=CLIENT_CLOSED_REQUEST)
    except asyncio.CancelledError:  # server shutdown past its grace period
        record.outcome = OUTCOME_DISCONNECTED
        record.status = CLIENT_CLOSED_REQUEST
        record.error = "cancelled by the server"
        raise
    except TandemError as err:
        record.fail(err.http_status, err.message, before_compute=not record.dispatched)
        if err.http_status == 429:
            state.metrics.record_throttled(err.code)
        if front is not None:
            return await front.error_response(request, err)
        raise
    except Exception as exc:
        record.fail(500, f"{type(exc).__name__}: {exc}", before_compute=False)
        if front is not None:
            logger.exception("unhandled error in %s %s", request.method, request.path)
            return await front.error_response(request, TandemError(INTERNAL_ERROR_MESSAGE))
        raise
    finally:
        held.close()
        if slot is not None:
            slot.release()
            state.metrics.num_requests_running.dec()
        if charged and state.token_limiter is not None:
            used = record.prompt_tokens + sum(c.completion_tokens for c in record.choices)
            state.token_limiter.refund(client, charged - used)
        record.close(state.metrics)


def _check_max_tokens_limit(parsed: ChatRequest | CompletionRequest, config: GatewayConfig) -> None:
    """400 for a ``max_tokens`` above ``--max-tokens-limit`` (a chat's absent one gets the
    default, which is never above the limit)."""
    limit = config.max_tokens_limit
    asked = parsed.max_tokens if isinstance(parsed, ChatRequest) else parsed.sampling.max_tokens
    if limit is not None and asked is not None and asked > limit:
        raise InvalidArgumentError(
            f"max_tokens is {asked}, but this server allows at most {limit} tokens per "
            "completion (--max-tokens-limit).",
            param="max_tokens",
            code="invalid_value",
        )


def _input_param(parsed: ChatRequest | CompletionRequest) -> str:
    return "messages" if isinstance(parsed, ChatRequest) else "prompt"


async def _check_input(state: GatewayState, texts: tuple[str, ...], param: str) -> None:
    if not texts:
        return
    verdict = await state.policy.check_input(texts)
    if not verdict.allowed:
        state.metrics.safety_blocks.labels(stage="input").inc()
        raise content_policy_error(verdict, param=param)


async def _tokenize(
    state: GatewayState, record: RequestRecord, request: tokenizer_pb2.TokenizeRequest
) -> tokenizer_pb2.TokenizeResponse:
    start = time.monotonic()
    reply = await state.tokenizers.tokenize(request)
    record.tokenize_s = time.monotonic() - start
    record.dropped_messages = reply.dropped_messages
    return reply


async def _prepare_chat(
    state: GatewayState, req: ChatRequest, info: tokenizer_pb2.ModelInfo, record: RequestRecord
) -> _Job:
    tools = req.tools if req.tools is not None and req.tools.active else None
    tool_format = choose_format(state.config.tool_call_parser, info.chat_template) if tools else None
    messages, tools_json = _chat_messages(req, tools, info.chat_template)
    params = req.sampling
    if tools is not None and tools.forced:
        if params.grammar is not None:
            raise InvalidArgumentError(
                "'tool_choice' required or named cannot be combined with another output "
                "constraint (response_format, structured_outputs).", param="tool_choice",
                code="invalid_value",
            )  # fmt: skip
        source = tool_grammar_source(tools, tool_format or "hermes", info.special_tokens)
        grammar = await state.grammars.compile(source)  # in the grammar pool, off this loop
        params = dataclasses.replace(params, grammar=grammar)
    if params.grammar is not None:  # the grammar is for the answer, not for the thinking
        params = dataclasses.replace(params, grammar=after_reasoning(
            params.grammar, state.config.reasoning_parser, info.special_tokens))  # fmt: skip
    if tools is not None:  # the call markers may be special tokens (Mistral's, Llama's tag)
        params = dataclasses.replace(params, skip_special_tokens=False)
    reply = await _tokenize(
        state,
        record,
        tokenizer_pb2.TokenizeRequest(
            chat=tokenizer_pb2.ChatMessages(messages=messages),
            add_generation_prompt=True,
            max_tokens=req.max_tokens or 1,
            truncate=state.config.truncate_chats,
            tools_json=tools_json,
            chat_template_kwargs_json=_kwargs_json(req),
        ),
    )
    ids = tuple(reply.token_ids)
    if req.max_tokens is None:
        default = state.config.default_max_tokens
        room = info.context_length - len(ids) if info.context_length else None
        if room is not None and room < 1:
            raise InvalidArgumentError(
                f"This model's maximum context length is {info.context_length} tokens and the "
                f"messages use {len(ids)}; no room is left for the completion.",
                param="messages",
                code="context_length_exceeded",
            )
        if default is not None:
            room = default if room is None else min(room, default)
        if room is not None:
            params = dataclasses.replace(params, max_tokens=room)
    renderer = ChatRenderer(request_id=record.request_id, model=req.model, n=params.n,
                            logprobs=req.logprobs, tool_format=tool_format,
                            reasoning=state.config.reasoning_parser,
                            tools=tools.tools if tools is not None else ())  # fmt: skip
    return _Job(ids, params, renderer, req.stream, req.include_usage)


def _kwargs_json(req: ChatRequest) -> str:
    """The request's ``chat_template_kwargs`` for the tokenizer ("" for none)."""
    return json.dumps(req.chat_template_kwargs) if req.chat_template_kwargs else ""


def _chat_messages(
    req: ChatRequest, tools: ToolsRequest | None, chat_template: str
) -> tuple[list[common_pb2.ChatMessage], str]:
    """The conversation for the tokenizer, and the tools for its template (JSON; "" for none).
    A template with no tool support of its own gets the tools as Hermes-style instructions in
    the system message, earlier calls as ``<tool_call>`` text and tool results as
    ``<tool_response>`` user turns (Qwen2.5's own layout)."""
    native = template_renders_tools(chat_template)
    out: list[common_pb2.ChatMessage] = []
    for m in req.messages:
        if native:
            calls = [common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                     for c in m.tool_calls]  # fmt: skip
            out.append(common_pb2.ChatMessage(role=m.role, content=m.content, name=m.name or "",
                                              tool_call_id=m.tool_call_id or "",
                                              tool_calls=calls))  # fmt: skip
        elif m.role == "tool":
            out.append(common_pb2.ChatMessage(
                role="user", content=f"<tool_response>\n{m.content}\n</tool_response>"))
        else:
            content = m.content
            if m.tool_calls:
                content = (content + "\n" if content else "") + hermes_text(m.tool_calls)
            out.append(common_pb2.ChatMessage(role=m.role, content=content, name=m.name or ""))
    if tools is None:
        return out, ""
    if native:
        return out, json.dumps([t.to_openai() for t in tools.tools])
    instructions = hermes_instructions(tools.tools)
    if out and out[0].role == "system":
        out[0].content = out[0].content + "\n\n" + instructions
    else:
        out.insert(0, common_pb2.ChatMessage(role="system", content=instructions))
    return out, ""


def chat_template_input(
    req: ChatRequest, chat_template: str
) -> tuple[list[common_pb2.ChatMessage], str]:
    """The messages and tools JSON the chat template renders for ``req``, as for its completion
    (Anthropic's ``count_tokens`` counts exactly what a reply's prompt would hold)."""
    tools = req.tools if req.tools is not None and req.tools.active else None
    return _chat_messages(req, tools, chat_template)


async def _prepare_completion(
    state: GatewayState,
    req: CompletionRequest,
    info: tokenizer_pb2.ModelInfo,
    record: RequestRecord,
) -> _Job:
    params = req.sampling
    if isinstance(req.prompt, str):
        reply = await _tokenize(
            state,
            record,
            tokenizer_pb2.TokenizeRequest(
                text=req.prompt, add_special_tokens=True, max_tokens=params.max_tokens
            ),
        )
        ids, prompt_text = tuple(reply.token_ids), req.prompt
    else:
        ids = req.prompt
        _check_ids(ids, params.max_tokens, info)
        start = time.monotonic()
        prompt_text = await state.tokenizers.detokenize(ids, skip_special_tokens=False)
        record.tokenize_s = time.monotonic() - start
        await _check_input(state, (prompt_text,), "prompt")
    renderer = CompletionRenderer(
        request_id=record.request_id,
        model=req.model,
        n=params.n,
        logprobs=params.logprobs is not None,
        echo_text=prompt_text if req.echo else None,
    )
    return _Job(ids, params, renderer, req.stream, req.include_usage)


def _check_ids(ids: tuple[int, ...], max_tokens: int, info: tokenizer_pb2.ModelInfo) -> None:
    check_vocabulary(ids, info.vocab_size, "prompt")
    if info.context_length and len(ids) + max_tokens > info.context_length:
        raise InvalidArgumentError(
            f"This model's maximum context length is {info.context_length} tokens, but the "
            f"prompt has {len(ids)} tokens and max_tokens is {max_tokens}.",
            param="prompt",
            code="context_length_exceeded",
        )


async def _run(
    request: web.Request, state: GatewayState, record: RequestRecord, job: _Job
) -> web.StreamResponse:
    record.prompt_tokens = len(job.prompt_ids)
    run = RequestRun(
        state.choice_deps(),
        request_id=record.request_id,
        prompt_ids=job.prompt_ids,
        params=job.params,
    )
    record.choices = run.stats
    record.dispatched = True
    gone = watch_disconnect(request)
    run.start()
    try:
        if job.stream:
            return await _stream(request, run, job, gone, record)
        while (event := await run.next_event(gone)) is not None:
            job.renderer.add(event)
        return web.json_response(
            job.renderer.response(_usage(record)), headers={"X-Request-Id": record.request_id}
        )
    finally:
        gone.cancel()
        await run.close()


async def _stream(
    request: web.Request,
    run: RequestRun,
    job: _Job,
    gone: asyncio.Future[object],
    record: RequestRecord,
) -> web.StreamResponse:
    event = await run.next_event(gone)  # the first token: only now commit to a 200
    writer = SSEWriter(headers={"X-Request-Id": record.request_id},
                       write_timeout_s=request.app[STATE_KEY].config.edge.sse_write_timeout_s)
    await writer.prepare(request)
    name = job.front.event_name if job.front is not None else lambda chunk: None
    for chunk in job.renderer.start_chunks():
        await writer.send_json(chunk, event=name(chunk))
    while event is not None:
        for chunk in job.renderer.event_chunks(event):
            await writer.send_json(chunk, event=name(chunk))
        event = await run.next_event(gone)
    if isinstance(job.renderer, FrontRenderer):  # the API's closing events, usage in them
        for chunk in job.renderer.end_chunks(_usage(record)):
            await writer.send_json(chunk, event=name(chunk))
        return writer.response
    if job.include_usage:
        await writer.send_json(job.renderer.usage_chunk(_usage(record)))
    await writer.send_done()
    return writer.response


def _usage(record: RequestRecord) -> dict[str, object]:
    completion = sum(c.completion_tokens for c in record.choices)
    cached = min((c.cached_tokens for c in record.choices), default=0)
    return usage_dict(record.prompt_tokens, completion, cached)
