"""Real grpc.aio servers on 127.0.0.1: error mapping for every RPC shape, health, reflection,
message limits, deadlines, graceful stop, and the client helpers."""

from __future__ import annotations

import asyncio
import logging
import socket
import zlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from services.common import ports
from services.common.errors import (
    AbortedError,
    DataLossError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    TandemError,
    UnavailableError,
)
from services.common.grpc_channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_KV_CHUNK_BYTES,
    MIB,
    channel_options,
    open_channel,
    wait_healthy,
)
from services.common.grpc_errors import status_to_error
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
        channel = open_channel(self.decode_address)
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
        host="127.0.0.1",
        port=0,
        grace=0.5,
    )
    prefill.decode_address = handle.address
    yield handle
    await handle.stop(0)


@pytest.fixture
async def channel(server: GrpcServerHandle) -> AsyncIterator[grpc.aio.Channel]:
    chan = open_channel(server.address)
    yield chan
    await chan.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- errors ---------------------------------------------------------------------------------------


async def test_bound_port_and_address(server: GrpcServerHandle) -> None:
    assert server.port > 0
    assert server.address == f"127.0.0.1:{server.port}"
    assert server.service_names == (TOKENIZER, DECODE, PREFILL)


async def test_unary_success_and_typed_error(channel: grpc.aio.Channel) -> None:
    stub = tokenizer_pb2_grpc.TokenizerStub(channel)
    ok = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"), timeout=5)
    assert list(ok.token_ids) == [ord("h"), ord("i")]

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="bad"), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "text must not be 'bad'"
    err = status_to_error(info.value)
    assert type(err) is InvalidArgumentError
    assert err.param == "text" and err.message == "text must not be 'bad'"


async def test_unexpected_exception_is_internal_logged_and_survived(
    channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    stub = tokenizer_pb2_grpc.TokenizerStub(channel)
    with caplog.at_level(logging.ERROR, logger="services.common.grpc_errors"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="boom"), timeout=5)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal error (ValueError): kaboom"
    logged = [r for r in caplog.records if r.exc_info and "Tokenize" in r.getMessage()]
    assert logged and isinstance(logged[0].exc_info[1], ValueError)
    assert type(status_to_error(info.value)) is TandemError

    again = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="ok"), timeout=5)
    assert again.prompt_text == "ok"


async def test_bidi_stream_errors(channel: grpc.aio.Channel) -> None:
    stub = tokenizer_pb2_grpc.TokenizerStub(channel)
    config = tokenizer_pb2.DetokenizeRequest(config=tokenizer_pb2.DetokenizeConfig())

    def ids(*tokens: int) -> Any:
        return tokenizer_pb2.DetokenizeRequest(ids=tokenizer_pb2.TokenIds(token_ids=tokens))

    texts = [r.text async for r in stub.Detokenize(iter([config, ids(72, 105)]), timeout=5)]
    assert texts == ["Hi"]

    received: list[str] = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for resp in stub.Detokenize(iter([config, ids(65, 66), ids(0)]), timeout=5):
            received.append(resp.text)
    assert received == ["AB"]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "token id 0 is not allowed"
    assert status_to_error(info.value).param == "token_ids"

    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Detokenize(iter([config, ids(1)]), timeout=5):
            pass
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal error (RuntimeError): detokenizer state broke"

    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Detokenize(iter([ids(65)]), timeout=5):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_server_stream_error_after_responses(channel: grpc.aio.Channel) -> None:
    stub = decode_pb2_grpc.DecodeStub(channel)
    done = [r async for r in stub.Generate(decode_pb2.GenerateRequest(request_id="ok"), timeout=5)]
    assert [r.finish_reason for r in done] == ["", "", "", "length"]

    got: list[int] = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for resp in stub.Generate(decode_pb2.GenerateRequest(request_id="fail"), timeout=5):
            got.extend(resp.token_ids)
    assert got == [0, 1, 2]
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert type(status_to_error(info.value)) is ResourceExhaustedError


