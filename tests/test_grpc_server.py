"""Real grpc.aio servers on 127.0.0.1: message limits, deadlines, health, reflection, graceful
stop, port errors, and the client channel helpers."""

from __future__ import annotations

import asyncio
import logging
import zlib

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from services.common.errors import (
    InvalidArgumentError,
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
    decode_pb2,
    decode_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from tests.grpc_fakes import (
    DECODE,
    PREFILL,
    TOKENIZER,
    FakeDecode,
    FakeTokenizer,
    free_port,
)
from services.common.peer_roles import server_name
from tests.tls_identities import tls_for

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
    async with open_channel(server.address, tls=tls_for("prefill")) as kv_channel:
        ack = await decode_pb2_grpc.DecodeStub(kv_channel).TransferKV(iter([chunk]), timeout=20)
    assert ack.bytes_received == MAX_KV_CHUNK_BYTES

    default_options = [("grpc.ssl_target_name_override", server_name(None))]
    credentials = tls_for("gateway").channel_credentials()
    async with grpc.aio.secure_channel(server.address, credentials,
                                       options=default_options) as default_channel:
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
        await wait_healthy(server.address, DECODE, timeout=0.3, tls=tls_for("operator"))
    await server.set_serving(True)
    await wait_healthy(server.address, DECODE, timeout=5, tls=tls_for("operator"))
    await wait_healthy(server.address, timeout=5, channel=channel, tls=tls_for("operator"))


async def test_wait_healthy_times_out_without_a_server() -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(UnavailableError, match="not healthy after"):
        await wait_healthy(address, TOKENIZER, timeout=0.5, tls=tls_for("operator"))


async def test_server_can_start_not_serving() -> None:
    handle = await start_grpc_server(
        [(decode_pb2_grpc.add_DecodeServicer_to_server, FakeDecode(), DECODE)],
        tls=tls_for("decode"),
        host="127.0.0.1",
        port=0,
        serving=False,
    )
    chan = open_channel(handle.address, tls=tls_for("gateway"))
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
        sync_channel = grpc.secure_channel(
            server.address, tls_for("operator").channel_credentials(),
            options=[("grpc.ssl_target_name_override", server_name(None))])
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
    assert methods == ["Reserve", "TransferKV", "Generate", "Abort", "GetStats", "KVStore"]


async def test_stop_reports_not_serving_then_cancels_in_flight(tokenizer: FakeTokenizer) -> None:
    handle = await start_grpc_server(
        [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, tokenizer, TOKENIZER)],
        tls=tls_for("tokenizer"),
        host="127.0.0.1",
        port=0,
    )
    chan = open_channel(handle.address, tls=tls_for("gateway"))
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
            tls=tls_for("decode"), host="127.0.0.1",
            port=server.port,
        )


async def test_bad_arguments_are_typed_errors() -> None:
    with pytest.raises(InvalidArgumentError):
        await start_grpc_server([], tls=tls_for("decode"), host="127.0.0.1", port=0)
    spec = (decode_pb2_grpc.add_DecodeServicer_to_server, FakeDecode(), DECODE)
    with pytest.raises(InvalidArgumentError, match="duplicate"):
        await start_grpc_server([spec, spec], tls=tls_for("decode"), host="127.0.0.1", port=0)
    with pytest.raises(InvalidArgumentError):
        await start_grpc_server([spec], tls=tls_for("decode"), host="127.0.0.1", port=70000)
