"""The decode side of the KV channel's rendezvous store: one namespace per pair group, reached by
prefill through the ``Decode.KVStore`` RPC on the worker's own mutual-TLS gRPC server.

Why not a ``TCPStore``: a torch ``TCPStore`` has no authentication, so anyone who reached its
port could read and write every pair's rendezvous keys (and so steer a pair's Gloo connection).
Here the store rides the deployment's mTLS gRPC instead: the role check admits only a prefill
certificate to ``KVStore`` (``peer_roles.py``), and each namespace answers only the caller the
group was advertised to (its :func:`~services.common.peer_roles.peer_identity`: host and
certificate digest).

A namespace's life (:class:`ChannelStore`):

  1. ``open(group, owner)`` (the decode worker advertising a new pair group to ``owner``)
     creates the group's namespace: a ``torch.distributed.HashStore``, which decode's own rank
     uses directly (it lives in this process) while prefill's rank uses it through ``serve``.
  2. ``serve(request, caller)`` runs one store op for the RPC. An unknown group, or one owned by
     another caller, is NOT_FOUND (a stranger learns nothing of other pairs); GET and WAIT wait
     on the event loop, polling (never on a thread: a waiting peer holds no thread), at most the
     set-up timeout. Values and key counts are bounded, so a peer cannot grow decode's memory.
  3. ``close(group)`` drops the namespace when the group is retired: its keys go with it.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import dataclass

import torch.distributed as dist

from services.common.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from services.common.pb import decode_pb2

logger = logging.getLogger(__name__)

MAX_VALUE_BYTES = 64 * 1024
"""Largest value one key may hold (Gloo's rendezvous values are addresses: tens of bytes)."""
MAX_KEYS = 256
"""Most keys one namespace may hold (a 2-rank Gloo rendezvous sets a handful)."""
MAX_KEY_CHARS = 512
_POLL_FIRST, _POLL_MAX = 0.001, 0.02  # seconds between checks of a waited-for key

Op = decode_pb2.KVStoreRequest


@dataclass(slots=True)
class _Namespace:
    store: dist.HashStore
    owner: str


class ChannelStore:
    """The rendezvous namespaces of one decode worker's pair groups; see the module lifecycle."""

    def __init__(self, *, max_wait: float) -> None:
        """``max_wait``: the longest a GET or WAIT may wait (the pairs' set-up timeout)."""
        self.max_wait = max_wait
        self._namespaces: dict[str, _Namespace] = {}

    def open(self, group: str, owner: str) -> dist.HashStore:
        """Create ``group``'s namespace for the peer ``owner``; the store decode's rank uses."""
        store = dist.HashStore()
        store.set_timeout(datetime.timedelta(seconds=self.max_wait))
        self._namespaces[group] = _Namespace(store, owner)
        return store

    def close(self, group: str) -> None:
        """Drop ``group``'s namespace and its keys (no-op when it has none)."""
        self._namespaces.pop(group, None)

    def close_all(self) -> None:
        self._namespaces.clear()

    def __len__(self) -> int:
        return len(self._namespaces)

    async def serve(
        self, request: decode_pb2.KVStoreRequest, caller: str
    ) -> decode_pb2.KVStoreResponse:
        """Run one store op for ``caller`` (see ``Decode.KVStore`` in decode.proto).

        Raises:
            NotFoundError: no namespace ``request.group`` for this caller.
            InvalidArgumentError: an unknown op, or a key missing or too long.
            ResourceExhaustedError: a value or the namespace's key count over its bound.
            UnavailableError: GET / WAIT timed out.
        """
        namespace = self._namespaces.get(request.group)
        if namespace is None or namespace.owner != caller:
            raise NotFoundError(f"no KV channel group {request.group!r} for this peer",
                                param="group")  # fmt: skip
        store, keys = namespace.store, list(request.keys)
        for key in keys:
            if not key or len(key) > MAX_KEY_CHARS:
                raise InvalidArgumentError("store keys must be 1 to "
                                           f"{MAX_KEY_CHARS} characters", param="keys")
        op = request.op
        if op in (Op.SET, Op.GET, Op.ADD, Op.COMPARE_SET, Op.DELETE_KEY) and len(keys) != 1:
            raise InvalidArgumentError(f"{Op.Op.Name(op)} takes exactly one key", param="keys")
        if op == Op.SET:
            self._check_room(store, keys[0], request.value)
            store.set(keys[0], request.value)
            return decode_pb2.KVStoreResponse()
        if op == Op.GET:
            await self._wait(store, keys, request.timeout_seconds)
            return decode_pb2.KVStoreResponse(value=store.get(keys[0]))
        if op == Op.ADD:
            self._check_room(store, keys[0], b"")
            return decode_pb2.KVStoreResponse(number=store.add(keys[0], request.amount))
        if op == Op.CHECK:
            return decode_pb2.KVStoreResponse(ok=store.check(keys))
        if op == Op.WAIT:
            await self._wait(store, keys, request.timeout_seconds)
            return decode_pb2.KVStoreResponse(ok=True)
        if op == Op.COMPARE_SET:
            self._check_room(store, keys[0], request.value)
            value = store.compare_set(keys[0], request.expected, request.value)
            return decode_pb2.KVStoreResponse(value=value)
        if op == Op.DELETE_KEY:
            return decode_pb2.KVStoreResponse(ok=store.delete_key(keys[0]))
        if op == Op.NUM_KEYS:
            return decode_pb2.KVStoreResponse(number=store.num_keys())
        raise InvalidArgumentError(f"unknown store op {op}", param="op")

    def _check_room(self, store: dist.HashStore, key: str, value: bytes) -> None:
        if len(value) > MAX_VALUE_BYTES:
            raise ResourceExhaustedError(f"a store value is at most {MAX_VALUE_BYTES} bytes")
        if not store.check([key]) and store.num_keys() >= MAX_KEYS:
            raise ResourceExhaustedError(f"a KV channel group's store holds at most {MAX_KEYS} "
                                         "keys")  # fmt: skip

    async def _wait(self, store: dist.HashStore, keys: list[str], timeout: float) -> None:
        """Return once every key is set; UnavailableError after ``timeout`` (capped)."""
        limit = min(timeout, self.max_wait) if timeout > 0 else self.max_wait
        deadline = time.monotonic() + limit
        pause = _POLL_FIRST
        while not store.check(keys):
            if time.monotonic() >= deadline:
                raise UnavailableError(f"store keys {keys} not set within {limit:g}s")
            await asyncio.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)