async def test_client_stream_checksum_failure(channel: grpc.aio.Channel) -> None:
    stub = decode_pb2_grpc.DecodeStub(channel)
    data = b"\x01\x02" * 1000
    header = decode_pb2.KVTransferMessage(header=decode_pb2.KVHeader(request_id="r1"))
    good = decode_pb2.KVTransferMessage(chunk=decode_pb2.KVChunk(data=data, crc32=zlib.crc32(data)))
    bad = decode_pb2.KVTransferMessage(
        chunk=decode_pb2.KVChunk(data=data, crc32=zlib.crc32(data) ^ 1, offset=len(data))
    )
    commit = decode_pb2.KVTransferMessage(commit=decode_pb2.KVCommit(num_chunks=1))

    ack = await stub.TransferKV(iter([header, good, commit]), timeout=5)
    assert ack.accepted and ack.request_id == "r1" and ack.bytes_received == len(data)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.TransferKV(iter([header, good, bad, commit]), timeout=5)
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert info.value.details() == "chunk at offset 2000 failed its checksum"
    assert type(status_to_error(info.value)) is DataLossError


async def test_unary_typed_error_and_plain_reply(channel: grpc.aio.Channel) -> None:
    stub = decode_pb2_grpc.DecodeStub(channel)
    assert (await stub.Abort(common_pb2.AbortRequest(request_id="known"), timeout=5)).found
    assert not (await stub.Abort(common_pb2.AbortRequest(request_id="x"), timeout=5)).found
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetStats(common_pb2.StatsRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert type(status_to_error(info.value)) is NotFoundError


async def test_unimplemented_method(channel: grpc.aio.Channel) -> None:
    stub = tokenizer_pb2_grpc.TokenizerStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetModelInfo(tokenizer_pb2.ModelInfoRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "GetModelInfo" in (info.value.details() or "")


async def test_downstream_rpc_error_keeps_its_status(channel: grpc.aio.Channel) -> None:
    stub = prefill_pb2_grpc.PrefillStub(channel)
    ok = await stub.Prefill(prefill_pb2.PrefillRequest(request_id="ok"), timeout=5)
    assert ok.request_id == "ok"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Prefill(prefill_pb2.PrefillRequest(request_id="fail"), timeout=5)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == "out of KV blocks"


async def test_context_write_style_streaming() -> None:
    handle = await start_grpc_server(
        [(decode_pb2_grpc.add_DecodeServicer_to_server, WriterDecode(), DECODE)],
        host="127.0.0.1",
        port=0,
    )
    chan = open_channel(handle.address)
    try:
        stub = decode_pb2_grpc.DecodeStub(chan)
        ok = [r async for r in stub.Generate(decode_pb2.GenerateRequest(request_id="a"), timeout=5)]
        assert [(list(r.token_ids), r.finish_reason) for r in ok] == [([7], ""), ([], "stop")]
        got: list[int] = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for r in stub.Generate(decode_pb2.GenerateRequest(request_id="fail"), timeout=5):
                got.extend(r.token_ids)
        assert got == [7]
        assert info.value.code() == grpc.StatusCode.ABORTED
        assert type(status_to_error(info.value)) is AbortedError
    finally:
        await chan.close()
        await handle.stop(0)


# --- deadlines, limits ----------------------------------------------------------------------------


async def test_deadline_exceeded_cancels_the_handler(
    channel: grpc.aio.Channel, tokenizer: FakeTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    stub = tokenizer_pb2_grpc.TokenizerStub(channel)
    with caplog.at_level(logging.ERROR, logger="services.common.grpc_errors"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="slow"), timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        err = status_to_error(info.value)
        assert type(err) is UnavailableError
        assert err.message.startswith("deadline exceeded")
        await asyncio.wait_for(tokenizer.cancelled.wait(), timeout=5)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_large_messages_need_raised_limits(
    server: GrpcServerHandle, channel: grpc.aio.Channel
) -> None:
    big = "x" * (5 * MIB)  # above gRPC's 4 MiB default, both ways
    stub = tokenizer_pb2_grpc.TokenizerStub(channel)
    resp = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=big), timeout=20)
    assert len(resp.prompt_text) == len(big)

    data = bytes(MAX_KV_CHUNK_BYTES)
    chunk = decode_pb2.KVTransferMessage(
        chunk=decode_pb2.KVChunk(data=data, crc32=zlib.crc32(data))
    )
    ack = await decode_pb2_grpc.DecodeStub(channel).TransferKV(iter([chunk]), timeout=20)
    assert ack.bytes_received == MAX_KV_CHUNK_BYTES

    async with grpc.aio.insecure_channel(server.address) as default_channel:
        default_stub = tokenizer_pb2_grpc.TokenizerStub(default_channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await default_stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=big), timeout=20)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # response too big for it


