"""A worker process whose engine step failed exits (with ``UNHEALTHY_EXIT_CODE``) shortly after
reporting NOT_SERVING, stopping gracefully on the way, so its supervisor (``tandem up``'s
launcher, compose, Kubernetes) starts a fresh one; a healthy worker serves on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from services.engine.runtime import worker_runtime
from services.engine.runtime.worker_runtime import UNHEALTHY_EXIT_CODE, run_worker


class _Loop:
    """The part of an EngineLoop that run_worker uses: its unhealthy callbacks."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[str], None]] = []

    def on_unhealthy(self, callback: Callable[[str], None]) -> None:
        self.callbacks.append(callback)

    def fail_a_step(self) -> None:  # as EngineLoop does, on its own thread
        thread = threading.Thread(target=lambda: [cb("engine step failed") for cb in self.callbacks])
        thread.start()
        thread.join()


class _Handle:
    def __init__(self) -> None:
        self.engine_loop = _Loop()
        self.stopped = 0

    async def stop(self) -> None:
        self.stopped += 1


def test_an_unhealthy_worker_exits_for_its_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_runtime, "UNHEALTHY_LINGER_S", 0.05)
    handle = _Handle()

    async def start() -> _Handle:
        threading.Timer(0.1, handle.engine_loop.fail_a_step).start()
        return handle

    began = time.monotonic()
    assert run_worker(start) == UNHEALTHY_EXIT_CODE  # type: ignore[arg-type]
    assert handle.stopped == 1 and time.monotonic() - began < 10
