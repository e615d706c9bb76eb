"""CUDA graphs for decode steps: each decoder layer's dozen kernels replayed as one launch.

A decode step of a large model on a GPU reads every weight once (milliseconds of HBM traffic)
but launches about thirty kernels per layer; launched one by one from Python, the launches, not
the memory, set the step time. A CUDA graph records a step's kernels once and replays them with
one call. What a graph needs, and how this file provides it:

1. **Static inputs.** A replay reads the same addresses it was captured with, so a step's token
   ids, positions, KV slots, block tables and context lengths (all int32) are written into a
   pinned host buffer and copied into one fixed device buffer (one copy per step) that the
   captured :class:`AttentionMetadata` views.
2. **One graph per batch size bucket** (:data:`BATCH_BUCKETS` up to ``max_batch``). A step of
   ``B`` sequences replays the smallest bucket that holds it; the rows past ``B`` are padding
   that writes its K/V into a scratch block no sequence owns (the pool's last block, which the
   engine keeps out of the block manager) and attends to that one slot.
3. **A fixed block-table width** (the context limit's blocks), so the Triton kernel's grid is
   the same at every replay (its partitioning depends only on batch size and width).
4. **Captured largest first, sharing one memory pool**: the smaller graphs reuse the larger
   ones' intermediate buffers.

Only backends whose decode reads no host values can be captured (``graph_safe``: the Triton
kernel; the torch reference slices by host-side lengths). Prefill and mixed steps run eagerly:
they are few and compute-bound.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from services.engine.core.attention import AttentionMetadata
from services.engine.core.kv_cache import KVPool
from services.engine.core.models import CausalLM

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Batch sizes a graph is captured for (those up to the engine's ``max_num_seqs``)."""


def graph_batches(max_batch: int) -> list[int]:
    """The buckets captured for batches of up to ``max_batch`` sequences (``max_batch`` itself
    is the last one when it falls between two)."""
    buckets = [b for b in BATCH_BUCKETS if b < max_batch]
    return buckets + [max_batch]


class DecodeGraphs:
    """Captured decode steps of ``model`` over ``kv``; :meth:`run` replays the fitting one."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVPool,
        *,
        max_batch: int,
        max_blocks: int,
        scratch_block: int,
    ) -> None:
        self.model = model
        self.kv = kv
        self.block_size = kv.layout.block_size
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.batches = graph_batches(max_batch)
        rows = self.batches[-1]
        # One int32 buffer: five rows (ids, positions, slot blocks, slot offsets, context
        # lengths) of ``rows`` entries, then ``rows`` block tables of ``max_blocks``; a step
        # fills its pinned host twin and copies it over at once (a bucket of B reads the first
        # B entries of each row and the first B tables, all contiguous).
        size = rows * (5 + max_blocks)
        self._device = torch.zeros(size, dtype=torch.int32, device=kv.data.device)
        self._host = torch.zeros(size, dtype=torch.int32, pin_memory=True)
        self._rows = self._device[: 5 * rows].view(5, rows)
        self._tables = self._device[5 * rows :].view(rows, max_blocks)
        host = self._host.numpy()
        self._host_rows = host[: 5 * rows].reshape(5, rows)
        self._host_tables = host[5 * rows :].reshape(rows, max_blocks)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self) -> None:
        """Record a step for every bucket, largest first (the others reuse its memory pool)."""
        started = time.monotonic()
        self._pad(0)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for batch in reversed(self.batches):
            meta, ids, positions = self._inputs(batch)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                self.model(ids, positions, self.kv, meta)  # compiles kernels, sizes workspaces
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                hidden = self.model(ids, positions, self.kv, meta)
            self._graphs[batch] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batches %s in %.1fs",
                    ",".join(map(str, self.batches)), time.monotonic() - started)  # fmt: skip

    @property
    def max_batch(self) -> int:
        return self.batches[-1]

    def run(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor | None:
        """Replay the step for these sequences (one new token each, at ``positions``); their
        final hidden states ``[B, hidden]``, or None when no captured graph fits (too many
        sequences, or a table wider than the captured one)."""
        batch = len(input_ids)
        bucket = next((b for b in self.batches if b >= batch), None)
        if bucket is None or any(len(t) > self.max_blocks for t in block_tables):
            return None
        graph, hidden = self._graphs[bucket]
        rows, tables, size = self._host_rows, self._host_tables, self.block_size
        pos = np.asarray(positions, dtype=np.int32)
        tables[:bucket] = self.scratch_block  # padding: the scratch block (see the docstring)
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = table
        rows[0, :batch] = input_ids
        rows[1, :batch] = pos
        rows[2, :batch] = tables[np.arange(batch), pos // size]
        rows[3, :batch] = pos % size
        rows[4, :batch] = pos + 1
        rows[:, batch:bucket] = 0
        rows[2, batch:bucket] = self.scratch_block
        rows[4, batch:bucket] = 1
        self._device.copy_(self._host, non_blocking=True)
        graph.replay()
        return hidden[:batch]

    def _pad(self, batch: int) -> None:
        """Every row from ``batch`` on is padding (see :meth:`run`)."""
        self._tables[batch:] = self.scratch_block
        self._rows[:, batch:] = 0
        self._rows[2, batch:] = self.scratch_block
        self._rows[4, batch:] = 1

    def _inputs(self, batch: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """The captured metadata and inputs of a ``batch``-row step: views of the buffer."""
        rows = self._rows
        meta = AttentionMetadata(
            is_prefill=False,
            slot_blocks=rows[2, :batch],
            slot_offsets=rows[3, :batch],
            query_lens=[1] * batch,
            context_lens=[1] * batch,  # host values no graph-safe backend reads
            block_tables=self._tables[:batch],
            context_lens_tensor=rows[4, :batch],
        )
        return meta, rows[0, :batch], rows[1, :batch]
