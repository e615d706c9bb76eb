"""A thin, logged wrapper over the ``docker`` and ``docker compose`` command lines, for
scripts/compose_test.py: build the image, bring a compose project up and scale it, find each
replica's container and its address on the project network, kill containers, take it down and
list what is left of it.

Why the CLI and not an SDK: the test is about what a user types (``docker compose -f compose.yaml
-f compose.cpu.yaml up -d``), so it runs those very commands, each logged with its duration.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("compose_test")


class StackError(RuntimeError):
    """A docker command failed, or the stack did not reach a state in time."""


def run(argv: list[str], *, timeout: float = 600, cwd: Path | None = None,
        env: dict[str, str] | None = None, quiet: bool = False) -> str:
    """Run ``argv``; its stdout, or :class:`StackError` with the end of its output."""
    started = time.monotonic()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip
    took = time.monotonic() - started
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-25:]
        raise StackError(f"{' '.join(argv)} -> exit {done.returncode} after {took:.0f} s:\n"
                         + "\n".join(tail))  # fmt: skip
    if not quiet or took > 5:
        logger.info("$ %s  (%.1f s)", " ".join(argv), took)
    return done.stdout


@dataclass(frozen=True)
class Replica:
    """One running (or stopped) container of a compose service."""

    service: str
    container: str  # the container's name
    ip: str  # its address on the project network ("" when it is not running)
    state: str  # running, exited, restarting, ...
    health: str  # healthy, starting, unhealthy, or "" without a healthcheck


class Stack:
    """One compose project made of ``files`` in ``repo``."""

    def __init__(self, repo: Path, files: list[str], project: str, env: dict[str, str]) -> None:
        self.repo = repo
        self.project = project
        self.env = env
        self.base = ["docker", "compose", "-p", project, *(a for f in files for a in ("-f", f))]

    def compose(self, *args: str, timeout: float = 900, quiet: bool = False) -> str:
        return run([*self.base, *args], cwd=self.repo, env=self.env, timeout=timeout, quiet=quiet)

    def up(self, scale: dict[str, int] | None = None) -> None:
        """``up -d --no-build`` (the image is built beforehand), with ``--scale`` per service."""
        flags = [a for s, n in (scale or {}).items() for a in ("--scale", f"{s}={n}")]
        self.compose("up", "-d", "--no-build", *flags)

    def replicas(self, service: str) -> list[Replica]:
        """Every container of ``service``, stopped ones included, by name."""
        ids = self.compose("ps", "-a", "-q", service, quiet=True).split()
        if not ids:
            return []
        found = json.loads(run(["docker", "inspect", *ids], quiet=True))
        network = f"{self.project}_default"
        out = []
        for c in found:
            nets = c["NetworkSettings"]["Networks"] or {}
            health = (c["State"].get("Health") or {}).get("Status", "")
            out.append(Replica(service, c["Name"].lstrip("/"),
                               (nets.get(network) or {}).get("IPAddress", ""),
                               c["State"]["Status"], health))  # fmt: skip
        return sorted(out, key=lambda r: r.container)

    def wait_healthy(self, counts: dict[str, int], timeout: float) -> float:
        """Wait until each service has ``counts[service]`` running, healthy containers; the
        seconds it took."""
        started = time.monotonic()
        while True:
            states = {s: self.replicas(s) for s in counts}
            if all(sum(r.state == "running" and r.health == "healthy" for r in states[s]) == n
                   for s, n in counts.items()):  # fmt: skip
                took = time.monotonic() - started
                logger.info("healthy after %.0f s: %s", took,
                            ", ".join(f"{s}={len(states[s])}" for s in counts))  # fmt: skip
                return took
            if time.monotonic() - started > timeout:
                raise StackError(f"not healthy after {timeout:.0f} s: {states}")
            time.sleep(3)

    def restart_count(self, container: str) -> int:
        return int(run(["docker", "inspect", "-f", "{{.RestartCount}}", container], quiet=True))

    def kill(self, container: str) -> None:
        """``docker kill`` (SIGKILL): the container's processes die at once."""
        run(["docker", "kill", container])

    def crash(self, container: str) -> None:
        """SIGKILL the container's init process from the host: to Docker this is a crash (not
        a user's stop, as ``docker kill`` is), so the ``restart:`` policy applies."""
        pid = run(["docker", "inspect", "-f", "{{.State.Pid}}", container], quiet=True).strip()
        run(["kill", "-9", pid])
        logger.info("crashed %s (host pid %s killed)", container, pid)

    def logs(self, tail: int = 40) -> str:
        try:
            return self.compose("logs", "--no-color", "--tail", str(tail), timeout=60, quiet=True)
        except StackError as exc:
            return str(exc)

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "20")

    def leftovers(self) -> list[str]:
        """Containers, networks and volumes still labelled with this project."""
        label = f"label=com.docker.compose.project={self.project}"
        kinds = (["ps", "-a"], ["network", "ls"], ["volume", "ls"])
        return [f"{kind[0]} {name}" for kind in kinds
                for name in run(["docker", *kind, "-q", "--filter", label], quiet=True).split()]
