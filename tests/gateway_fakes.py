"""Fake tokenizer / prefill / decode gRPC services and a gateway stack over them, for
tests/test_gateway_app.py.

The fakes speak the real protos through the real server helpers (error interceptor, health), so
everything between the HTTP client and the gRPC wire is the production gateway. The fake
"model" is character-level: token id = code point, and it answers with a scripted reply one
character per token, so expected texts are exact.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from aiohttp import web

from services.common.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    TandemError,
    UnavailableError,
)
from services.common.grpc_server import GrpcServerHandle, start_grpc_server
from services.common.metrics import TandemMetrics, serve_metrics_http
from services.common.model_fingerprint import fingerprint
from services.common.pb import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.common.protocol import PROTOCOL_VERSION
from services.common.wire import sampling_params_from_proto
from services.gateway.app import build_app
from services.gateway.auth import ApiKeyAuth
from services.gateway.config import GatewayConfig
from services.gateway.edge_server import start_edge
from services.gateway.prefill_policy import PrefillPolicy
from services.gateway.safety import RuleBasedPolicy
from tests.tls_identities import tls_for

MODEL = "fake-model"
FINGERPRINT = fingerprint("fake-model:character-level", "no weights")
"""The fake model's fingerprint (services/common/model_fingerprint.py's form): every fake reports
it, as every process of a real deployment reports its model's (the gateway refuses a worker that
reports none or another: router.py)."""
CONTEXT = 2048  # room for the Hermes tool instructions a tools request adds
DEFAULT_REPLY = "Hello from the fake model, one token per character."
FRANCE_REPLY = "The capital of France is Paris. It is on the Seine."
BLOCKS_PER = 4  # tokens per fake KV block


# A Hermes tool call whose argument the phrase policy below blocks ("Paris").
TOOL_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def reply_for(prompt: str) -> str:
    if "Weather in the capital" in prompt:
        return TOOL_REPLY
    return FRANCE_REPLY if "France" in prompt else DEFAULT_REPLY


# ------------------------------------------------------------------------------------ fakes


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Character-level: ``role: content\\n`` per message, then ``assistant:`` when asked."""

    def __init__(self) -> None:
        self.address = ""
        self.requests: list[Any] = []
        self.protocol_version = PROTOCOL_VERSION
        self.model_fingerprint = FINGERPRINT
        self.delay = 0.0  # seconds each Tokenize waits before answering

    async def Tokenize(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        await asyncio.sleep(self.delay)
        if request.WhichOneof("input") == "chat":
            text = "".join(f"{m.role}: {m.content}\n" for m in request.chat.messages)
            if request.add_generation_prompt:
                text += "assistant:"
        else:
            text = request.text
        ids = [ord(c) for c in text]
        if len(ids) + request.max_tokens > CONTEXT:
            raise InvalidArgumentError(
                f"context length is {CONTEXT} tokens, prompt has {len(ids)}", param="messages"
            )
        return tokenizer_pb2.TokenizeResponse(token_ids=ids, prompt_text=text)

    async def Detokenize(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        async for message in request_iterator:
            if message.WhichOneof("kind") == "ids":
                yield tokenizer_pb2.DetokenizeResponse(
                    text="".join(chr(i) for i in message.ids.token_ids)
                )

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        return tokenizer_pb2.ModelInfo(protocol_version=self.protocol_version,
            model_fingerprint=self.model_fingerprint,
            name=MODEL, vocab_size=0x110000, context_length=CONTEXT, eos_token_ids=[2]
        )


@dataclass
class Handoff:
    """What a fake prefill hands a fake decode for one request (stands in for the KV)."""

    prompt: str
    params: Any  # SamplingParams
    blocks: int
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    def __init__(self, name: str) -> None:
        self.name = name
        self.address = ""
        self.handoffs: dict[str, Handoff] = {}
        self.blocks_in_use = 0
        self.generate_ids: list[str] = []
        self.local_prefills: list[str] = []
        self.aborted: list[str] = []
        self.cancelled: list[str] = []
        self.token_delay = 0.001
        self.fail_after: int | None = None  # raise UNAVAILABLE after this many tokens
        self.die_after: int | None = None  # "crash" after this many (not on a migrated stream)
        self.streaming = asyncio.Event()
        self.reply_text: str | None = None  # answer this to every prompt instead of reply_for's
        self.protocol_version = PROTOCOL_VERSION  # what GetStats advertises
        self.model_fingerprint = FINGERPRINT
        # Decode.Reserve: a reservation holds its blocks until the KV (or an Abort) arrives.
        self.capacity: int | None = None  # KV blocks; None: room for everything
        self.reserve_supported = True  # False: an older worker (UNIMPLEMENTED)
        self.reserve_delay = 0.0  # seconds a grant takes to answer (granted before the wait)
        self.reserve_ids: list[str] = []  # every Reserve call
        self.refused: list[str] = []
        self.lease_seconds = 30.0  # the lease every grant and renewal states
        self.renewals: list[tuple[str, float]] = []  # (request id, time.monotonic()) per renewal

    async def Reserve(self, request: Any, context: Any) -> Any:
        if not self.reserve_supported:
            return super().Reserve(request, context)  # raises NotImplementedError
        rid = request.request_id
        if request.renew:  # only a reservation still waiting for its KV
            handoff = self.handoffs.get(rid)
            if handoff is None or handoff.ready.is_set():
                raise NotFoundError(f"request {rid!r} holds no reservation here to renew")
            self.renewals.append((rid, time.monotonic()))
            return decode_pb2.ReserveResponse(request_id=rid, num_blocks=handoff.blocks,
                                              lease_seconds=self.lease_seconds)  # fmt: skip
        self.reserve_ids.append(rid)
        blocks = -(-request.num_tokens // BLOCKS_PER)
        if self.capacity is not None and self.blocks_in_use + blocks > self.capacity:
            self.refused.append(rid)
            raise ResourceExhaustedError(f"need {blocks} KV blocks, no room")
        self.handoffs[rid] = Handoff("", None, blocks)
        self.blocks_in_use += blocks
        await asyncio.sleep(self.reserve_delay)  # a client that leaves now never sees the grant
        return decode_pb2.ReserveResponse(request_id=rid, num_blocks=blocks,
                                          lease_seconds=self.lease_seconds)  # fmt: skip

    def receive(self, rid: str, prompt: str, params: Any) -> None:
        handoff = self.handoffs.setdefault(rid, Handoff(prompt, params, 0))
        handoff.prompt, handoff.params = prompt, params
        blocks = -(-len(prompt) // BLOCKS_PER)
        self.blocks_in_use += blocks - handoff.blocks  # a reservation's blocks are taken over
        handoff.blocks = blocks
        handoff.ready.set()

    def _free(self, rid: str) -> bool:
        handoff = self.handoffs.pop(rid, None)
        if handoff is None:
            return False
        self.blocks_in_use -= handoff.blocks
        return True

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        rid = request.request_id
        self.generate_ids.append(rid)
        resume = len(request.output_token_ids)  # a migrated stream: skip what was streamed
        if request.prompt_token_ids:  # local prefill: no hand-off to wait for
            self.local_prefills.append(rid)
            prompt = "".join(chr(i) for i in request.prompt_token_ids)
            self.receive(rid, prompt, sampling_params_from_proto(request.params))
        handoff = self.handoffs.setdefault(rid, Handoff("", None, 0))
        try:
            try:
                await asyncio.wait_for(handoff.ready.wait(), request.wait_for_kv_seconds)
            except TimeoutError:
                raise NotFoundError(f"no KV arrived for {rid}") from None
            params = handoff.params
            text = self.reply_text if self.reply_text is not None else reply_for(handoff.prompt)
            finish = "stop"
            for stop in params.stop:
                if stop in text:
                    text = text[: text.index(stop)]
            if len(text) > params.max_tokens:
                text, finish = text[: params.max_tokens], "length"
            self.streaming.set()
            for i, ch in enumerate(text):
                if i < resume:
                    continue
                if self.die_after is not None and i >= self.die_after and not resume:
                    # what a killed process looks like: UNAVAILABLE with no Tandem error class
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
                if self.fail_after is not None and i >= self.fail_after:
                    raise UnavailableError("decode worker lost its GPU")
                lps = []
                if params.logprobs is not None:
                    top = [common_pb2.TopLogprob(token_id=ord(ch) + j, logprob=-0.25 - j)
                           for j in range(params.logprobs)]  # fmt: skip
                    lps = [common_pb2.TokenLogprob(token_id=ord(ch), logprob=-0.25, top=top)]
                yield decode_pb2.GenerateResponse(
                    token_ids=[ord(ch)],
                    logprobs=lps,
                    text=ch,
                    finish_reason=finish if i == len(text) - 1 else "",
                    num_prompt_tokens=len(handoff.prompt),
                    completion_tokens=i + 1,
                )
                await asyncio.sleep(self.token_delay)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self._free(rid)

    async def Abort(self, request: Any, context: Any) -> Any:
        self.aborted.append(request.request_id)
        return common_pb2.AbortResponse(found=self._free(request.request_id))

    async def GetStats(self, request: Any, context: Any) -> Any:
        return common_pb2.WorkerStats(protocol_version=self.protocol_version,
            model_fingerprint=self.model_fingerprint, worker_id=self.name, role="decode", kv_blocks_in_use=self.blocks_in_use,
            kv_blocks_total=1000, num_running=len(self.handoffs),
        )  # fmt: skip


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, name: str, decoders: dict[str, FakeDecode]) -> None:
        self.name = name
        self.decoders = decoders
        self.requests: list[Any] = []
        self.aborted: list[str] = []
        self.blocks_in_use = 0
        self.error: TandemError | None = None
        self.delay = 0.005
        self.model_fingerprint = FINGERPRINT

    async def Prefill(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        params = sampling_params_from_proto(request.params)
        blocks = -(-len(request.token_ids) // BLOCKS_PER)
        self.blocks_in_use += blocks
        try:
            await asyncio.sleep(self.delay)
            prompt = "".join(chr(i) for i in request.token_ids)
            self.decoders[request.decode_address].receive(request.request_id, prompt, params)
        finally:
            self.blocks_in_use -= blocks
        return prefill_pb2.PrefillResponse(
            request_id=request.request_id, first_token_id=ord(reply_for(prompt)[0]),
            num_prompt_tokens=len(request.token_ids), num_cached_tokens=3,
            prefill_seconds=0.004, transfer_seconds=0.001, num_blocks=blocks,
        )  # fmt: skip

    async def Abort(self, request: Any, context: Any) -> Any:
        self.aborted.append(request.request_id)
        return common_pb2.AbortResponse(found=False)

    async def GetStats(self, request: Any, context: Any) -> Any:
        return common_pb2.WorkerStats(protocol_version=PROTOCOL_VERSION,
            model_fingerprint=self.model_fingerprint, worker_id=self.name, role="prefill", kv_blocks_in_use=self.blocks_in_use
        )


# ------------------------------------------------------------------------------------ stack


@dataclass
class Stack:
    url: str
    app: web.Application
    tokenizer: FakeTokenizer
    prefills: list[FakePrefill]
    decodes: list[FakeDecode]
    servers: dict[str, GrpcServerHandle]
    metrics: TandemMetrics
    tokenizers: list[FakeTokenizer] = field(default_factory=list)  # the first is ``tokenizer``
    metrics_url: str = ""  # the gateway's /metrics, on its own port as in production
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    def client(self, api_key: str = "none") -> openai.AsyncOpenAI:
        made = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)
        self.clients.append(made)
        return made

    async def metric(self, name: str) -> float:
        async with aiohttp.ClientSession() as s, s.get(self.metrics_url) as r:
            text = await r.text()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith((name + " ", name + "{"))
        )

    async def settled(self, timeout: float = 5.0) -> None:
        """Wait until no fake holds KV blocks (the leak check)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            held = [d.blocks_in_use for d in self.decodes] + [
                p.blocks_in_use for p in self.prefills
            ]
            if not any(held):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"KV blocks still in use: {held}")


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def make_stack() -> AsyncIterator[StackFactory]:
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def make(
        *, prefill: int = 1, decode: int = 1, tokenizer: int = 1,
        policy: dict[str, Any] | None = None, keys: tuple[str, ...] = (), **overrides: Any,
    ) -> Stack:  # fmt: skip
        servers: dict[str, GrpcServerHandle] = {}

        async def serve(add: Any, servicer: Any, service: str, role: str) -> str:
            handle = await start_grpc_server(
                [(add, servicer, service)], tls=tls_for(role), host="127.0.0.1", port=0, grace=0.1,
            )  # fmt: skip
            servers[handle.address] = handle
            return handle.address

        tokenizers = [FakeTokenizer() for _ in range(tokenizer)]
        for t in tokenizers:
            t.address = await serve(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, t,
                                    "tandem.v1.Tokenizer", "tokenizer")  # fmt: skip
        decoders: dict[str, FakeDecode] = {}
        decodes = [FakeDecode(f"decode-{i}") for i in range(decode)]
        for d in decodes:
            d.address = await serve(decode_pb2_grpc.add_DecodeServicer_to_server, d,
                                    "tandem.v1.Decode", "decode")  # fmt: skip
            decoders[d.address] = d
        prefills = [FakePrefill(f"prefill-{i}", decoders) for i in range(prefill)]
        prefill_addrs = [
            await serve(prefill_pb2_grpc.add_PrefillServicer_to_server, p, "tandem.v1.Prefill",
                        "prefill")
            for p in prefills
        ]  # fmt: skip
        # Every prompt goes to the prefill pool unless a test asks for conditional disaggregation.
        settings: dict[str, Any] = {"stats_interval_s": 0.2,
                                    "prefill_policy": PrefillPolicy(remote_min_tokens=0,
                                                                    max_prefill_queue=10**6)}
        settings.update(overrides)
        settings.setdefault("tokenizer_addresses", tuple(t.address for t in tokenizers))
        config = GatewayConfig(
            prefill_addresses=tuple(prefill_addrs),
            decode_addresses=tuple(decoders),
            host="127.0.0.1",
            port=0,
            **settings, tls=tls_for("gateway"),
        )
        metrics = TandemMetrics(process_metrics=False)
        safety = RuleBasedPolicy.from_dict(policy) if policy is not None else None
        app = build_app(config, auth=ApiKeyAuth(keys), policy=safety, metrics=metrics)
        runner, url = await start_edge(app, config, shutdown_grace=1.0)
        metrics_http = await serve_metrics_http(metrics, "127.0.0.1", 0)

        async def cleanup() -> None:
            for made in stack.clients:
                await made.close()
            await metrics_http.close()
            await runner.cleanup()
            for handle in servers.values():
                await handle.stop(0)

        stack = Stack(
            url, app, tokenizers[0], prefills, decodes, servers, metrics, tokenizers,
            metrics_url=metrics_http.url,
        )
        cleanups.append(cleanup)
        return stack

    yield make
    for cleanup in reversed(cleanups):
        await cleanup()


PHRASE_POLICY = {"categories": {"geo": {"terms": ["Paris"]}, "bad": {"terms": ["forbidden topic"]}}}


async def leave_mid_stream(stack: Stack) -> None:
    """Start a slow streaming chat request, read its first event (generation is under way and
    holds KV), then close the connection."""
    for decode in stack.decodes:
        decode.token_delay = 0.2
    body = {"model": MODEL, "stream": True, "max_tokens": 50,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    async with (
        aiohttp.ClientSession() as s,
        s.post(stack.url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200
        await r.content.readline()
        assert sum(d.blocks_in_use for d in stack.decodes) > 0


async def post_raw(
    url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, bytes, Any]:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=hdrs) as r:
        return r.status, await r.read(), r.headers


def sse_events(raw: bytes) -> list[Any]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
