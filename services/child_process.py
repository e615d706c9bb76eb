"""One child process of ``tandem up``: how it is started (its own session, killed with the
launcher on Linux), what its exit looked like, and how a signal reaches its whole process group.

Kept apart from ``launcher.py`` (which plans, supervises and restarts children) because these
are the operating-system details: ``PR_SET_PDEATHSIG``, sessions, process groups and file
descriptors.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.launch_plan import ChildSpec

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGKILL the child when the launcher dies (None elsewhere).

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, so children are
    started from the main thread. libc is looked up here, in the parent, so the function that
    runs between fork and exec only makes one foreign call.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        logger.warning("prctl is unavailable; children will not die with the launcher")
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


@dataclass(slots=True)
class Child:
    """A started child process and its plan."""

    spec: ChildSpec
    process: subprocess.Popen[bytes]
    started: float = 0.0  # time.monotonic() at start
    crashes: int = 0  # deaths in a row that came before RESTART_RESET_S of running

    @property
    def pid(self) -> int:
        return self.process.pid

    def describe_exit(self) -> str:
        code = self.process.returncode
        if code is None:
            return "is running"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"


def start_child(spec: ChildSpec, preexec: Callable[[], None] | None) -> Child:
    """Start one child in its own session; its stdout goes to our stderr."""
    process = subprocess.Popen(
        spec.argv,
        env={**os.environ, **spec.env} if spec.env else None,
        stdin=subprocess.DEVNULL,
        stdout=_stderr_fd(),
        start_new_session=True,
        preexec_fn=preexec,
    )
    logger.info("started %s (pid %d): %s", spec.name, process.pid, shlex.join(spec.argv[2:]))
    return Child(spec, process, started=time.monotonic())


def _stderr_fd() -> int | None:
    """Our stderr's file descriptor (children's stdout goes there), or None to inherit stdout."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def signal_group(child: Child, sig: signal.Signals) -> None:
    """Send ``sig`` to the child's process group (the child and anything it started)."""
    try:
        os.killpg(child.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
