"""Start a tensor-parallel group (rank 0's side) and run a follower rank.

Rank 0 is the process that serves (the worker, or a test): :func:`start_tensor_parallel`
spawns ranks ``1 .. N-1`` as child processes, joins the group with them and has every rank load
its shard. Each follower (:func:`follower_main`) pins itself to its cores and then obeys rank 0's
plans (:func:`follow`): load its shard of the model, build the same KV pool as rank 0, run each
step's forward on its shard (its part of every all-reduce), project the rows rank 0 asks for
(its part of the logits' all-gather), give or take its KV heads of a hand-off's blocks
(``tp_kv.py``), until rank 0 says stop or is gone.

A follower never outlives rank 0: it reads its plans from a pipe whose end of file says rank 0
exited, asks Linux to kill it when its parent dies (``PR_SET_PDEATHSIG``), and its collectives
time out (``tp_group.DEFAULT_TIMEOUT_S``) if rank 0 stops mid-step.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from services.engine.core.attention import AttentionMetadata
from services.engine.core.kv_cache import KVPool
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.core.model_runner import ModelRunner
from services.engine.core.sampler import Sampler
from services.engine.core.tp_group import (
    DEFAULT_TIMEOUT_S,
    KV_GATHER,
    KV_SCATTER,
    LOAD,
    LOGITS,
    POOL,
    STEP,
    STOP,
    TensorParallelGroup,
    check_width,
    free_port,
)
from services.engine.core.tp_kv import follow_kv
from services.engine.core.tp_shard import RankShard, VocabParallelHead

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ShardSource:
    """What every rank loads: the model and how (``load_model``'s arguments)."""

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    attention: str = "auto"


def rank_cores(world: int, cores: Sequence[int] | None = None) -> list[list[int]]:
    """Disjoint runs of ``cores`` (default: this process's allowed CPUs) for ``world`` ranks,
    as even as they go; where there are fewer cores than ranks, ranks share them round-robin."""
    allowed = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(allowed) < world:
        return [[allowed[r % len(allowed)]] for r in range(world)]
    per, extra = divmod(len(allowed), world)
    runs, start = [], 0
    for r in range(world):
        size = per + (r < extra)
        runs.append(allowed[start : start + size])
        start += size
    return runs


def pin(cores: Sequence[int]) -> None:
    """Run this process (and PyTorch's intra-op threads) on ``cores`` only."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))
        torch.set_num_threads(len(cores))


def start_group(
    world: int,
    device: str = "cpu",
    *,
    cores: Sequence[int] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TensorParallelGroup:
    """Rank 0: spawn ``world - 1`` followers (each pinned to its run of :func:`rank_cores`, the
    calling thread to the first run) and join the group with them. The group's
    :meth:`~TensorParallelGroup.close` stops them."""
    check_width(world)
    runs = rank_cores(world, cores)
    port = free_port()
    context = mp.get_context("spawn")
    pipes, processes = [], []
    for rank in range(1, world):
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(
            target=follower_main, name=f"tandem-tp-rank{rank}", daemon=True,
            args=(rank, world, port, device, reader, runs[rank], timeout_s),
        )  # fmt: skip
        process.start()
        reader.close()
        pipes.append(writer)
        processes.append(process)
    pin(runs[0])
    try:
        group = TensorParallelGroup.join(0, world, port, device, pipes, timeout_s=timeout_s)
    except BaseException:
        for process in processes:
            process.kill()
        raise
    group.processes = processes
    return group


def load_sharded(group: TensorParallelGroup, source: ShardSource) -> LoadedModel:
    """Rank 0: have every rank load its shard of ``source`` (a group may load one model after
    another: tests do); the followers then follow this model's plans."""
    group.send(LOAD, source)
    return load_model(source.model, source.dtype, source.device, source.attention,
                      sharding=RankShard(group))  # fmt: skip


def start_tensor_parallel(
    source: ShardSource,
    world: int,
    *,
    cores: Sequence[int] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> LoadedModel:
    """Rank 0 of a new ``world``-wide group over ``source`` (:func:`start_group`, then
    :func:`load_sharded`); the returned model's ``sharding.group`` holds the followers."""
    group = start_group(world, source.device, cores=cores, timeout_s=timeout_s)
    try:
        return load_sharded(group, source)
    except BaseException:
        group.close()
        raise


def follower_main(
    rank: int,
    world: int,
    port: int,
    device: str,
    pipe: Connection,
    cores: Sequence[int],
    timeout_s: float,
) -> None:
    """A follower process's whole life: pin, join, follow rank 0's plans, leave."""
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s tp-rank{rank} %(levelname)s %(name)s: %(message)s")  # fmt: skip
    pin(cores)
    group = TensorParallelGroup.join(rank, world, port, device, [pipe], timeout_s=timeout_s)
    try:
        follow(group)
    except EOFError:
        logger.info("rank 0 is gone; tensor-parallel rank %d exits", rank)
    finally:
        group.close()


def follow(group: TensorParallelGroup) -> None:
    """Obey rank 0's plans until it says stop (EOFError when it is gone): load a shard, build
    the KV pool, run steps' forwards, project rows for the logits, move hand-off KV."""
    device = group.device
    loaded: LoadedModel | None = None
    runner: ModelRunner | None = None
    while True:
        message = group.recv()
        kind = message[0]
        if kind == STEP:
            if loaded is None or runner is None:
                raise RuntimeError("a step plan before the model's and the KV pool's")
            is_prefill, ids, positions, query_lens, context_lens, tables, prompt_counts = message[1:]
            meta = AttentionMetadata.build(
                is_prefill=is_prefill, query_lens=query_lens, context_lens=context_lens,
                block_tables=tables, block_size=runner.block_size, device=device,
                prompt_counts=prompt_counts,
            )  # fmt: skip
            with torch.inference_mode():  # (loading stays outside it, as on rank 0)
                loaded.model(torch.tensor(ids, dtype=torch.long, device=device),
                             torch.tensor(positions, dtype=torch.long, device=device), runner.kv,
                             meta)  # fmt: skip
        elif kind == LOGITS:
            shape, dtype = message[1:]
            head = loaded.model.lm_head if loaded is not None else None
            if not isinstance(head, VocabParallelHead):
                raise RuntimeError("rank 0 asked for logits of a model without an LM head")
            with torch.inference_mode():
                head.forward(torch.empty(shape, dtype=getattr(torch, dtype), device=device))
        elif kind in (KV_GATHER, KV_SCATTER):  # a KV hand-off's blocks (tp_kv.py)
            if runner is None:
                raise RuntimeError("a KV hand-off before the KV pool")
            follow_kv(group, runner.kv, kind, message[1])
        elif kind == POOL:  # rank 0 built (or rebuilt) its engine
            if loaded is None:
                raise RuntimeError("a KV pool before the model")
            num_blocks, layout = message[1:]
            runner = ModelRunner(loaded, KVPool(num_blocks, layout, device=device),
                                 Sampler(loaded.config.vocab_size, ()))  # fmt: skip
        elif kind == LOAD:
            source: ShardSource = message[1]
            loaded = runner = None
            loaded = load_model(source.model, source.dtype, source.device, source.attention,
                                sharding=RankShard(group))  # fmt: skip
        elif kind == STOP:
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel plan {kind!r}")


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (rank 0) dies; elsewhere the pipe's end
    of file and the collectives' timeout do it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before we asked
        os._exit(1)
