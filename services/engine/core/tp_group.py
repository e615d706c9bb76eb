"""One tensor-parallel group: the ranks of one worker, their collectives, and the step plan that
rank 0 hands its followers.

Two channels, on purpose:

* the *math* (the all-reduces after the row-parallel layers and the vocab-parallel embedding, the
  all-gather of the head's logits, the broadcast of the rows to project) runs over
  ``torch.distributed`` — Gloo for CPU tensors, NCCL for CUDA ones — initialised with a timeout, so
  a rank that dies mid-step makes the others' collective fail (or time out) instead of waiting
  forever;
* the *plan* (what the next step is: its token ids, positions, block tables; or "project these
  rows"; or "stop") travels from rank 0 to each follower over a local pipe. A follower idles in a
  blocking read of that pipe, not in a collective: an idle worker would otherwise trip the
  collectives' timeout, and a pipe says at once, by its end of file, that rank 0 is gone.

``torch.distributed`` is imported only once a group is joined (the engine core alone, at width 1,
does not need it).

Only rank 0 sends plans (:meth:`TensorParallelGroup.send`); followers only read them
(:meth:`TensorParallelGroup.recv`). Nothing here knows about models: see ``tp_shard.py`` (what a
rank holds) and ``tp_follower.py`` (what a follower runs).
"""

from __future__ import annotations

import contextlib

import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from services.common.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
"""How long any collective may wait for the other ranks before it fails (a dead rank's peers
give up after this at the latest; Gloo notices a closed connection sooner)."""

# plan kinds rank 0 sends (the first item of every message); KV_GATHER / KV_SCATTER move KV
# blocks of a hand-off between rank 0 and the followers (``tp_kv.py``)
LOAD, POOL, STEP, LOGITS, STOP = "load", "pool", "step", "logits", "stop"
KV_GATHER, KV_SCATTER = "kv_gather", "kv_scatter"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for the group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_width(world: int) -> int:
    """``world`` as a tensor-parallel width, or an InvalidArgumentError naming the flag."""
    if not isinstance(world, int) or world < 1:
        raise InvalidArgumentError(
            f"--tensor-parallel-size must be a positive integer, got {world!r}",
            param="tensor_parallel_size",
        )
    return world


@dataclass(eq=False)
class TensorParallelGroup:
    """This process's place in a worker's tensor-parallel group (``world`` ranks, one process
    each) and the pipes of the plan: rank 0 holds one per follower, a follower one to rank 0."""

    rank: int
    world: int
    device: torch.device
    pipes: list[Connection] = field(default_factory=list)
    timeout_s: float = DEFAULT_TIMEOUT_S
    processes: list[BaseProcess] = field(default_factory=list)  # rank 0: the followers it started
    closed: bool = False

    @classmethod
    def join(
        cls,
        rank: int,
        world: int,
        port: int,
        device: torch.device | str = "cpu",
        pipes: list[Connection] | None = None,
        *,
        host: str = "127.0.0.1",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> TensorParallelGroup:
        """Join the group at ``host:port`` as ``rank`` of ``world`` (blocks until all have
        joined, ``timeout_s`` at most): Gloo for a CPU ``device``, NCCL for a CUDA one (each rank
        its own GPU, ``cuda:<rank>`` unless ``device`` names one)."""
        check_width(world)
        device = torch.device(device)
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            backend = "gloo"
            # Gloo's own sockets on the loopback too (the ranks share one machine), unless the
            # operator chose an interface: a hostname that resolves elsewhere cannot strand them
            if host.startswith("127.") and sys.platform.startswith("linux"):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group")
        dist.init_process_group(
            backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
        logger.info("tensor-parallel rank %d of %d joined (%s on %s)", rank, world, backend, device)
        return cls(rank, world, device, list(pipes or []), timeout_s)

    # ---- the math ------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (made contiguous first where it is not);
        returns the summed tensor."""
        import torch.distributed as dist

        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        dist.all_reduce(tensor)
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` into every rank's (same shape and dtype), in place."""
        import torch.distributed as dist

        dist.broadcast(tensor, src=0)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape everywhere) side by side along the last dim, in
        rank order."""
        import torch.distributed as dist

        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts, dim=-1)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere) at rank 0, in rank order; an empty
        list on the followers."""
        import torch.distributed as dist

        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(tensor, parts, dst=0)
        return parts or []

    def scatter(self, out: torch.Tensor, parts: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Rank 0's ``parts[r]`` into rank r's ``out`` (same shape everywhere), in place;
        followers pass no ``parts``."""
        import torch.distributed as dist

        dist.scatter(out, [p.contiguous() for p in parts] if self.rank == 0 and parts else None,
                     src=0)  # fmt: skip
        return out

    # ---- the plan --------------------------------------------------------------------------
    def send(self, *message: Any) -> None:
        """Rank 0: hand ``message`` to every follower (a follower that is gone raises
        BrokenPipeError / OSError here)."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends tensor-parallel plans")
        for pipe in self.pipes:
            pipe.send(message)

    def recv(self) -> tuple[Any, ...]:
        """A follower: the next message of rank 0, blocking (EOFError when rank 0 is gone)."""
        message = self.pipes[0].recv()
        if not isinstance(message, tuple) or not message:
            raise RuntimeError(f"malformed tensor-parallel plan message {message!r}")
        return message

    def close(self) -> None:
        """Rank 0: tell the followers to stop; every rank: leave the process group."""
        if self.closed:
            return
        self.closed = True
        if self.rank == 0:
            for pipe in self.pipes:
                with contextlib.suppress(OSError):  # a follower already gone
                    pipe.send((STOP,))
        for pipe in self.pipes:
            pipe.close()
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError as exc:  # a peer already gone
                logger.debug("destroy_process_group: %s", exc)
        for process in self.processes:
            process.join(self.timeout_s)
            if process.is_alive():
                logger.warning("tensor-parallel follower %s did not stop; killing it", process.name)
                process.kill()
                process.join()
