"""``tandem up`` as a subprocess, for the tests that start the real thing: free port flags, the
ready table, process-tree checks, and the ``start_up`` fixture (a pytest plugin, see conftest)
that kills everything a test started."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

from tests.ports import free_ports
from tests.tls_identities import cert_dir

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 180.0


def port_flags(num_prefill: int, num_decode: int) -> list[str]:
    # Worker ports are bases (worker i gets base + i): give every role its own free block.
    count = 3 + 2 * num_prefill + 2 * num_decode
    free = iter(free_ports(count + 8))
    flags = ["--tokenizer-port", str(next(free)), "--tokenizer-metrics-port", str(next(free)),
             "--gateway-metrics-port", str(next(free))]
    for role, n in (("prefill", num_prefill), ("decode", num_decode)):
        if n == 1:
            flags += [f"--{role}-port", str(next(free)), f"--{role}-metrics-port", str(next(free))]
        elif n > 1:
            flags += [f"--{role}-port", str(free_run_of(n)),
                      f"--{role}-metrics-port", str(free_run_of(n))]  # fmt: skip
    return flags


def certs_flag(args: tuple[str, ...] | list[str], *, own_certs: bool = False) -> list[str]:
    """``--certs`` with the test session's CA (so a test can call the stack's services with
    :func:`tests.tls_identities.tls_for`), unless ``args`` choose TLS themselves
    (``--insecure-internal``, ``--certs``) or ``own_certs`` keeps tandem up's throwaway CA."""
    if own_certs or {"--insecure-internal", "--certs"} & set(args):
        return []
    return ["--certs", str(cert_dir())]


def free_run_of(n: int) -> int:
    """A port such that it and the next ``n - 1`` are free now (worker i gets base + i)."""
    for _ in range(200):
        base = free_ports(1)[0]
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no run of {n} free ports found")


def alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children_of(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


@dataclass
class Up:
    """A running ``tandem up`` subprocess and what its stdout table said."""

    process: subprocess.Popen[str]
    log: IO[str]
    rows: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (address, pid)
    metrics_urls: dict[str, str] = field(default_factory=dict)  # name -> its /metrics
    stdout_lines: list[str] = field(default_factory=list)

    @property
    def child_pids(self) -> list[int]:
        return [pid for _, pid in self.rows.values()]

    def stderr(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        done = threading.Event()

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.stdout_lines.append(line.rstrip("\n"))
                if line.strip() == "ready":
                    break
            done.set()

        threading.Thread(target=read, daemon=True).start()
        if not done.wait(timeout) or self.stdout_lines[-1:] != ["ready"]:
            pytest.fail(f"tandem up not ready in {timeout:g}s; stderr:\n{self.stderr()[-4000:]}")
        header = next(i for i, line in enumerate(self.stdout_lines) if line.startswith("service "))
        for line in self.stdout_lines[header + 1 : -1]:
            name, address, metrics, pid = line.split()
            self.rows[name] = (address, int(pid))
            self.metrics_urls[name] = metrics


StartUp = Callable[..., Up]


@pytest.fixture
def start_up() -> Iterator[StartUp]:
    """Start ``tandem up`` with free ports; everything it started is killed at teardown."""
    started: list[Up] = []

    def start(*args: str, env: dict[str, str] | None = None, gateway: bool = False,
              own_certs: bool = False) -> Up:
        log = tempfile.TemporaryFile("w+")
        gateway_flag = "--gateway" if gateway else "--no-gateway"
        process = subprocess.Popen(
            [sys.executable, "-m", "services", "up", gateway_flag, "--stop-timeout", "20",
             *certs_flag(args, own_certs=own_certs), *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
        )  # fmt: skip
        up = Up(process, log)
        started.append(up)
        return up

    yield start
    for up in started:
        leftovers = set(up.child_pids)
        if alive(up.process.pid):
            leftovers |= children_of(up.process.pid)
        if up.process.poll() is None:
            up.process.kill()
            up.process.wait()
        for pid in leftovers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        up.log.close()


@contextlib.contextmanager
def running_up(*args: str) -> Iterator[Up]:
    """``tandem up --gateway ARGS`` until ready, for a module's tests; at the end SIGTERM (a
    clean stop), then SIGKILL to anything of it still alive."""
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "services", "up", "--gateway", "--stop-timeout", "20",
         *certs_flag(args), *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    up = Up(process, log)
    try:
        up.wait_ready()
        yield up
    finally:
        leftovers = set(up.child_pids) | (children_of(process.pid) if alive(process.pid) else set())
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pid in leftovers | children_of(process.pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()


def assert_all_gone(up: Up, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(pid) for pid in up.child_pids):
        time.sleep(0.1)
    assert not [pid for pid in up.child_pids if alive(pid)], up.stderr()[-3000:]


def wait_kv_freed(gateway_port: int, workers: int = 2, timeout: float = 20.0,
                  api_key: str | None = None) -> None:
    """Wait until every worker the gateway's ``/ready`` lists holds no KV block (the stats it
    polls); fail with the last answer after ``timeout`` seconds. ``api_key``: the key to show
    when the gateway has keys configured (``/ready``'s details need one then)."""
    import json
    import urllib.request

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"http://127.0.0.1:{gateway_port}/ready", headers=headers)
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(request) as response:
            ready = json.load(response)
        held = [w.get("kv_blocks_in_use") for w in ready["prefill"] + ready["decode"]]
        if held == [0] * workers:
            return
        assert time.monotonic() < deadline, ready
        time.sleep(0.25)

