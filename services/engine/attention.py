"""Attention over the paged KV cache, behind one interface with a plain-torch reference.

The model runner builds one :class:`AttentionMetadata` per step; every layer's attention call
receives it together with that layer's K/V views of the :class:`~services.engine.kv_cache.KVPool`.
A step is either a *prefill* step (one or more sequences, each with a run of new tokens after an
optional already-cached prefix) or a *decode* step (one new token for each of B sequences of
different lengths). A faster backend (e.g. a Triton kernel) implements :class:`PagedAttention`
with the same signature and is compared to :class:`TorchPagedAttention` in tests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's new tokens go and what each sequence attends to.

    Attributes:
        is_prefill: prefill step (variable new tokens per sequence) or decode step (one each).
        slot_blocks / slot_offsets: ``[T]`` block id and in-block offset for each new token.
        query_lens: new tokens per sequence (prefill), in order of the flattened batch.
        context_lens: total tokens per sequence after this step (cached prefix + new).
        block_tables: ``[B, max_blocks]`` block ids per sequence, padded with 0.
        decode_mask: ``[B, 1, 1, L]`` bool, True where a decode query may attend (decode steps
            of more than one sequence only).
        context_lens_tensor: ``context_lens`` as an int64 device tensor (decode only), for kernels.
    """

    is_prefill: bool
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    decode_mask: torch.Tensor | None = None
    context_lens_tensor: torch.Tensor | None = None

    @staticmethod
    def build(
        *,
        is_prefill: bool,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Compute slot mappings, the padded block table and the decode mask."""
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        for qlen, ctx, table in zip(query_lens, context_lens, block_tables):
            for pos in range(ctx - qlen, ctx):
                slot_blocks.append(table[pos // block_size])
                slot_offsets.append(pos % block_size)
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        tables = torch.tensor(padded, dtype=torch.long, device=device)
        mask = lens = None
        if not is_prefill:
            lens = torch.tensor(context_lens, dtype=torch.long, device=device)
            if len(context_lens) > 1:  # one sequence attends to exactly its context, unmasked
                span = torch.arange(width * block_size, device=device)
                mask = (span[None, :] < lens[:, None])[:, None, None, :]
        return AttentionMetadata(
            is_prefill=is_prefill,
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=device),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=device),
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            block_tables=tables,
            decode_mask=mask,
            context_lens_tensor=lens,
        )

    def decode_context_lens(self) -> torch.Tensor:
        """``context_lens`` as an int64 tensor on the block tables' device (built once)."""
        if self.context_lens_tensor is None:
            self.context_lens_tensor = torch.tensor(
                self.context_lens, dtype=torch.long, device=self.block_tables.device
            )
        return self.context_lens_tensor


class PagedAttention(ABC):
    """Stores this step's K/V into the cache, then attends over each sequence's context."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Args: q ``[T, H, D]``, k/v ``[T, KVH, D]``, caches ``[NB, BS, KVH, D]``.

        Returns: ``[T, H, D]`` attention output for the new tokens.
        """

    def native_decode(self, batch: int) -> bool:
        """Whether a float32 decode step of ``batch`` sequences runs the native C kernel (which a
        whole-layer C step can then call directly); False for backends without one."""
        return False


class TorchPagedAttention(PagedAttention):
    """Reference path: gather each sequence's blocks and call ``scaled_dot_product_attention``.

    Decode kernels subclass it and override :meth:`decode` only: storing K/V and prefill stay
    here, shared.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self.store_kv(k, v, k_cache, v_cache, meta)
        if meta.is_prefill:
            return self._prefill(q, k, v, k_cache, v_cache, meta, scale)
        return self.decode(q, k_cache, v_cache, meta, scale)

    @staticmethod
    def store_kv(
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Write this step's K/V into their slots (shared by every backend)."""
        k_cache[meta.slot_blocks, meta.slot_offsets] = k
        v_cache[meta.slot_blocks, meta.slot_offsets] = v

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        outputs: list[torch.Tensor] = []
        start = 0
        block_size = k_cache.shape[1]
        for i, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            qi = q[start : start + qlen].transpose(0, 1)  # [H, n, D]
            cached = ctx - qlen
            if cached == 0:
                ki = k[start : start + qlen].transpose(0, 1)
                vi = v[start : start + qlen].transpose(0, 1)
                out = F.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                nblocks = (ctx + block_size - 1) // block_size
                table = meta.block_tables[i, :nblocks]
                ki = k_cache[table].flatten(0, 1)[:ctx].transpose(0, 1)  # [KVH, ctx, D]
                vi = v_cache[table].flatten(0, 1)[:ctx].transpose(0, 1)
                rows = torch.arange(cached, ctx, device=q.device)[:, None]
                cols = torch.arange(ctx, device=q.device)[None, :]
                out = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=cols <= rows, scale=scale, enable_gqa=True
                )
            outputs.append(out.transpose(0, 1))
            start += qlen
        return torch.cat(outputs, dim=0)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """One query per sequence: q ``[B, H, D]`` over its context in the cache → ``[B, H, D]``."""
        batch = q.shape[0]
        keys = k_cache[meta.block_tables].flatten(1, 2)  # [B, L, KVH, D]
        values = v_cache[meta.block_tables].flatten(1, 2)
        mask = meta.decode_mask
        if batch == 1:  # no padding: attend to exactly the context, no mask
            ctx = meta.context_lens[0]
            keys, values, mask = keys[:, :ctx], values[:, :ctx], None
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, H, 1, D]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)
