"""A real decode worker with ``--tensor-parallel-size 2`` (issue 48): ``tandem serve decode`` as
an OS process, which starts its follower rank itself (Gloo, one core each). A prompt it prefills
itself generates the same greedy tokens as the in-process engine at width 1; it takes KV
reservations for hand-offs (``tests/test_tensor_parallel_handoff.py`` runs them); killing the worker takes its follower down (no orphan rank), and
killing the follower takes the worker down cleanly (its step fails, it exits as unhealthy for its
supervisor to restart it whole)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common.grpc_channel import open_channel, wait_healthy
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.prefix_hash import reservation_digest
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_to_proto
from tests.test_disagg_processes import free_port
from tests.tls_identities import tls_flags, tls_for

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def children_of(pid: int) -> list[int]:
    """The live follower ranks ``pid`` started: its children that multiprocessing spawned (not
    its resource tracker), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            if b"spawn_main" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture()
def worker() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    command = [
        sys.executable, "-m", "services.cli", "--log-level", "INFO", "serve", "decode",
        "--model", "dummy:tiny", "--dtype", "float32", "--device", "cpu", "--host", "127.0.0.1",
        "--port", str(port), "--metrics-port", "-1", "--num-blocks", "64",
        "--worker-id", "decode-tp", "--tensor-parallel-size", "2", *tls_flags("decode"),
    ]  # fmt: skip
    proc = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


async def _wait_up(proc: subprocess.Popen[bytes], address: str) -> None:
    try:
        await wait_healthy(address, "tandem.v1.Decode", timeout=120, tls=tls_for("operator"))
    except BaseException:
        proc.kill()
        pytest.fail("the worker did not come up:\n" + proc.communicate()[0].decode(errors="replace"))


async def test_a_tensor_parallel_decode_worker_generates(
    worker: tuple[subprocess.Popen[bytes], int],
) -> None:
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model

    proc, port = worker
    prompt = [(3 * i + 7) % 500 + 1 for i in range(37)]
    expected = LLMEngine(load_model("dummy:tiny"), EngineConfig(num_blocks=64)).generate(
        [prompt], GREEDY
    )[0].new_token_ids
    address = f"127.0.0.1:{port}"
    await _wait_up(proc, address)
    followers = children_of(proc.pid)
    assert followers, "the worker started no follower rank"
    channel = open_channel(address, tls=tls_for("gateway"))
    try:
        stub = decode_pb2_grpc.DecodeStub(channel)
        request = decode_pb2.GenerateRequest(request_id="tp-1", prompt_token_ids=prompt,
                                             params=sampling_params_to_proto(GREEDY))  # fmt: skip
        tokens = [t async for message in stub.Generate(request) for t in message.token_ids]
        assert tokens == expected
        grant = await stub.Reserve(decode_pb2.ReserveRequest(  # hand-offs into it are taken
            request_id="tp-2", num_tokens=len(prompt),
            prompt_digest=reservation_digest(prompt, GREEDY.cache_salt)))  # fmt: skip
        assert grant.num_blocks == 3
        assert (await stub.Abort(common_pb2.AbortRequest(request_id="tp-2"))).found
    finally:
        await channel.close()
    proc.send_signal(signal.SIGKILL)  # rank 0 dies without a word: its follower must follow
    proc.wait(10)
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in followers):
        assert time.monotonic() < deadline, f"follower ranks {followers} outlived rank 0"
        time.sleep(0.1)


async def test_a_dead_follower_takes_its_worker_down(
    worker: tuple[subprocess.Popen[bytes], int],
) -> None:
    """No rank waits forever: with its follower killed, the worker's next step fails, and the
    worker exits with the unhealthy code (``worker_runtime.UNHEALTHY_EXIT_CODE``)."""
    from services.engine.runtime.worker_runtime import UNHEALTHY_EXIT_CODE

    proc, port = worker
    address = f"127.0.0.1:{port}"
    await _wait_up(proc, address)
    (follower,) = children_of(proc.pid)
    os.kill(follower, signal.SIGKILL)
    channel = open_channel(address, tls=tls_for("gateway"))
    try:
        stub = decode_pb2_grpc.DecodeStub(channel)
        request = decode_pb2.GenerateRequest(request_id="tp-3", prompt_token_ids=[5, 6, 7],
                                             params=sampling_params_to_proto(GREEDY))  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError):
            [m async for m in stub.Generate(request)]
    finally:
        await channel.close()
    output = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert proc.returncode == UNHEALTHY_EXIT_CODE, output
