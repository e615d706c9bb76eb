"""A worker's health after a failed engine step: set once, watched by the worker's health check.

An exception out of ``engine.step()`` (the forward pass, the KV) cannot be pinned on one request,
and the engine's state can no longer be trusted: the engine loop fails every request with an
:class:`UnavailableError` whose code is :data:`~services.common.errors.WORKER_UNHEALTHY` (the
gateway migrates them), refuses new ones with the same error (:meth:`WorkerHealth.check`), and
tells the callbacks registered with :meth:`WorkerHealth.on_unhealthy` — the worker reports
NOT_SERVING and its process exits for its supervisor to restart (``worker_runtime.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.common.errors import WORKER_UNHEALTHY, UnavailableError

logger = logging.getLogger(__name__)


class WorkerHealth:
    """Healthy until :meth:`fail`; then unhealthy for good, with the first failure's reason."""

    def __init__(self) -> None:
        self.reason: str | None = None  # why a step failed; set once, by the engine thread
        self._callbacks: list[Callable[[str], None]] = []

    @property
    def healthy(self) -> bool:
        return self.reason is None

    def on_unhealthy(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (on the engine thread) when a step fails; at once if one
        already did."""
        self._callbacks.append(callback)
        if self.reason is not None:
            callback(self.reason)

    def fail(self, reason: str) -> UnavailableError:
        """Record the failure (the first one's reason is kept), run the callbacks the first time,
        and return the error the worker's requests get."""
        first = self.reason is None
        self.reason = self.reason or reason
        if first:
            for callback in self._callbacks:
                try:
                    callback(self.reason)
                except Exception:  # noqa: BLE001 - a callback must not kill the engine thread
                    logger.exception("on_unhealthy callback failed")
        return UnavailableError(f"{reason}; this worker is now unhealthy", code=WORKER_UNHEALTHY)

    def check(self) -> None:
        """Refuse new work once unhealthy."""
        if self.reason is not None:
            raise UnavailableError(f"this worker is unhealthy ({self.reason})",
                                   code=WORKER_UNHEALTHY)  # fmt: skip
