"""The prefill side of the KV channel's rendezvous store: a ``torch.distributed.Store`` whose every
op is a ``Decode.KVStore`` call on the decode worker's mutual-TLS gRPC server
(``channel_store.py`` holds the keys and says why there is no ``TCPStore``).

torch takes a store written in Python: ``dist.Store`` is a pybind11 trampoline, so a subclass's
``set`` / ``get`` / ``wait`` / ... are what ``ProcessGroupGloo``'s rendezvous calls (it uses set,
get and wait; ``PrefixStore`` forwards the rest). Two details of that trampoline shape this class:

  * C++ looks up ``deleteKey`` and ``getNumKeys`` (not ``delete_key`` / ``num_keys``) on the
    Python object, so both spellings are defined.
  * A ``PrefixStore`` (or a group) over this store keeps only the C++ half alive: the Python
    object must be kept referenced for as long as the group may call it (``PairGroup`` holds it).

The ops are blocking calls made on the pair's set-up thread (never the event loop): each one is
the asyncio RPC run on ``loop`` (the worker's event loop, where its channels live) and waited for
here, so the store reuses the transport's channel and identity. A failed call raises
``DistStoreError``, which fails the group's construction like an unreachable ``TCPStore`` would.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Awaitable, Callable

import torch.distributed as dist

from services.common.pb import decode_pb2

Op = decode_pb2.KVStoreRequest
Call = Callable[[decode_pb2.KVStoreRequest, float], Awaitable[decode_pb2.KVStoreResponse]]
"""``call(request, deadline_seconds)``: one ``Decode.KVStore`` RPC, run on the event loop."""

_RPC_SLACK_SECONDS = 5.0  # the RPC's deadline beyond a GET's / WAIT's own wait


def _text(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class RemoteStore(dist.Store):
    """A pair group's namespace of the decode worker's :class:`ChannelStore`, over gRPC."""

    def __init__(
        self, call: Call, group: str, loop: asyncio.AbstractEventLoop, timeout: float
    ) -> None:
        """``call``: runs one KVStore RPC to the decode worker; ``group``: the namespace (the
        advertised group key); ``loop``: the event loop ``call`` runs on; ``timeout``: the
        longest a GET or WAIT waits for its keys."""
        super().__init__()
        self._call = call
        self._group = group
        self._loop = loop
        self._wait_seconds = timeout
        self.set_timeout(datetime.timedelta(seconds=timeout))

    def _op(self, op: int, keys: list[str], **fields: object) -> decode_pb2.KVStoreResponse:
        request = decode_pb2.KVStoreRequest(group=self._group, op=op,  # type: ignore[arg-type]
                                            keys=keys, **fields)  # type: ignore[arg-type]
        deadline = self._wait_seconds + _RPC_SLACK_SECONDS
        future = asyncio.run_coroutine_threadsafe(self._call(request, deadline), self._loop)
        try:
            return future.result(deadline + 1.0)
        except Exception as err:  # an RPC status, a timeout, a closed loop
            future.cancel()
            raise dist.DistStoreError(f"KV channel store {Op.Op.Name(op)} {keys} failed: "
                                      f"{err}") from None  # fmt: skip

    def set(self, key: str, value: str | bytes) -> None:
        self._op(Op.SET, [key], value=_text(value))

    def get(self, key: str) -> bytes:
        return self._op(Op.GET, [key], timeout_seconds=self._wait_seconds).value

    def add(self, key: str, value: int) -> int:
        return self._op(Op.ADD, [key], amount=value).number

    def check(self, keys: list[str]) -> bool:
        return self._op(Op.CHECK, list(keys)).ok

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = self._wait_seconds if timeout is None else timeout.total_seconds()
        self._op(Op.WAIT, list(keys), timeout_seconds=min(seconds, self._wait_seconds))

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:  # fmt: skip
        return self._op(Op.COMPARE_SET, [key], expected=_text(expected_value),
                        value=_text(desired_value)).value  # fmt: skip

    def delete_key(self, key: str) -> bool:
        return self._op(Op.DELETE_KEY, [key]).ok

    def num_keys(self) -> int:
        return self._op(Op.NUM_KEYS, []).number

    deleteKey = delete_key  # the names the C++ side looks up
    getNumKeys = num_keys
