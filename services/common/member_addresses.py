"""An allow-list of peer addresses that follows DNS: which decode workers a prefill worker may
ship KV to.

``Prefill.decode_address`` is chosen by the caller (the gateway). Mutual TLS already bounds it to
a server holding this deployment's *decode* certificate, but the prefill worker would still open
a TCP connection to any address it is given. With ``--decode-members`` the worker first checks
the address against the deployment's decode pool, as the gateway's own ``--decode`` entries
describe it:

1. an entry whose host is an IP literal (``10.0.0.7:50071``) allows exactly that address;
2. an entry whose host is a name (``decode:50071``, a Compose service or a Kubernetes headless
   Service) allows every address the name resolves to, resolved on first use and again at most
   every ``refresh_s`` seconds when an address is not found (a replica that just started), so a
   pod that left the pool is refused after the next resolution;
3. no entries: every address is allowed (mTLS alone bounds it; logged at start).

Addresses are compared as ``ip:port`` (``[v6]:port``), the form the gateway sends.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``(host, port) -> ["ip:port", ...]``."""

DEFAULT_REFRESH_S = 5.0


async def resolve_all(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, as ``ip:port`` / ``[v6]:port``."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out = []
    for info in infos:
        ip = str(info[4][0])
        out.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return sorted(set(out))


def _split(entry: str) -> tuple[str, int]:
    host, _, port = entry.strip().rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {entry!r}")
    return host.strip("[]"), int(port)


def _canonical(address: str) -> str | None:
    """``address`` as ``ip:port`` when its host is an IP literal, else None."""
    try:
        host, port = _split(address)
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


class MemberAddresses:
    """The addresses ``entries`` stand for; see the module docstring."""

    def __init__(
        self,
        entries: Iterable[str],
        *,
        refresh_s: float = DEFAULT_REFRESH_S,
        resolver: Resolver = resolve_all,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fixed: set[str] = set()
        self._names: list[tuple[str, int]] = []
        for entry in (e.strip() for e in entries):
            if not entry:
                continue
            canonical = _canonical(entry)
            if canonical is not None:
                self._fixed.add(canonical)
            else:
                self._names.append(_split(entry))
        self._refresh_s = refresh_s
        self._resolver = resolver
        self._clock = clock
        self._resolved: set[str] = set()
        self._resolved_at: float | None = None
        self._lock = asyncio.Lock()

    @property
    def restricted(self) -> bool:
        """Whether any entry was given (no entries: everything is allowed)."""
        return bool(self._fixed or self._names)

    async def allows(self, address: str) -> bool:
        """Whether ``address`` is one of the members now."""
        if not self.restricted:
            return True
        canonical = _canonical(address)
        if canonical is None:
            return False  # a name: the gateway always sends what it resolved
        if canonical in self._fixed or canonical in self._resolved:
            return True
        if not self._names:
            return False
        async with self._lock:
            stale = (self._resolved_at is None
                     or self._clock() - self._resolved_at >= self._refresh_s)  # fmt: skip
            if stale:
                await self._refresh()
        return canonical in self._resolved

    async def _refresh(self) -> None:
        found: set[str] = set()
        for host, port in self._names:
            try:
                found.update(await self._resolver(host, port))
            except OSError as err:  # keep what was known: a DNS hiccup refuses no member
                logger.warning("could not resolve decode member %s:%d: %s", host, port, err)
                found.update(self._resolved)
        self._resolved = {c for c in (_canonical(a) for a in found) if c is not None}
        self._resolved_at = self._clock()
