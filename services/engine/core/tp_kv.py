"""Rank 0's whole-width view of a tensor-parallel worker's paged KV, for the KV hand-off.

Each rank's pool holds its own KV heads only (``tp_shard.py``); the hand-off moves a block as
*every* KV head of the model, in head order — the bytes a width-1 worker's block holds. So the
wire format does not depend on either worker's width: a block leaves a worker of width N and
lands in a worker of width M for any N and M that split the model, and a width-1 worker on
either end runs the hand-off exactly as before (this file is not involved).

:class:`FullWidthKV` is what the transfer code (``kv_transfer/payload.py``) reads from and writes
into on rank 0 of a split worker, in place of its ``KVPool``:

* **read** (a prefill worker sending): rank 0 tells the followers which blocks
  (``KV_GATHER``, over the plan pipe), every rank reads them from its pool, and one
  ``gather`` collective brings the ranks' head blocks to rank 0, which lays them side by side by
  head (a KV head replicated on several ranks, where N exceeds the KV heads, is taken from the
  first of them);
* **write** (a decode worker receiving): rank 0 cuts the whole-width blocks into each rank's
  heads (a replicated head goes to every rank that holds it), tells the followers which blocks
  (``KV_SCATTER``), and one ``scatter`` collective hands each rank its part, which it writes
  into its pool.

Why rank 0 gathers and scatters, rather than each rank talking to the peer worker: the hand-off
keeps one stream per request, with one header, one lease, one reservation, one crc32 per chunk,
one commit and one ack — all of which (and abort, expiry and migration) stay exactly as they are
at width 1, and the peer needs to know nothing about this worker's split. Per-rank streams would
need N x M pairings, a commit across streams and a partial-failure story for each. What it
costs: the payload crosses the group's collective transport once more (a whole-width block
passes through rank 0's memory: (N - 1) / N of its bytes come from, or go to, the followers),
and the gather / scatter runs on the engine thread like any transfer read or write, between
steps. On one CPU host that is a loopback copy of a few MiB per request; on NCCL it is a device
to device copy.

Both calls run on rank 0's engine thread (``EngineLoop.call``), so they are ordered with the
steps' plans on the pipe and with their collectives: every rank issues the same collectives in
the same order.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from services.common.model_config import ModelConfig
from services.engine.core.kv_cache import KVLayout, KVPool
from services.engine.core.tp_group import KV_GATHER, KV_SCATTER, TensorParallelGroup
from services.engine.core.tp_shard import ShardSizes

HEADS = 4  # the KV-head axis of blocks: [blocks, layers, 2 (K, V), block_size, kv_heads, row]


class FullWidthKV:
    """Rank 0's view of every rank's KV heads (see the module docstring): ``layout`` is the
    whole model's (all its KV heads); ``read_blocks`` / ``write_blocks`` as ``KVPool``'s."""

    def __init__(self, group: TensorParallelGroup, kv: KVPool, config: ModelConfig) -> None:
        if group.rank != 0:
            raise RuntimeError("only rank 0 moves a tensor-parallel worker's KV")
        self.group = group
        self.kv = kv
        self.layout: KVLayout = replace(kv.layout, num_kv_heads=config.num_kv_heads)
        # each rank's run of the model's KV heads: (first head, how many)
        self.runs = [(s.kv_start, s.kv_heads) for s in
                     (ShardSizes.of(config, r, group.world) for r in range(group.world))]
        if any(count != kv.layout.num_kv_heads for _, count in self.runs):
            raise RuntimeError("the ranks' KV pools do not hold the same number of heads")

    @property
    def world(self) -> int:
        return self.group.world

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The given blocks with every rank's KV heads, ``[len(block_ids), *block_shape]``."""
        ids = list(block_ids)
        self.group.send(KV_GATHER, ids)
        parts = self.group.gather(self.kv.read_blocks(ids))
        shape = list(parts[0].shape)
        shape[HEADS] = self.layout.num_kv_heads
        full = parts[0].new_empty(shape)
        filled: set[int] = set()
        for (start, count), part in zip(self.runs, parts, strict=True):
            if start in filled:
                continue  # a replicated head: the first rank holding it already gave it
            full.narrow(HEADS, start, count).copy_(part)
            filled.add(start)
        return full

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Copy whole-width ``blocks`` into the given block slots of every rank's pool, each rank
        taking its KV heads."""
        ids = list(block_ids)
        blocks = blocks.to(self.kv.data.device, self.kv.data.dtype)
        parts = [blocks.narrow(HEADS, start, count) for start, count in self.runs]
        self.group.send(KV_SCATTER, ids)
        mine = torch.empty_like(parts[0], memory_format=torch.contiguous_format)
        self.group.scatter(mine, parts)
        self.kv.write_blocks(ids, mine)


def follow_kv(group: TensorParallelGroup, kv: KVPool, kind: str, block_ids: list[int]) -> None:
    """A follower's side of :class:`FullWidthKV`: give rank 0 its heads of ``block_ids``
    (``KV_GATHER``) or write the heads rank 0 scatters into them (``KV_SCATTER``)."""
    if kind == KV_GATHER:
        group.gather(kv.read_blocks(block_ids))
    elif kind == KV_SCATTER:
        mine = torch.empty(len(block_ids), *kv.data.shape[1:], dtype=kv.data.dtype,
                           device=kv.data.device)  # fmt: skip
        group.scatter(mine)
        kv.write_blocks(block_ids, mine)
    else:
        raise RuntimeError(f"unknown KV plan {kind!r}")


def handoff_kv(kv: KVPool, group: TensorParallelGroup | None, config: ModelConfig) -> KVPool | FullWidthKV:
    """What a hand-off reads and writes: ``kv`` itself at width 1, else rank 0's whole-width view."""
    if group is None or group.world == 1:
        return kv
    return FullWidthKV(group, kv, config)
