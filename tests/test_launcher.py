"""``tandem up``: planning (ports, command lines), and the real thing as a subprocess: ready table,
health and reflection on every address, clean SIGTERM, a crashed child stopping everything, a
SIGKILLed launcher taking its children with it, and one-line errors for busy ports and children
that fail to start. No test leaves a process behind."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services import launch_plan
from services.cli import build_parser
from services.common import ports
from services.common.errors import InvalidArgumentError
from services.common.grpc_channel import open_channel
from services.launch_plan import LaunchConfig, plan
from tests.ports import free_ports
from tests.up_process import StartUp, alive, assert_all_gone, children_of, port_flags
from tests.tls_identities import tls_for

WORKERS_MISSING = [
    module
    for module in ("services.prefill.main", "services.decode.main")
    if importlib.util.find_spec(module) is None
]
needs_workers = pytest.mark.skipif(
    bool(WORKERS_MISSING),
    reason=f"{' and '.join(WORKERS_MISSING)} not written yet; cannot start prefill/decode workers",
)


# --- planning ----------------------------------------------------------------------------------


def _with_gateway(monkeypatch: pytest.MonkeyPatch, present: bool) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        if name == "services.gateway.main":
            return object() if present else None
        return real(name, *args)

    monkeypatch.setattr(launch_plan.importlib.util, "find_spec", find_spec)


@needs_workers
def test_plan_default_ports_and_command_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_gateway(monkeypatch, True)
    specs = plan(LaunchConfig(num_prefill=2, num_decode=1, dtype="bfloat16", kv_cache_gib=1.5,
                              kv_transport="distributed", device="cpu",
                              worker_args=("--foo", "bar")))  # fmt: skip
    assert [s.name for s in specs] == ["tokenizer", "prefill-0", "prefill-1", "decode-0", "gateway"]
    assert [s.address for s in specs] == [
        f"127.0.0.1:{ports.TOKENIZER_GRPC_PORT}",
        f"127.0.0.1:{ports.prefill_grpc_port(0)}",
        f"127.0.0.1:{ports.prefill_grpc_port(1)}",
        f"127.0.0.1:{ports.decode_grpc_port(0)}",
        f"http://127.0.0.1:{ports.GATEWAY_HTTP_PORT}",
    ]
    assert specs[2].metrics_url == f"http://127.0.0.1:{ports.prefill_metrics_port(1)}/metrics"
    prefill1 = list(specs[2].argv)
    assert prefill1[:3] == [sys.executable, "-m", "services"]
    assert prefill1[4:6] == ["serve", "prefill"]
    expected = {
        "--port": str(ports.prefill_grpc_port(1)),
        "--metrics-port": str(ports.prefill_metrics_port(1)),
        "--worker-id": "prefill-1",
        "--advertise-address": f"127.0.0.1:{ports.prefill_grpc_port(1)}",
        "--dtype": "bfloat16",
        "--device": "cpu",
        "--kv-cache-gib": "1.5",
        "--kv-transport": "distributed",
        "--model": "default",
    }
    for flag, value in expected.items():
        assert prefill1[prefill1.index(flag) + 1] == value
    assert prefill1[-2:] == ["--foo", "bar"]
    for worker in specs[1:4]:  # every prefill and decode worker gets it, nobody else
        assert worker.argv[worker.argv.index("--kv-transport") + 1] == "distributed"
    assert "--kv-transport" not in specs[0].argv and "--kv-transport" not in specs[-1].argv
    assert "--device" not in specs[0].argv and "--device" not in specs[-1].argv
    assert "--device" not in plan(LaunchConfig(num_prefill=1, num_decode=1))[1].argv
    assert "--kv-transport" not in plan(LaunchConfig(num_prefill=1, num_decode=1))[1].argv
    argv = ["up", "--kv-transport", "distributed"]
    assert build_parser(argv).parse_args(argv).kv_transport == "distributed"
    gateway = list(specs[-1].argv)
    assert gateway[gateway.index("--tokenizer") + 1] == specs[0].address
    assert [gateway[i + 1] for i, a in enumerate(gateway) if a == "--prefill"] == [
        specs[1].address, specs[2].address,
    ]  # fmt: skip
    assert [gateway[i + 1] for i, a in enumerate(gateway) if a == "--decode"] == [specs[3].address]
    assert gateway[gateway.index("--port") + 1] == str(ports.GATEWAY_HTTP_PORT)
    assert gateway[gateway.index("--metrics-port") + 1] == str(ports.GATEWAY_METRICS_PORT)
    assert specs[-1].metrics_url == f"http://127.0.0.1:{ports.GATEWAY_METRICS_PORT}/metrics"


def test_on_shared_cores_long_prompts_wait_for_the_prefill_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _with_gateway(monkeypatch, True)

    def queue(**config: object) -> list[str]:
        argv = list(plan(LaunchConfig(**config))[-1].argv)  # type: ignore[arg-type]
        return [argv[i + 1] for i, a in enumerate(argv) if a == "--max-prefill-queue"]

    shared = str(launch_plan.SHARED_CORES_PREFILL_QUEUE)
    assert queue(num_prefill=1, num_decode=1, cpus=(0, 1)) == [shared]  # one pool of cores
    assert queue(num_prefill=1, num_decode=1, cpus=(0, 1, 2, 3)) == []  # pinned apart: Dynamo's rule
    assert queue(num_prefill=0, num_decode=1, mode="colocated", cpus=(0, 1)) == []
    assert queue(num_prefill=1, num_decode=1, cpus=(0, 1),
                 gateway_args=("--max-prefill-queue", "2")) == [shared, "2"]  # the user's wins


def test_plan_refuses_impossible_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_gateway(monkeypatch, True)
    with pytest.raises(InvalidArgumentError, match="planned twice"):
        plan(LaunchConfig(num_prefill=0, num_decode=0, gateway=False,
                          tokenizer_port=9000, tokenizer_metrics_port=9000))  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="gateway needs at least one prefill"):
        plan(LaunchConfig(num_prefill=0, num_decode=0, gateway=True))
    _with_gateway(monkeypatch, False)  # a missing gateway is skipped, not an error
    assert [s.name for s in plan(LaunchConfig(num_prefill=0, num_decode=0))] == ["tokenizer"]


@needs_workers
def test_plan_refuses_overlapping_worker_ports() -> None:
    with pytest.raises(InvalidArgumentError, match="planned twice"):
        plan(LaunchConfig(num_prefill=11, num_decode=1, gateway=False))


# --- the process -------------------------------------------------------------------------------


async def _check_services(rows: dict[str, tuple[str, int]]) -> None:
    expected = {"tokenizer": "tandem.v1.Tokenizer", "prefill": "tandem.v1.Prefill",
                "decode": "tandem.v1.Decode"}  # fmt: skip
    for name, (address, _) in rows.items():
        service = expected[name.split("-")[0]]
        channel = open_channel(address, tls=tls_for("gateway"))
        try:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            replies = [r async for r in stub.ServerReflectionInfo(iter([request]), timeout=10)]
            assert service in {s.name for s in replies[0].list_services_response.service}, name
        finally:
            await channel.close()


def _sigterm_run(
    start_up: StartUp, num_prefill: int, num_decode: int, gateway: bool = False,
    api_key: str | None = None,
) -> None:
    flags = port_flags(num_prefill, num_decode)
    if gateway:
        flags += ["--gateway-port", str(free_ports(1)[0])]
    env = {**os.environ, "TANDEM_API_KEYS": api_key} if api_key else None
    up = start_up("--prefill", str(num_prefill), "--decode", str(num_decode), *flags,
                  gateway=gateway, env=env)  # fmt: skip
    up.wait_ready()
    names = ["tokenizer"] + [f"prefill-{i}" for i in range(num_prefill)]
    names += [f"decode-{i}" for i in range(num_decode)] + (["gateway"] if gateway else [])
    assert sorted(up.rows) == sorted(names)
    assert set(up.child_pids) == children_of(up.process.pid)  # the table lists every child
    assert all(alive(pid) for pid in up.child_pids)
    grpc_rows = {name: row for name, row in up.rows.items() if name != "gateway"}
    asyncio.run(_check_services(grpc_rows))
    if gateway:
        url = up.rows["gateway"][0]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        for path in ("/health", "/ready", "/v1/models"):
            request = urllib.request.Request(url + path, headers=headers)
            with urllib.request.urlopen(request, timeout=10) as response:
                assert response.status == 200, path
                body = response.read()
                if path == "/v1/models":
                    assert b"SmolLM2-135M-Instruct" in body
                if path == "/ready":  # the launcher waited for every worker, key in hand
                    assert all(w["healthy"] for w in json.loads(body)["decode"]), body
        if api_key:  # without the key, /ready is the bare status
            with urllib.request.urlopen(url + "/ready", timeout=10) as response:
                assert json.loads(response.read()) == {"status": "ready"}

    started = time.monotonic()
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(timeout=40) == 0, up.stderr()[-3000:]
    assert time.monotonic() - started < 30
    assert_all_gone(up, timeout=1.0)
    assert "every service stopped" in up.stderr()


@needs_workers
def test_up_prefill_and_decode_then_sigterm(start_up: StartUp) -> None:
    _sigterm_run(start_up, 1, 1)


@needs_workers
@pytest.mark.skipif(
    importlib.util.find_spec("services.gateway.main") is None,
    reason="services.gateway.main not written yet",
)
def test_up_with_the_gateway_then_sigterm(start_up: StartUp) -> None:
    _sigterm_run(start_up, 1, 1, gateway=True, api_key="sk-launcher-test-0123456789")


def test_up_tokenizer_only_then_sigterm(start_up: StartUp) -> None:
    _sigterm_run(start_up, 0, 0)


@pytest.mark.parametrize(
    "workers",
    [pytest.param((1, 1), marks=needs_workers, id="full"), pytest.param((0, 0), id="tok")],
)
def test_without_restart_a_crashed_child_stops_everything(
    start_up: StartUp, workers: tuple[int, int]
) -> None:
    num_prefill, num_decode = workers
    up = start_up(
        "--no-restart", "--prefill", str(num_prefill), "--decode", str(num_decode),
        *port_flags(num_prefill, num_decode),
    )  # fmt: skip
    up.wait_ready()
    victim = "decode-0" if "decode-0" in up.rows else "tokenizer"
    os.kill(up.rows[victim][1], signal.SIGKILL)
    code = up.process.wait(timeout=40)
    assert code == 1
    assert f"{victim} (pid {up.rows[victim][1]}) was killed by SIGKILL unexpectedly" in up.stderr()
    assert_all_gone(up, timeout=1.0)


def _stream_completion(url: str, on_token: Callable[[int], None] | None = None) -> tuple[str, int]:
    """Greedy streamed chat completion through the gateway: (text, usage completion tokens)."""
    body = json.dumps({
        "model": "SmolLM2-135M-Instruct", "stream": True, "temperature": 0, "max_tokens": 120,
        "ignore_eos": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
    }).encode()  # fmt: skip
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    text, chunks, completion = "", 0, -1
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("usage"):
                completion = event["usage"]["completion_tokens"]
            if event["choices"]:
                text += event["choices"][0]["delta"].get("content") or ""
                chunks += 1
                if on_token is not None:
                    on_token(chunks)
    return text, completion


def _serving_decode_addresses(gateway_url: str) -> list[str]:
    """Decode workers the gateway has a request in flight on (its exact lease counts)."""
    try:
        with urllib.request.urlopen(gateway_url + "/ready", timeout=10) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as err:  # 503 still carries the JSON
        body = json.loads(err.read())
    return [w["address"] for w in body["decode"] if w["in_flight"]]


@needs_workers
@pytest.mark.skipif(
    importlib.util.find_spec("services.gateway.main") is None,
    reason="services.gateway.main not written yet",
)
def test_a_decode_worker_killed_mid_stream_migrates_and_is_restarted(start_up: StartUp) -> None:
    port = free_ports(1)[0]
    up = start_up("--prefill", "1", "--decode", "2", *port_flags(1, 2), "--gateway-port",
                  str(port), gateway=True)  # fmt: skip
    up.wait_ready()
    url = up.rows["gateway"][0]
    expected, tokens = _stream_completion(url)
    assert tokens == 120
    killed: list[tuple[str, int]] = []

    def kill_the_serving_worker(chunks: int) -> None:
        if chunks != 30 or killed:
            return
        for name in ("decode-0", "decode-1"):
            if up.rows[name][0] in _serving_decode_addresses(url):
                killed.append((name, up.rows[name][1]))
                os.kill(up.rows[name][1], signal.SIGKILL)

    text, tokens = _stream_completion(url, kill_the_serving_worker)
    assert killed, "no decode worker was serving the stream"
    assert text == expected and tokens == 120  # one uninterrupted stream, the same greedy text
    with urllib.request.urlopen(up.metrics_urls["gateway"], timeout=10) as response:
        assert "tandem:migrations_total 1.0" in response.read().decode()
    name, victim = killed[0]
    deadline = time.monotonic() + 120
    stderr = up.stderr()
    while f"restarted {name} (pid " not in stderr and time.monotonic() < deadline:
        time.sleep(0.5)
        stderr = up.stderr()
    assert f"{name} (pid {victim}) was killed by SIGKILL unexpectedly" in stderr
    assert "restarting it in 1s" in stderr and f"restarted {name} (pid " in stderr
    assert up.process.poll() is None  # the launcher kept everything else running
    children = children_of(up.process.pid)
    assert victim not in children and len(children) == len(up.rows)
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(timeout=40) == 0, up.stderr()[-3000:]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(pid) for pid in children):
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)]


def test_a_killed_launcher_takes_its_children_along(start_up: StartUp) -> None:
    up = start_up("--prefill", "0", "--decode", "0", *port_flags(0, 0))
    up.wait_ready()
    up.process.kill()  # SIGKILL: no chance to clean up; PR_SET_PDEATHSIG does it
    up.process.wait()
    assert_all_gone(up, timeout=10.0)


def test_busy_port_is_a_one_line_error(start_up: StartUp) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        flags = port_flags(0, 0)
        flags[1] = str(port)
        up = start_up("--prefill", "0", "--decode", "0", *flags)
        assert up.process.wait(timeout=60) == 2
    errors = [line for line in up.stderr().splitlines() if line.startswith("tandem: error:")]
    assert errors == [
        f"tandem: error: port {port} (tokenizer gRPC) on 127.0.0.1 is not available: "
        "Address already in use"
    ]
    assert not children_of(up.process.pid)


def test_a_child_failing_to_start_is_a_one_line_error(start_up: StartUp) -> None:
    env = dict(os.environ, TANDEM_MODEL="/nonexistent/model.gguf")
    up = start_up("--prefill", "0", "--decode", "0", *port_flags(0, 0), env=env)
    assert up.process.wait(timeout=60) == 2
    stderr = up.stderr()
    assert "tandem: error: model path does not exist" in stderr  # the child's own line
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("tandem: error: tokenizer (pid ")
    assert "exited with code 2 while starting" in last
