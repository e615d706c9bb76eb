"""One prefill–decode pair's collective channel: a standalone 2-rank ``torch.distributed`` group.

No global world: each pair gets its own group, built from a ``PrefixStore`` (the group's key) over
the group's namespace of the decode worker's rendezvous store (``channel_store.py``; prefill
reaches it over mutual-TLS gRPC, ``remote_store.py``), prefill as rank 0, decode as rank 1. Building is the rendezvous
(both ranks must construct the group at about the same time), so it runs on a thread and both
sides start it when a transfer first needs the pair (``distributed_transport.py`` says when).

One group's life (:class:`PairGroup`):

  1. ``build(connect)`` starts the constructor on a thread; ``ready()`` waits for it (a failure
     or a timeout: UnavailableError, and the group is broken).
  2. ``send(data, tag)`` / ``recv(nbytes, tag)`` move one piece of payload bytes. A Gloo send
     completes only once the peer posted the matching receive, and its send/recv work objects
     offer no future and no completion poll (``get_future`` is not implemented, ``is_completed``
     stays False until ``wait``), so each op is posted and waited for on a thread of its own
     (never the event loop, never the engine thread), bounded by ``op_timeout``. Cancelling the
     await abandons the thread (it ends when the op completes, times out or the peer closes).
  3. Any failed or abandoned op marks the group **broken**: Gloo closes a pair whose op timed
     out ("Application timeout caused pair closure"), and an abandoned op may leave a send or
     receive unmatched, so a broken group is never used for a new transfer.
  4. ``retire()`` takes it out of service; the torch group is dropped once the transfers still
     holding it (``acquire`` / ``release``) end. Dropping it closes its connections, which fails
     the peer's pending ops at once (``shutdown()`` and ``abort()`` do not, in Gloo); an op still
     waiting on this side keeps the connection until it ends.

Backend: :func:`pair_backend` is the one place it is chosen — NCCL when both ends' tensors are on
CUDA, Gloo otherwise. Only Gloo groups are built here (:data:`BUILT_BACKENDS`): the payload
travels as host bytes (``payload.py``), so its tensors are CPU ones.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from services.common.errors import UnavailableError

logger = logging.getLogger(__name__)

T = TypeVar("T")

PREFILL_RANK, DECODE_RANK = 0, 1
SETUP_TIMEOUT_SECONDS = 10.0
"""Longest a pair's rendezvous (store connection and group construction) may take."""
CHANNEL_KEY = "tandem-kv-channel"
"""Initial-metadata key of the decode worker's go-ahead that advertises the channel."""
STORE_OVER_GRPC = "grpc"
"""The advert's store: the ``Decode.KVStore`` RPC on the connection the go-ahead came over (a
``host:port`` there meant an unauthenticated ``TCPStore``, which prefill no longer joins)."""
BUILT_BACKENDS = ("gloo",)
"""Backends this build can make pair groups with."""
_MAX_TAG = 2**31 - 1


def pair_backend(local_device: str, peer_device: str) -> str:
    """The backend for payload tensors on these devices: ``nccl`` when both are CUDA, else
    ``gloo``."""
    return "nccl" if local_device.startswith("cuda") and peer_device.startswith("cuda") else "gloo"


@dataclass(frozen=True, slots=True)
class ChannelAdvert:
    """What decode's go-ahead tells prefill: the backend, where its store listens, the pair
    group to build or reuse, and the tag this transfer's pieces use."""

    backend: str
    store: str  # STORE_OVER_GRPC
    group: str
    tag: int

    def metadata(self) -> tuple[str, str]:
        return CHANNEL_KEY, f"{self.backend} {self.store} {self.group} {self.tag}"

    @classmethod
    def from_metadata(cls, metadata: Sequence[tuple[str, str | bytes]]) -> ChannelAdvert | None:
        """The advert in a go-ahead's metadata; None when it has none (or a malformed one)."""
        for key, value in metadata:
            if key != CHANNEL_KEY:
                continue
            parts = (value.decode() if isinstance(value, bytes) else value).split()
            if len(parts) == 4 and parts[3].isdigit():
                return cls(parts[0], parts[1], parts[2], int(parts[3]))
            logger.warning("ignoring a malformed KV channel advert %r", value)
        return None


