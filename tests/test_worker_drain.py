"""A worker that drains for shutdown: on stop it reports NOT_SERVING at once (routers send it
nothing new), refuses new requests, and lets the ones it has finish within ``--grace``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli import build_parser
from services.common.errors import InvalidArgumentError
from services.common.grpc_channel import open_channel
from services.common.pb import decode_pb2, decode_pb2_grpc
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_to_proto
from services.decode.server import start_decode_worker
from services.engine.core.loaders import load_model
from services.engine.runtime.worker_options import WorkerOptions, options_from_args
from tests.tls_identities import tls_flags, tls_for


REFUSED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)  # closing: new calls fail


def _generate(stub: decode_pb2_grpc.DecodeStub, rid: str, tokens: int) -> grpc.aio.UnaryStreamCall:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return stub.Generate(decode_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=[5, 6, 7, 8, 9],
        params=sampling_params_to_proto(params)))  # fmt: skip


async def test_a_stopping_worker_finishes_its_streams_and_takes_no_new_ones(
    tiny_llama_dir: Path,
) -> None:
    model = load_model(str(tiny_llama_dir))
    handle = await start_decode_worker(
        WorkerOptions(tls=tls_for("decode"),
                      host="127.0.0.1", port=0, num_blocks=64, worker_id="drain", grace=30.0),
        loaded=model)  # fmt: skip
    channel = open_channel(handle.address, tls=tls_for("gateway"))
    try:
        stub = decode_pb2_grpc.DecodeStub(channel)
        running = _generate(stub, "long", 200)
        first = await running.read()
        assert first.token_ids
        stopping = asyncio.create_task(handle.stop())  # the worker's own --grace: 30 s
        health = health_pb2_grpc.HealthStub(channel)
        serving = True
        for _ in range(100):  # NOT_SERVING, then the listener closes: either way, not SERVING
            try:
                reply = await health.Check(
                    health_pb2.HealthCheckRequest(service="tandem.v1.Decode"))
                serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError as err:
                assert err.code() in REFUSED, err
                serving = False
            if not serving:
                break
            await asyncio.sleep(0.01)
        assert not serving
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _generate(stub, "new", 4).read()
        assert refused.value.code() in REFUSED
        rest = []
        while (message := await running.read()) is not grpc.aio.EOF:
            rest.append(message)
        assert rest[-1].finish_reason == "length"
        assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 200
        await asyncio.wait_for(stopping, 30)
    finally:
        await channel.close()
        await handle.stop(0)


def test_the_grace_flag() -> None:
    argv = ["serve", "decode", "--device", "cpu", "--grace", "12.5", *tls_flags("decode")]
    assert options_from_args(build_parser(argv).parse_args(argv), "decode").grace == 12.5
    argv = ["serve", "prefill", "--device", "cpu", *tls_flags("prefill")]
    assert options_from_args(build_parser(argv).parse_args(argv), "prefill").grace == 5.0


async def test_a_negative_grace_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="--grace"):
        await start_decode_worker(
            WorkerOptions(tls=tls_for("decode"),
                          host="127.0.0.1", port=0, num_blocks=8, grace=-1.0),
            loaded=load_model(str(tiny_llama_dir)))  # fmt: skip