def test_channel_options_carry_the_limits() -> None:
    options = dict(channel_options())
    assert options["grpc.max_send_message_length"] == DEFAULT_MAX_MESSAGE_BYTES
    assert options["grpc.max_receive_message_length"] == DEFAULT_MAX_MESSAGE_BYTES
    assert DEFAULT_MAX_MESSAGE_BYTES >= 8 * MAX_KV_CHUNK_BYTES
    assert dict(channel_options(1234))["grpc.max_receive_message_length"] == 1234


# --- health, reflection, lifecycle ----------------------------------------------------------------


async def _health_status(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


async def test_health_reports_every_service(
    server: GrpcServerHandle, channel: grpc.aio.Channel
) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    for name in ("", TOKENIZER, DECODE, PREFILL):
        assert await _health_status(channel, name) == serving
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _health_status(channel, "tandem.v1.Nope")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND

    await server.set_serving(False)
    assert await _health_status(channel, DECODE) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(UnavailableError, match="NOT_SERVING"):
        await wait_healthy(server.address, DECODE, timeout=0.3)
    await server.set_serving(True)
    await wait_healthy(server.address, DECODE, timeout=5)
    await wait_healthy(server.address, timeout=5, channel=channel)


async def test_wait_healthy_times_out_without_a_server() -> None:
    address = f"127.0.0.1:{_free_port()}"
    with pytest.raises(UnavailableError, match="not healthy after"):
        await wait_healthy(address, TOKENIZER, timeout=0.5)


async def test_server_can_start_not_serving() -> None:
    handle = await start_grpc_server(
        [(decode_pb2_grpc.add_DecodeServicer_to_server, FakeDecode(), DECODE)],
        host="127.0.0.1",
        port=0,
        serving=False,
    )
    chan = open_channel(handle.address)
    try:
        assert await _health_status(chan, DECODE) == health_pb2.HealthCheckResponse.NOT_SERVING
        await handle.set_serving(True)
        assert await _health_status(chan, "") == health_pb2.HealthCheckResponse.SERVING
    finally:
        await chan.close()
        await handle.stop(0)


async def test_reflection_lists_services_and_serves_descriptors(
    server: GrpcServerHandle, channel: grpc.aio.Channel
) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    replies = [r async for r in stub.ServerReflectionInfo(iter([request]), timeout=5)]
    names = {s.name for s in replies[0].list_services_response.service}
    assert names == {
        TOKENIZER,
        DECODE,
        PREFILL,
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }

    def describe() -> tuple[list[str], list[str]]:
        sync_channel = grpc.insecure_channel(server.address)
        try:
            db = ProtoReflectionDescriptorDatabase(sync_channel)
            proto = db.FindFileContainingSymbol("tandem.v1.Decode")
            methods = [m.name for m in proto.service[0].method]
            return list(db.get_services()), [proto.name, *methods]
        finally:
            sync_channel.close()

    services, (file_name, *methods) = await asyncio.to_thread(describe)
    assert TOKENIZER in services
    assert file_name == "tandem/v1/decode.proto"
    assert methods == ["TransferKV", "Generate", "Abort", "GetStats"]


async def test_stop_reports_not_serving_then_cancels_in_flight(tokenizer: FakeTokenizer) -> None:
    handle = await start_grpc_server(
        [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, tokenizer, TOKENIZER)],
        host="127.0.0.1",
        port=0,
    )
    chan = open_channel(handle.address)
    try:
        watch = health_pb2_grpc.HealthStub(chan).Watch(
            health_pb2.HealthCheckRequest(service=TOKENIZER), timeout=10
        )
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        slow = asyncio.ensure_future(
            tokenizer_pb2_grpc.TokenizerStub(chan).Tokenize(
                tokenizer_pb2.TokenizeRequest(text="slow"), timeout=10
            )
        )
        await asyncio.wait_for(tokenizer.started.wait(), timeout=5)
        stopping = asyncio.ensure_future(handle.stop(0.2))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await stopping
        with pytest.raises(grpc.aio.AioRpcError):
            await slow
        await asyncio.wait_for(tokenizer.cancelled.wait(), timeout=5)
        await handle.stop()  # idempotent
    finally:
        await chan.close()


