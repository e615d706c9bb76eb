"""Pools that follow DNS: a replica given by name stands for every address the name has.

``--tokenizer`` / ``--prefill`` / ``--decode`` entries are ``host:port``. An entry whose host is
an IP address is one replica, fixed. An entry whose host is a name (``decode:50071`` under Docker
Compose, a Kubernetes headless Service) is resolved now and every ``resolve_interval_s`` seconds,
and the pool becomes the union of every entry's addresses: ``docker compose up --scale decode=3``
gives three decode workers, and a replica that goes away leaves the pool at the next resolution
(requests already running on it carry on; no new ones go there). A failed resolution keeps the
entry's previous addresses (the name itself before it ever resolved), so a DNS hiccup never
empties a pool.

The worker pools are the router's (``router.py``), the tokenizer pool is ``tokenizer_pool.py``;
both take the new members the same way (``set_members``, known replicas keep their state) and
are polled at once when they change.

Replicas are addressed by IP from then on: a prefill worker ships KV to the decode replica the
gateway picked, not to whichever replica the name resolves to next. IPv4 answers are preferred
when a name has both (a worker bound to ``0.0.0.0`` is not reachable on ``::1``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

from services.common.periodic import Periodic
from services.gateway.backend import Backend, Role
from services.gateway.router import Router
from services.gateway.tokenizer_pool import TokenizerPool

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``(host, port) -> ["ip:port", ...]``."""
PoolName = Literal["tokenizer", "prefill", "decode"]


async def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (IPv4 first choice), as ``ip:port``."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET})
    v6 = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET6})
    return [f"{ip}:{port}" for ip in v4] or [f"[{ip}]:{port}" for ip in v6]


def split_address(entry: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) as ``(host, port)``."""
    host, _, port = entry.rpartition(":")
    return host.strip("[]"), int(port)


def is_name(entry: str) -> bool:
    """Whether the host of ``entry`` is a DNS name (not an IP address literal)."""
    host, _ = split_address(entry)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


class Membership:
    """Keeps the router's worker pools and the tokenizer pool equal to what the configured
    entries resolve to."""

    def __init__(
        self,
        backend: Backend,
        router: Router,
        entries: dict[PoolName, Sequence[str]],
        *,
        tokenizers: TokenizerPool | None = None,
        interval_s: float = 5.0,
        resolver: Resolver = resolve,
    ) -> None:
        if "tokenizer" in entries and tokenizers is None:
            raise TypeError("tokenizer entries need the tokenizer pool")  # a programming error
        self._backend = backend
        self._router = router
        self._tokenizers = tokenizers
        self._entries = {name: list(values) for name, values in entries.items()}
        self._resolver = resolver
        self._resolved: dict[str, list[str]] = {}
        self._refresher = Periodic(self.refresh, interval_s, "membership refresh")

    @property
    def dynamic(self) -> bool:
        """Whether any entry is a name (otherwise the pools never change)."""
        return any(is_name(e) for values in self._entries.values() for e in values)

    async def refresh(self) -> None:
        """Resolve every name entry once and update the pools (polling new members at once)."""
        changed: set[PoolName] = set()
        for name, values in self._entries.items():
            addresses: list[str] = []
            for entry in values:
                for address in await self._addresses(entry):
                    if address not in addresses:
                        addresses.append(address)
            if addresses != self._members(name):
                self._set_members(name, addresses)
                changed.add(name)
        if changed - {"tokenizer"}:
            await self._router.poll_once()
        if "tokenizer" in changed and self._tokenizers is not None:
            await self._tokenizers.poll_new()

    def _members(self, name: PoolName) -> list[str]:
        if name == "tokenizer":
            return self._tokenizers.addresses if self._tokenizers is not None else []
        return [w.address for w in self._router.workers(name)]

    def _set_members(self, name: PoolName, addresses: list[str]) -> None:
        if name == "tokenizer":
            if self._tokenizers is not None:
                self._tokenizers.set_members([self._backend.tokenizer(a) for a in addresses])
            return
        role: Role = name
        self._router.set_members(role, [self._backend.worker(role, a) for a in addresses])

    async def _addresses(self, entry: str) -> list[str]:
        if not is_name(entry):
            return [entry]
        host, port = split_address(entry)
        try:
            found = await self._resolver(host, port)
        except (OSError, UnicodeError) as err:
            logger.warning("cannot resolve %s (%s); keeping its last addresses", entry, err)
            return self._resolved.get(entry, [entry])
        if found:
            self._resolved[entry] = found
        return found or self._resolved.get(entry, [entry])

    async def start(self) -> None:
        """Resolve now; keep re-resolving in the background when an entry is a name."""
        if not self.dynamic:
            return
        await self.refresh()
        self._refresher.start()

    async def stop(self) -> None:
        await self._refresher.stop()