async def in_thread(fn: Callable[[], T], name: str, *, daemon: bool = True) -> T:
    """Run blocking ``fn`` on a new thread and await its result. Cancelling the await abandons
    the thread (it runs on). A daemon thread never holds up the process's exit; a bounded one
    that must not be cut off (``daemon=False``) makes the exit wait for it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, name=name, daemon=daemon).start()
    return await future


def _new_group(
    backend: str, store: dist.Store, rank: int, timeout: float, host: str | None
) -> dist.ProcessGroupGloo:
    """A standalone 2-rank group (blocks until the other rank constructs its side)."""
    if backend != "gloo":
        raise UnavailableError(f"{backend} pair groups are not built yet")
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout)
    device = (dist.ProcessGroupGloo.create_device(hostname=host) if host
              else dist.ProcessGroupGloo.create_default_device())  # fmt: skip
    options._devices = [device]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only source buffer: it is only sent
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


class PairGroup:
    """One 2-rank group between a prefill (rank 0) and a decode worker (rank 1); see the module
    lifecycle."""

    def __init__(self, key: str, rank: int, backend: str, *, op_timeout: float) -> None:
        self.key = key
        self.rank = rank
        self.peer_rank = 1 - rank
        self.backend = backend
        self.op_timeout = op_timeout
        self.broken = False
        self.retired = False
        self.users = 0
        self.num_bytes = 0  # payload bytes this side moved (sent or received)
        self._group: dist.ProcessGroupGloo | None = None
        self._store: dist.Store | None = None  # a Python store must outlive the group's use
        self._built: asyncio.Future[None] | None = None
        self._next_tag = 0

    def build(self, connect: Callable[[], dist.Store], *, host: str | None, timeout: float) -> None:
        """Start constructing this rank's side on a thread; ``connect`` (run there too) gives
        the store the pair's keys live under (a ``PrefixStore`` of ``key`` is added here)."""

        def construct() -> dist.ProcessGroupGloo:
            store = connect()
            # the PrefixStore keeps only a Python store's C++ half alive (remote_store.py)
            self._store = store
            return _new_group(self.backend, dist.PrefixStore(self.key, store), self.rank,
                              timeout, host)  # fmt: skip

        async def run() -> None:
            started = time.monotonic()
            try:
                # Not a daemon: a test process that exited while a decode-side constructor
                # waited for a peer that never joined aborted ("terminate called without an
                # active exception", exit 134). The exit waits for it instead: construction
                # and its store calls are bounded (the set-up timeout, remote_store.py's).
                group = await in_thread(construct, f"kv-pair-{self.key}", daemon=False)
            except BaseException:
                self.broken = True
                raise
            if self.retired:
                self._drop()
                return  # nobody will use it: let it go
            self._group = group
            logger.info("KV pair group %s ready (rank %d, %s) in %.3fs", self.key, self.rank,
                        self.backend, time.monotonic() - started)  # fmt: skip

        self._built = asyncio.ensure_future(run())
        self._built.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved

    async def ready(self) -> None:
        """Wait until the group is built (raises UnavailableError when it could not be)."""
        if self._built is None:
            raise UnavailableError(f"KV pair group {self.key} was never built")
        try:
            await asyncio.shield(self._built)
        except Exception as err:  # DistStoreError & co. (RuntimeErrors), a bad address, ...
            raise UnavailableError(f"KV pair group {self.key} could not be built: {err}") from None
        if self.broken or self._group is None:
            raise UnavailableError(f"KV pair group {self.key} is out of service")

    def next_tag(self) -> int:
        """A tag no other transfer over this group uses (decode hands them out)."""
        self._next_tag = self._next_tag % _MAX_TAG + 1
        return self._next_tag

    # ------------------------------------------------------------------ data
    async def send(self, data: bytes, tag: int) -> None:
        """Send one piece to the peer (which receives it with the same tag)."""
        group = await self._usable()
        tensor = _bytes_tensor(data)

        def op() -> None:
            group.send([tensor], self.peer_rank, tag).wait(self._timedelta())

        await self._run(op, "send")
        self.num_bytes += len(data)

    async def recv(self, nbytes: int, tag: int) -> bytes:
        """Receive one piece of ``nbytes`` from the peer."""
        group = await self._usable()

        def op() -> bytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            group.recv([buffer], self.peer_rank, tag).wait(self._timedelta())
            return buffer.numpy().tobytes()

        data = await self._run(op, "recv")
        self.num_bytes += nbytes
        return data

    async def _usable(self) -> dist.ProcessGroupGloo:
        await self.ready()
        group = self._group
        if group is None:
            raise UnavailableError(f"KV pair group {self.key} is out of service")
        return group

    async def _run(self, op: Callable[[], T], what: str) -> T:
        try:
            return await in_thread(op, f"kv-{what}-{self.key}")
        except RuntimeError as err:  # Gloo: timeout, peer closed, ...
            self.broken = True
            raise UnavailableError(f"KV pair group {self.key}: {what} failed: {err}") from None
        except BaseException:  # abandoned (cancelled): the op may stay unmatched
            self.broken = True
            raise

    def _timedelta(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.op_timeout)

    # ------------------------------------------------------------------ lifetime
    def acquire(self) -> None:
        self.users += 1

    def release(self) -> None:
        self.users -= 1
        if self.retired and self.users <= 0:
            self._drop()

    def retire(self, reason: str) -> None:
        """Take the group out of service; it is dropped once no transfer holds it."""
        if self.retired:
            return
        self.retired = True
        logger.info("KV pair group %s retired: %s", self.key, reason)
        if self.users <= 0:
            self._drop()

    def _drop(self) -> None:
        """Let the torch group go (closing its connections), then the store it was built on."""
        self._group = None
        self._store = None