async def test_busy_port_is_a_typed_error(server: GrpcServerHandle) -> None:
    with pytest.raises(UnavailableError, match="could not bind"):
        await start_grpc_server(
            [(decode_pb2_grpc.add_DecodeServicer_to_server, FakeDecode(), DECODE)],
            host="127.0.0.1",
            port=server.port,
        )


async def test_bad_arguments_are_typed_errors() -> None:
    with pytest.raises(InvalidArgumentError):
        await start_grpc_server([], host="127.0.0.1", port=0)
    spec = (decode_pb2_grpc.add_DecodeServicer_to_server, FakeDecode(), DECODE)
    with pytest.raises(InvalidArgumentError, match="duplicate"):
        await start_grpc_server([spec, spec], host="127.0.0.1", port=0)
    with pytest.raises(InvalidArgumentError):
        await start_grpc_server([spec], host="127.0.0.1", port=70000)


# --- status_to_error without server metadata, ports -----------------------------------------------


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, UnavailableError),
        (grpc.StatusCode.CANCELLED, AbortedError),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError),
        (grpc.StatusCode.DATA_LOSS, DataLossError),
        (grpc.StatusCode.UNKNOWN, TandemError),
    ],
)
def test_status_to_error_by_code(code: grpc.StatusCode, expected: type[TandemError]) -> None:
    err = status_to_error(
        grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="why")
    )
    assert type(err) is expected
    assert "why" in err.message
    assert err.param is None


def test_status_to_error_uses_server_metadata() -> None:
    trailing = grpc.aio.Metadata(
        ("tandem-error-class", "ModelLoadError"), ("tandem-error-param", "model")
    )
    err = status_to_error(
        grpc.aio.AioRpcError(
            grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), trailing, details="no file"
        )
    )
    assert type(err).__name__ == "ModelLoadError"
    assert err.param == "model" and err.message == "no file"


def test_default_ports() -> None:
    assert ports.GATEWAY_HTTP_PORT == 8000
    assert ports.TOKENIZER_GRPC_PORT == 50051
    assert [ports.prefill_grpc_port(i) for i in (0, 1)] == [50061, 50062]
    assert [ports.decode_grpc_port(i) for i in (0, 9)] == [50071, 50080]
    assert ports.prefill_metrics_port(0) == 9111 and ports.decode_metrics_port(2) == 9123
    every = [ports.GATEWAY_HTTP_PORT, ports.TOKENIZER_GRPC_PORT, ports.TOKENIZER_METRICS_PORT]
    for i in range(ports.MAX_WORKERS_PER_ROLE):
        every += [
            ports.prefill_grpc_port(i),
            ports.decode_grpc_port(i),
            ports.prefill_metrics_port(i),
            ports.decode_metrics_port(i),
        ]
    assert len(every) == len(set(every))
    with pytest.raises(InvalidArgumentError):
        ports.decode_grpc_port(ports.MAX_WORKERS_PER_ROLE)
