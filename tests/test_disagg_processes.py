"""End to end across processes and with the real model.

1. ``tandem serve prefill`` and ``tandem serve decode`` as separate OS processes (tiny dummy
   weights): a request goes prefill -> decode over gRPC, the tokens equal the in-process engine's,
   KV blocks return to zero, metrics are served, and SIGTERM stops both cleanly.
2. The default SmolLM2 model in-process with its tokenizer: text deltas and stop strings survive
   the hand-off (slow: loads the GGUF once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

from services.common.grpc_channel import open_channel, wait_healthy
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.common.prefix_hash import reservation_digest
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_to_proto
from tests.tls_identities import tls_flags, tls_for

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve(role: str, port: int, metrics_port: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "services.cli", "--log-level", "WARNING", "serve", role,
        "--model", "dummy:tiny", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", str(metrics_port), "--num-blocks", "64", "--worker-id", f"{role}-p",
        *tls_flags(role),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.fixture()
def processes() -> Iterator[dict[str, object]]:
    ports = {name: free_port() for name in ("prefill", "decode", "prefill_m", "decode_m")}
    procs = {
        "decode": serve("decode", ports["decode"], ports["decode_m"]),
        "prefill": serve("prefill", ports["prefill"], ports["prefill_m"]),
    }
    try:
        yield {"ports": ports, "procs": procs}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


async def test_workers_as_separate_processes(processes: dict[str, object]) -> None:
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model

    ports: dict[str, int] = processes["ports"]  # type: ignore[assignment]
    procs: dict[str, subprocess.Popen[bytes]] = processes["procs"]  # type: ignore[assignment]
    prompt = [(3 * i + 7) % 500 + 1 for i in range(41)]
    expected = LLMEngine(load_model("dummy:tiny"), EngineConfig(num_blocks=64)).generate(
        [prompt], GREEDY
    )[0].new_token_ids

    prefill_address = f"127.0.0.1:{ports['prefill']}"
    decode_address = f"127.0.0.1:{ports['decode']}"
    await wait_healthy(prefill_address, "tandem.v1.Prefill", timeout=90, tls=tls_for("operator"))
    await wait_healthy(decode_address, "tandem.v1.Decode", timeout=90, tls=tls_for("operator"))
    prefill_channel = open_channel(prefill_address, tls=tls_for("gateway"))
    decode_channel = open_channel(decode_address, tls=tls_for("gateway"))
    try:
        prefill = prefill_pb2_grpc.PrefillStub(prefill_channel)
        decode = decode_pb2_grpc.DecodeStub(decode_channel)
        await decode.Reserve(decode_pb2.ReserveRequest(  # what the gateway does first
            request_id="p1", num_tokens=len(prompt),
            prompt_digest=reservation_digest(prompt, GREEDY.cache_salt)))
        call = decode.Generate(decode_pb2.GenerateRequest(request_id="p1", wait_for_kv_seconds=10))
        response = await prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id="p1", token_ids=prompt, params=sampling_params_to_proto(GREEDY),
            decode_address=decode_address,
        ))
        tokens = [t async for message in call for t in message.token_ids]
        assert tokens == expected
        assert response.num_blocks == 3
        for stub in (prefill, decode):
            deadline = time.monotonic() + 10
            while (stats := await stub.GetStats(common_pb2.StatsRequest())).kv_blocks_in_use:
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.05)
        text = await asyncio.to_thread(_fetch, f"http://127.0.0.1:{ports['prefill_m']}/metrics")
        assert "tandem:kv_transfer_bytes_total" in text
        assert f"tandem:kv_transfer_bytes_total {float(response.kv_bytes)}" in text
    finally:
        await prefill_channel.close()
        await decode_channel.close()
    for proc in procs.values():
        proc.send_signal(signal.SIGTERM)
    for name, proc in procs.items():
        output = (await asyncio.to_thread(proc.communicate, None, 30))[0].decode(errors="replace")
        assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{output}"


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.read().decode()


@pytest.mark.slow
async def test_smollm2_text_and_stop_strings_through_the_handoff() -> None:
    from services.decode.server import start_decode_worker
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model
    from services.engine.runtime.worker_options import WorkerOptions
    from services.engine.runtime.output_text import OutputText
    from services.engine.runtime.worker_runtime import load_tokenizer
    from services.prefill.server import start_prefill_worker

    loaded = load_model("default")
    tokenizer = load_tokenizer(loaded.source)
    assert tokenizer is not None
    prompt = tokenizer.encode_chat(  # type: ignore[attr-defined]
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24)
    stop_params = SamplingParams(temperature=0.0, max_tokens=24, stop=("Paris",))
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64), eos_token_ids=tokenizer.eos_token_ids)
    expected, expected_stop = engine.generate(
        [prompt, prompt], [params, stop_params], output_filter=OutputText(tokenizer)
    )

    options = WorkerOptions(tls=tls_for("decode"), host="127.0.0.1", port=0, num_blocks=64)
    decode = await start_decode_worker(options, loaded=loaded, tokenizer=tokenizer)
    prefill_options = dataclasses.replace(options, tls=tls_for("prefill"))
    prefill = await start_prefill_worker(prefill_options, loaded=loaded)
    prefill_channel = open_channel(prefill.address, tls=tls_for("gateway"))
    decode_channel = open_channel(decode.address, tls=tls_for("gateway"))
    try:
        prefill_stub = prefill_pb2_grpc.PrefillStub(prefill_channel)
        decode_stub = decode_pb2_grpc.DecodeStub(decode_channel)
        for rid, p, want in (("s1", params, expected), ("s2", stop_params, expected_stop)):
            await decode_stub.Reserve(decode_pb2.ReserveRequest(
                request_id=rid, num_tokens=len(prompt),
                prompt_digest=reservation_digest(prompt, p.cache_salt)))
            call = decode_stub.Generate(decode_pb2.GenerateRequest(request_id=rid))
            await prefill_stub.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, token_ids=prompt, params=sampling_params_to_proto(p),
                decode_address=decode.address,
            ))
            messages = [message async for message in call]
            assert [t for m in messages for t in m.token_ids] == want.new_token_ids
            assert "".join(m.text for m in messages) == want.text
            assert messages[-1].finish_reason == want.finish_reason == "stop"
        assert "Paris" in expected.text and "Paris" not in expected_stop.text
    finally:
        await prefill_channel.close()
        await decode_channel.close()
        await prefill.stop(0.5)
        await decode.stop(0.5)
