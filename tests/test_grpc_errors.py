"""The error interceptor on a real grpc.aio server: typed errors become the right status for
every RPC shape (unary, server-, client- and bidi-streaming), unexpected exceptions become
INTERNAL without killing the server, and clients map statuses back to typed errors."""

from __future__ import annotations

import logging
import zlib
from typing import Any

import grpc
import grpc.aio
import pytest

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
    open_channel,
)
from services.common.grpc_errors import is_transport_failure, status_to_error
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
from tests.grpc_fakes import DECODE, PREFILL, TOKENIZER, WriterDecode
from tests.tls_identities import tls_for

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


async def test_client_stream_checksum_failure(prefill_channel: grpc.aio.Channel) -> None:
    stub = decode_pb2_grpc.DecodeStub(prefill_channel)
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
        tls=tls_for("decode"), host="127.0.0.1",
        port=0,
    )
    chan = open_channel(handle.address, tls=tls_for("gateway"))
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


def test_a_stream_removed_with_its_connection_is_a_transport_failure() -> None:
    def rpc_error(code: grpc.StatusCode, details: str, *trailing: tuple[str, str]) -> Any:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing),
                                    details=details)  # fmt: skip

    removed = rpc_error(grpc.StatusCode.UNKNOWN, "Stream removed (Socket closed)")
    assert is_transport_failure(removed)
    assert type(status_to_error(removed)) is UnavailableError
    assert is_transport_failure(rpc_error(grpc.StatusCode.UNAVAILABLE, "Connection refused"))
    # Raised by a Tandem server's code (metadata), or an unknown failure of another kind: not.
    raised = rpc_error(grpc.StatusCode.UNAVAILABLE, "stopping",
                       ("tandem-error-class", "UnavailableError"))  # fmt: skip
    assert not is_transport_failure(raised)
    assert not is_transport_failure(rpc_error(grpc.StatusCode.UNKNOWN, "Exception calling app"))
    assert type(status_to_error(rpc_error(grpc.StatusCode.UNKNOWN, "boom"))) is TandemError


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
