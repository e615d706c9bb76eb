"""Small gRPC servicers built from Tandem's generated stubs, and fixtures that serve them on a
real grpc.aio server on 127.0.0.1, for tests/test_grpc_errors.py and tests/test_grpc_server.py."""

from __future__ import annotations

import asyncio
import socket
import zlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

from services.common.errors import (
    AbortedError,
    DataLossError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from services.common.grpc_channel import (
    open_channel,
)
from services.common.grpc_server import GrpcServerHandle, start_grpc_server
from services.common.pb import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from tests.tls_identities import fake_server_tls, tls_for

TOKENIZER = "tandem.v1.Tokenizer"
DECODE = "tandem.v1.Decode"
PREFILL = "tandem.v1.Prefill"


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Fails on chosen inputs; GetModelInfo is left to the generated base (unimplemented)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        text = request.text
        if text == "bad":
            raise InvalidArgumentError("text must not be 'bad'", param="text")
        if text == "boom":
            raise ValueError("kaboom\nsecret second line")
        if text == "slow":
            self.started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return tokenizer_pb2.TokenizeResponse(
            token_ids=[ord(c) for c in text[:16]], prompt_text=text
        )

    async def Detokenize(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        first = True
        async for req in request_iterator:
            kind = req.WhichOneof("kind")
            if first and kind != "config":
                raise InvalidArgumentError("the first message must be a config", param="config")
            first = False
            if kind != "ids":
                continue
            for token in req.ids.token_ids:
                if token == 0:
                    raise InvalidArgumentError("token id 0 is not allowed", param="token_ids")
                if token == 1:
                    raise RuntimeError("detokenizer state broke")
            yield tokenizer_pb2.DetokenizeResponse(text="".join(map(chr, req.ids.token_ids)))


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    async def TransferKV(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> Any:
        received = 0
        request_id = ""
        async for msg in request_iterator:
            kind = msg.WhichOneof("kind")
            if kind == "header":
                request_id = msg.header.request_id
            elif kind == "chunk":
                if zlib.crc32(msg.chunk.data) != msg.chunk.crc32:
                    raise DataLossError(f"chunk at offset {msg.chunk.offset} failed its checksum")
                received += len(msg.chunk.data)
        return decode_pb2.KVTransferAck(
            request_id=request_id, accepted=True, bytes_received=received
        )

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        for i in range(3):
            yield decode_pb2.GenerateResponse(token_ids=[i], completion_tokens=i + 1)
        if request.request_id == "fail":
            raise ResourceExhaustedError("out of KV blocks")
        yield decode_pb2.GenerateResponse(finish_reason="length", completion_tokens=3)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return common_pb2.AbortResponse(found=request.request_id == "known")

    async def GetStats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise NotFoundError("no stats yet")


class WriterDecode(FakeDecode):
    """Server streaming in the ``context.write`` style instead of an async generator."""

    async def Generate(  # type: ignore[override]
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> None:
        await context.write(decode_pb2.GenerateResponse(token_ids=[7]))
        if request.request_id == "fail":
            raise AbortedError("aborted by the client")
        await context.write(decode_pb2.GenerateResponse(finish_reason="stop"))


class ForwardingPrefill(prefill_pb2_grpc.PrefillServicer):
    """Calls Decode.Generate downstream and lets its AioRpcError escape."""

    def __init__(self) -> None:
        self.decode_address = ""

    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        channel = open_channel(self.decode_address, tls=tls_for("gateway"))
        try:
            stub = decode_pb2_grpc.DecodeStub(channel)
            async for _ in stub.Generate(decode_pb2.GenerateRequest(request_id=request.request_id)):
                pass
        finally:
            await channel.close()
        return prefill_pb2.PrefillResponse(request_id=request.request_id)


@pytest.fixture
async def tokenizer() -> FakeTokenizer:
    return FakeTokenizer()


@pytest.fixture
async def server(tokenizer: FakeTokenizer) -> AsyncIterator[GrpcServerHandle]:
    prefill = ForwardingPrefill()
    handle = await start_grpc_server(
        [
            (tokenizer_pb2_grpc.add_TokenizerServicer_to_server, tokenizer, TOKENIZER),
            (decode_pb2_grpc.add_DecodeServicer_to_server, FakeDecode(), DECODE),
            (prefill_pb2_grpc.add_PrefillServicer_to_server, prefill, PREFILL),
        ],
        tls=fake_server_tls(), host="127.0.0.1",
        port=0,
        grace=0.5,
    )
    prefill.decode_address = handle.address
    yield handle
    await handle.stop(0)


@pytest.fixture
async def channel(server: GrpcServerHandle) -> AsyncIterator[grpc.aio.Channel]:
    chan = open_channel(server.address, tls=tls_for("gateway"))
    yield chan
    await chan.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
async def prefill_channel(server: GrpcServerHandle) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to the fake server with a prefill worker's identity (may call TransferKV)."""
    chan = open_channel(server.address, tls=tls_for("prefill"))
    yield chan
    await chan.close()
