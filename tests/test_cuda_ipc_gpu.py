"""The CUDA IPC KV transport through a real mapping (marked ``gpu``; skipped without CUDA): a
real prefill worker process and decode workers in this process on one GPU (a handle cannot be
opened in the process that made it), the KV copied device to device, equal to prefill's bytes and
to a copy sent over gRPC, and every block freed afterwards. The protocol's CPU-testable parts are
tests/test_cuda_ipc.py."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from services.common.grpc_channel import open_channel, wait_healthy
from services.common.pb import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.common.prefix_hash import reservation_digest
from services.common.wire import sampling_params_to_proto
from services.engine.kv_transfer.cuda_ipc import CudaIpcEndpoint
from services.engine.runtime.worker_options import WorkerOptions
from services.engine.runtime.worker_runtime import WorkerHandle
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from tests.ports import free_ports
from tests.cuda_ipc_pair import GREEDY, Recording, prompt_of
from tests.tls_identities import tls_flags, tls_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(params=["auto", "fp8"])
def gpu_prefill_process(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[str, subprocess.Popen[bytes], str]]:
    """A prefill worker process on the GPU offering CUDA IPC (no prefix cache: each request's KV
    is computed afresh, so two transfers of one prompt carry equal bytes), its KV cache in the
    model's dtype or ``fp8`` (the third value: the decode workers take the same)."""
    port = free_ports(1)[0]
    command = [
        sys.executable, "-m", "services.cli", "--log-level", "WARNING", "serve", "prefill",
        "--model", "dummy:tiny", "--device", "cuda", "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", "-1", "--num-blocks", "64", "--worker-id", "prefill-gpu",
        "--kv-transport", "cuda-ipc", "--no-prefix-caching", *tls_flags("prefill"),
        "--kv-cache-dtype", request.param,
    ]  # fmt: skip
    proc = subprocess.Popen(command, env=dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        yield f"127.0.0.1:{port}", proc, request.param
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


async def test_cuda_ipc_between_two_processes_on_one_gpu(
    gpu_prefill_process: tuple[str, subprocess.Popen[bytes], str],
) -> None:
    from services.decode.server import start_decode_worker

    prefill_address, proc, kv_cache_dtype = gpu_prefill_process
    options = WorkerOptions(tls=tls_for("decode"),
                            model="dummy:tiny", device="cuda", host="127.0.0.1", port=0,
                            num_blocks=64, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    ipc_decode = await start_decode_worker(
        dataclasses.replace(options, worker_id="decode-ipc", kv_transport="cuda-ipc"))
    grpc_decode = await start_decode_worker(
        dataclasses.replace(options, worker_id="decode-grpc", kv_transport="grpc"))
    endpoint = ipc_decode.worker.channel  # type: ignore[attr-defined]
    assert isinstance(endpoint, CudaIpcEndpoint) and endpoint.gpu_uuid
    recording = Recording(endpoint)
    recording.close = endpoint.close  # type: ignore[attr-defined]
    ipc_decode.worker.channel = recording  # type: ignore[attr-defined]
    addresses = (prefill_address, ipc_decode.address, grpc_decode.address)
    channels = [open_channel(a, tls=tls_for("gateway")) for a in addresses]
    try:
        try:
            await wait_healthy(prefill_address, PREFILL_SERVICE, timeout=300,
                               tls=tls_for("operator"))
        except Exception:
            proc.kill()
            raise AssertionError(proc.communicate(timeout=10)[0].decode(errors="replace")) from None
        prefill = prefill_pb2_grpc.PrefillStub(channels[0])
        prompt = prompt_of(40)
        blocks: dict[str, torch.Tensor] = {}
        tokens: dict[str, list[int]] = {}
        for rid, handle, channel in (("via-ipc", ipc_decode, channels[1]),
                                     ("via-grpc", grpc_decode, channels[2])):
            await decode_pb2_grpc.DecodeStub(channel).Reserve(decode_pb2.ReserveRequest(
                request_id=rid, num_tokens=len(prompt),
                prompt_digest=reservation_digest(prompt, GREEDY.cache_salt)))
            response = await prefill.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, token_ids=prompt, params=sampling_params_to_proto(GREEDY),
                decode_address=handle.address,
            ))
            assert response.num_blocks == 3
            blocks[rid] = await held_kv(handle, rid)  # parked, before Generate claims it
            stub = decode_pb2_grpc.DecodeStub(channel)
            call = stub.Generate(decode_pb2.GenerateRequest(request_id=rid, wait_for_kv_seconds=10))
            tokens[rid] = [t async for message in call for t in message.token_ids]

        # The IPC transfer: one announcement, the pool mapped once, the exact bytes prefill holds.
        (header,) = [m.header for m in recording.of("header")]
        assert header.channel.gpu_uuid == endpoint.gpu_uuid
        (chunk,) = [m.chunk for m in recording.of("chunk")]
        assert chunk.channel_bytes == header.total_bytes and not chunk.data
        assert endpoint.num_mapped == 1
        pool = endpoint.pool("prefill-gpu")
        assert pool is not None and pool.device == ipc_decode.engine_loop.engine.kv.data.device
        source = list(header.channel.source_blocks)
        if kv_cache_dtype == "fp8":
            assert pool.dtype == torch.float8_e4m3fn
        as_bytes = {rid: held.view(torch.uint8) for rid, held in blocks.items()}
        # prefill freed, not reused
        assert torch.equal(as_bytes["via-ipc"], pool[source].cpu().view(torch.uint8))
        # ... equal to the copy sent as bytes over gRPC (crc32-checked: prefill's own bytes)
        assert torch.equal(as_bytes["via-ipc"], as_bytes["via-grpc"])
        assert torch.count_nonzero(blocks["via-ipc"].float()) > 0
        assert tokens["via-ipc"] == tokens["via-grpc"] and len(tokens["via-ipc"]) == 12

        for channel in channels:  # every block freed on both sides
            stub = (prefill_pb2_grpc.PrefillStub(channel) if channel is channels[0]
                    else decode_pb2_grpc.DecodeStub(channel))  # fmt: skip
            deadline = time.monotonic() + 10
            while (stats := await stub.GetStats(common_pb2.StatsRequest())).kv_blocks_in_use:
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.05)
    finally:
        for channel in channels:
            await channel.close()
        await ipc_decode.stop(0.5)
        await grpc_decode.stop(0.5)


async def held_kv(handle: WorkerHandle, request_id: str) -> torch.Tensor:
    """A host copy of the blocks a worker holds for ``request_id``."""
    loop = handle.engine_loop
    return await loop.call(lambda engine: engine.kv.data[loop.held_blocks(request_id)].cpu())
