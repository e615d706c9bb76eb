"""Embeddings: the model's final hidden states (after the final norm) over whole inputs, pooled.

Why not a request of the scheduler: an embedding needs no sampling, no decode and no KV after it,
only every position of its input computed once. So :meth:`Embedder.run` is one call on the engine
thread, between steps (the worker's engine loop runs it as a command), over blocks it takes from
and gives back to the same block manager the scheduler uses:

  1. Take inputs in order while their blocks fit what the pool has free now and their tokens fit
     the wave's budget (``max_num_batched_tokens``; the first input always, however long). None
     fitting returns ``[]``: the caller retries once leases or prompts give blocks back.
  2. Allocate each taken input's blocks (fresh: no prefix-cache reuse, since mean pooling needs
     every position's hidden state and a reused block has none).
  3. Run forward passes of at most ``max_num_batched_tokens`` tokens as prefill batches; an input
     longer than that is chunked across passes, each chunk attending to the KV of the earlier ones
     (the same attention metadata as chunked prefill).
  4. Pool in float32 as each input's rows come out: ``last`` keeps its last row, ``mean`` sums its
     rows and divides by its length.
  5. Free every block (``finally``: also when a pass raises). Nothing is registered in the prefix
     cache, so the blocks go straight back to the free list.

On rank 0 of a tensor-parallel worker (``--tensor-parallel-size N``) each pass's plan goes to the
followers first, as a prefill step's does (``tp_group.STEP``: the same ids, positions and block
tables, in their own pools' blocks of the same ids), so every rank runs its shard of the pass and
its part of the all-reduces; the final hidden states come out whole on every rank (the last
layer's row-parallel outputs are all-reduced), and rank 0 pools them. The followers' KV of those
blocks is left as it is: the blocks go back to the free list, and whatever takes them next
overwrites it, as on rank 0.

:func:`finish_embedding` is the per-request part: Matryoshka truncation to ``dimensions`` and L2
normalisation (after truncating, so a truncated vector has unit length too).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgumentError, ResourceExhaustedError
from services.common.pooling_config import POOLING_MODES
from services.engine.core.attention import AttentionMetadata
from services.engine.core.block_manager import BlockManager
from services.engine.core.kv_cache import KVPool
from services.engine.core.models import CausalLM
from services.engine.core.tp_group import STEP, TensorParallelGroup
from services.engine.core.tp_shard import VocabParallelEmbedding

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Input:
    """One input of a wave: its ids, blocks, how many positions are done, its pooled sum/row."""

    token_ids: Sequence[int]
    block_ids: list[int]
    done: int = 0
    pooled: torch.Tensor | None = None


class Embedder:
    """Pooled final hidden states of a model over a paged KV pool (see the module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVPool,
        block_manager: BlockManager,
        *,
        pooling: str,
        max_num_batched_tokens: int,
    ) -> None:
        if pooling not in POOLING_MODES:
            raise InvalidArgumentError(f"unknown pooling {pooling!r}", param="pooling")
        self.model = model
        self.kv = kv
        self.block_manager = block_manager
        self.pooling = pooling
        self.budget = max(1, max_num_batched_tokens)
        self.block_size = kv.layout.block_size
        self.device = next(model.parameters()).device
        embed = model.embed_tokens
        # rank 0 of a tensor-parallel model: its followers run each pass on their shards too
        self.tp: TensorParallelGroup | None = (
            embed.tp if isinstance(embed, VocabParallelEmbedding) else None
        )

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether an input of ``num_tokens`` could ever get its blocks (an empty pool)."""
        return self.block_manager.blocks_needed(num_tokens) <= self.block_manager.num_blocks

    @torch.inference_mode()
    def run(self, inputs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Embed the longest leading run of ``inputs`` that fits now (see the module docstring);
        one float32 ``[hidden]`` vector per embedded input, in order (``[]``: none fits now).

        Raises:
            ResourceExhaustedError: the first input needs more blocks than the whole pool.
        """
        if not inputs:
            return []
        if not self.fits_ever(len(inputs[0])):
            raise ResourceExhaustedError(
                f"an input of {len(inputs[0])} tokens needs more KV blocks than this worker has",
                param="input", code="kv_cache_too_small",
            )  # fmt: skip
        wave: list[_Input] = []
        free, tokens = self.block_manager.num_free_blocks, 0
        try:
            for ids in inputs:
                need = self.block_manager.blocks_needed(len(ids))
                if need > free or (wave and tokens + len(ids) > self.budget):
                    break
                wave.append(_Input(ids, self.block_manager.allocate(need)))
                free, tokens = free - need, tokens + len(ids)
            while any(item.done < len(item.token_ids) for item in wave):
                self._pass(wave)
            return [self._result(item) for item in wave]
        finally:
            for item in wave:
                self.block_manager.free(item.block_ids)

    def _pass(self, wave: list[_Input]) -> None:
        """One forward pass over the next chunks of the wave's unfinished inputs."""
        room = self.budget
        chunks: list[tuple[_Input, int, int]] = []
        for item in wave:
            left = len(item.token_ids) - item.done
            if left <= 0 or room <= 0:
                continue
            take = min(left, room)
            chunks.append((item, item.done, item.done + take))
            room -= take
        ids: list[int] = []
        positions: list[int] = []
        for item, start, end in chunks:
            ids.extend(int(t) for t in item.token_ids[start:end])
            positions.extend(range(start, end))
        lens = [end - start for _, start, end in chunks]
        context_lens = [end for _, _, end in chunks]
        tables = [item.block_ids for item, _, _ in chunks]
        if self.tp is not None:  # the same plan a prefill step hands the followers
            self.tp.send(STEP, True, ids, positions, lens, context_lens, tables, lens)
        meta = AttentionMetadata.build(
            is_prefill=True, query_lens=lens, context_lens=context_lens, block_tables=tables,
            block_size=self.block_size, device=self.device, prompt_counts=lens,
        )  # fmt: skip
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device), self.kv, meta,
        ).float()  # fmt: skip
        row = 0
        for (item, start, end), n in zip(chunks, lens, strict=True):
            rows = hidden[row : row + n]
            row += n
            if self.pooling == "mean":
                part = rows.sum(dim=0)
                item.pooled = part if item.pooled is None else item.pooled + part
            elif end == len(item.token_ids):
                item.pooled = rows[-1].clone()
            item.done = end

    def _result(self, item: _Input) -> torch.Tensor:
        assert item.pooled is not None  # every input ran to its end
        vector = item.pooled / len(item.token_ids) if self.pooling == "mean" else item.pooled
        return vector.cpu()


def finish_embedding(
    vector: torch.Tensor, *, dimensions: int | None, normalize: bool
) -> torch.Tensor:
    """The vector a client gets: its first ``dimensions`` entries (Matryoshka; None keeps all),
    then scaled to unit L2 norm when ``normalize``.

    Raises:
        InvalidArgumentError: ``dimensions`` is not in ``[1, hidden size]`` (param ``dimensions``).
    """
    size = vector.shape[-1]
    if dimensions is not None:
        if not 1 <= dimensions <= size:
            raise InvalidArgumentError(
                f"dimensions must be between 1 and this model's embedding size {size}, got "
                f"{dimensions}", param="dimensions", code="invalid_value",
            )  # fmt: skip
        vector = vector[..., :dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector.float(), p=2.0, dim=-1)
    return vector
