"""Attention over the paged KV cache, behind one interface with a plain-torch reference.

The model runner builds one :class:`AttentionMetadata` per step; every layer's attention call
receives it together with that layer's K/V views of the :class:`~services.engine.core.kv_cache.KVPool`.
A step is either a *prefill* step (one or more sequences, each with a run of new tokens after an
optional already-cached prefix) or a *decode* step (one new token for each of B sequences of
different lengths). A prefill step that also carries one-token sequences (continuous batching
puts running sequences' decode tokens next to prompt chunks) attends in two halves
(:class:`MixedSplit`): the one-token rows as a decode batch, the prompts as a prefill. A faster
backend (e.g. a Triton kernel) implements :class:`PagedAttention`
with the same signature and is compared to :class:`TorchPagedAttention` in tests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.core import kv_quant


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
            of more than one sequence; built by :meth:`decode_mask_for` at the first layer that
            asks, PyTorch's attention, not by every step: the kernels read the lengths).
        context_lens_tensor: ``context_lens`` as an int64 device tensor (decode only), for kernels.
        token_seqs / token_rows: ``[T]`` each new token's sequence and its row among that
            sequence's new tokens (prefill only): where it sits in a padded ``[B, max_q]`` batch.
        prefill_mask: ``[B, 1, max_q, L]`` bool, True where padded query row j of sequence b may
            see key position ``0 .. cached_b + j`` (L: the longest context's whole blocks); built
            once per step for every layer, for prefill steps other than one uncached prompt
            (and other than mixed ones, whose prompts have their own in ``mixed.prefill``).
        mixed: for a prefill step that also carries decode rows — one-token sequences (running
            sequences' decode tokens next to a prompt chunk, as continuous batching schedules
            them) and the tokens a recomputed sequence had generated — the step split in two:
            those rows attend as a decode batch, the rest as a prefill.
    """

    is_prefill: bool
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    decode_mask: torch.Tensor | None = None
    context_lens_tensor: torch.Tensor | None = None
    token_seqs: torch.Tensor | None = None
    token_rows: torch.Tensor | None = None
    prefill_mask: torch.Tensor | None = None
    mixed: MixedSplit | None = None

    @staticmethod
    def build(
        *,
        is_prefill: bool,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        prompt_counts: list[int] | None = None,
    ) -> "AttentionMetadata":
        """Slot mappings, the padded block table and the decode mask, with tensor ops (no
        Python loop over tokens: a step of T new tokens costs O(B) Python, not O(T)).

        ``prompt_counts`` (prefill steps): how many of each sequence's new tokens are prompt
        tokens; the rest are tokens it generated before (a preempted or migrated sequence
        recomputing them), which attend as decode rows (see :class:`MixedSplit`)."""
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                              dtype=torch.long, device=device)  # fmt: skip
        lens = torch.tensor(context_lens, dtype=torch.long, device=device)
        batch = len(query_lens)
        token_seqs = token_rows = prefill_mask = mixed = None
        tails = decode_tails(query_lens, prompt_counts) if is_prefill else []
        one_prompt_token = batch == 1 and query_lens[0] == 1 and not (prompt_counts and prompt_counts[0] == 0)
        if any(tails) and not one_prompt_token:  # attended in halves: no padded mask
            mixed = MixedSplit.build(query_lens, context_lens, block_tables, block_size, device,
                                     tails)  # fmt: skip
        if is_prefill:  # token t is the token_rows[t]-th new token of sequence token_seqs[t]
            qlens = torch.tensor(query_lens, dtype=torch.long, device=device)
            token_seqs = torch.repeat_interleave(torch.arange(batch, device=device), qlens)
            starts = torch.cumsum(qlens, 0) - qlens  # first flat index of each sequence's tokens
            token_rows = torch.arange(token_seqs.numel(), device=device) - starts[token_seqs]
            positions = (lens - qlens)[token_seqs] + token_rows
            slot_blocks = tables[token_seqs, positions // block_size]
            if mixed is None and (batch > 1 or context_lens[0] != query_lens[0]):
                prefill_mask = _prefill_mask(query_lens, context_lens, lens - qlens, qlens,
                                             block_size, device)  # fmt: skip
            slot_offsets = positions % block_size
        else:  # one new token per sequence, at its last position: B integers, no tensor ops
            ends = [n - 1 for n in context_lens]
            slot_blocks = torch.tensor([t[p // block_size] for t, p in zip(block_tables, ends)],
                                       dtype=torch.long, device=device)  # fmt: skip
            slot_offsets = torch.tensor([p % block_size for p in ends], dtype=torch.long, device=device)
        return AttentionMetadata(
            is_prefill=is_prefill,
            slot_blocks=slot_blocks,
            slot_offsets=slot_offsets,
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            block_tables=tables,
            context_lens_tensor=None if is_prefill else lens,
            token_seqs=token_seqs,
            token_rows=token_rows,
            prefill_mask=prefill_mask,
            mixed=mixed,
        )

    def decode_mask_for(self, keys: int) -> torch.Tensor | None:
        """``decode_mask`` over ``keys`` gathered positions (``None`` for one sequence, which
        attends to exactly its context), built once per step."""
        if self.decode_mask is None and len(self.context_lens) > 1:
            lens = self.decode_context_lens()
            span = torch.arange(keys, device=lens.device)
            self.decode_mask = (span[None, :] < lens[:, None])[:, None, None, :]
        return self.decode_mask

    def decode_context_lens(self) -> torch.Tensor:
        """``context_lens`` as an int64 tensor on the block tables' device (built once)."""
        if self.context_lens_tensor is None:
            self.context_lens_tensor = torch.tensor(
                self.context_lens, dtype=torch.long, device=self.block_tables.device
            )
        return self.context_lens_tensor


def decode_tails(query_lens: list[int], prompt_counts: list[int] | None) -> list[int]:
    """How many of each sequence's last new tokens attend as decode rows in a prefill step: a
    one-token sequence's token (a running sequence's decode step batched with prompt chunks), and
    the tokens a recomputed sequence had generated (``query_lens[i] - prompt_counts[i]``)."""
    if prompt_counts is None:
        return [1 if n == 1 else 0 for n in query_lens]
    return [1 if n == 1 else n - p for n, p in zip(query_lens, prompt_counts, strict=True)]


@dataclass(slots=True)
class MixedSplit:
    """A prefill step's decode rows (``decode_rows`` of the flattened tokens, attending as the
    ``decode`` batch, one row each) and the others (``prefill_rows``, the ``prefill`` step;
    ``None`` when every row is a decode row).

    Why: padded into one ``[B, max_q]`` batch, every one-token sequence next to a 256-token
    prompt chunk would be padded to 256 query rows and score all of them against its context:
    the step's attention grows with the number of running sequences times the chunk length.
    Split, the one-token rows take the decode path (a native kernel where there is one) and only
    the prompts are padded, among themselves.

    And a preempted or migrated sequence recomputing the tokens it generated attends each of
    them as a decode row, over its context up to that token, as when it was generated: the
    prefill kernel sums the same scores in another order, and the last-bit differences, rounded
    to int8 by the next matmul (``q4_a8_decode``), could turn its greedy text elsewhere.
    """

    decode_rows: torch.Tensor
    decode: AttentionMetadata
    prefill_rows: torch.Tensor
    prefill: AttentionMetadata | None

    @staticmethod
    def build(
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        tails: list[int],
    ) -> MixedSplit:
        decode_rows: list[int] = []
        decode_lens: list[int] = []
        decode_tables: list[list[int]] = []
        prefill_rows: list[int] = []
        prefill_seqs: list[int] = []
        start = 0
        for i, (n, tail) in enumerate(zip(query_lens, tails, strict=True)):
            head = n - tail  # rows attending as a prompt
            if head:
                prefill_seqs.append(i)
                prefill_rows.extend(range(start, start + head))
            for j in range(head, n):  # row j sees the context up to its own token
                decode_rows.append(start + j)
                decode_lens.append(context_lens[i] - n + j + 1)
                decode_tables.append(block_tables[i])
            start += n
        decode = AttentionMetadata.build(
            is_prefill=False, query_lens=[1] * len(decode_rows), context_lens=decode_lens,
            block_tables=decode_tables, block_size=block_size, device=device,
        )  # fmt: skip
        prefill = None
        if prefill_seqs:
            prefill = AttentionMetadata.build(
                is_prefill=True, query_lens=[query_lens[i] - tails[i] for i in prefill_seqs],
                context_lens=[context_lens[i] - tails[i] for i in prefill_seqs],
                block_tables=[block_tables[i] for i in prefill_seqs], block_size=block_size,
                device=device,
            )  # fmt: skip
        return MixedSplit(
            decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=device),
            decode=decode,
            prefill_rows=torch.tensor(prefill_rows, dtype=torch.long, device=device),
            prefill=prefill,
        )


def _prefill_mask(
    query_lens: list[int],
    context_lens: list[int],
    cached: torch.Tensor,
    qlens: torch.Tensor,
    block_size: int,
    device: torch.device | str,
) -> torch.Tensor:
    """``[B, 1, max_q, L]``: query row j of sequence b sees positions ``0 .. cached_b + j``;
    padding rows (j >= its query length) see position 0 only, so no row is all masked."""
    max_q = max(query_lens)
    keys = -(-max(context_lens) // block_size) * block_size
    rows = torch.arange(max_q, device=device)
    last = cached[:, None] + rows[None, :]  # [B, max_q]: the last position each row may see
    last = torch.where(rows[None, :] < qlens[:, None], last, 0)
    return (torch.arange(keys, device=device)[None, None, :] <= last[:, :, None])[:, None]


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
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Args: q ``[T, H, D]``, k/v ``[T, KVH, D]``, caches ``[NB, BS, KVH, D]``; ``window``:
        a query at position p sees keys at ``p - window < k <= p`` only (sliding-window layers);
        ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the softmax.

        Returns: ``[T, H, D]`` attention output for the new tokens.
        """

    def native_decode(self, batch: int) -> bool:
        """Whether a float32 decode step of ``batch`` sequences runs the native C kernel (which a
        whole-layer C step can then call directly); False for backends without one."""
        return False


class TorchPagedAttention(PagedAttention):
    """Reference path: gather each sequence's blocks and call ``scaled_dot_product_attention``.

    Kernels subclass it and override :meth:`decode` and :meth:`prefill` (either falls back to
    this reference for inputs its kernel does not take); storing K/V stays here, shared.
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
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        self.store_kv(k, v, k_cache, v_cache, meta)
        if window is not None or softcap is not None:
            # a kernel that does not take these options yet: the reference below, masked
            return _windowed_forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
        if not meta.is_prefill:
            return self.decode(q, k_cache, v_cache, meta, scale)
        split = meta.mixed
        if split is None:
            return self.prefill(q, k, v, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)  # K/V of every row are stored: the halves only read the cache
        out[split.decode_rows] = self.decode(q[split.decode_rows], k_cache, v_cache, split.decode,
                                             scale)  # fmt: skip
        if split.prefill is not None:
            rows = split.prefill_rows
            out[rows] = self.prefill(q[rows], k[rows], v[rows], k_cache, v_cache, split.prefill,
                                     scale)  # fmt: skip
        return out

    @staticmethod
    def store_kv(
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Write this step's K/V into their slots (shared by every backend), rounded to the
        cache's dtype (a 16-bit or ``q8_0`` cache under a float32 model: ``--kv-cache-dtype``)."""
        kv_quant.write_kv(k_cache, meta.slot_blocks, meta.slot_offsets, k)
        kv_quant.write_kv(v_cache, meta.slot_blocks, meta.slot_offsets, v)

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """All of the step's prompts in one attention call. One prompt with nothing cached is
        plain causal attention over its new tokens; otherwise (several prompts, or a cached
        prefix) every sequence's queries are padded into ``[B, max_q]``, its keys and values read
        from the cache through its block table (this step's were just stored), under the step's
        ``prefill_mask`` (built once in :meth:`AttentionMetadata.build` for every layer)."""
        if len(meta.query_lens) == 1 and meta.context_lens[0] == meta.query_lens[0]:
            if k_cache.dtype != k.dtype:  # attend to K/V as the cache holds them, as later steps do
                k, v = kv_quant.as_stored(k, k_cache.dtype), kv_quant.as_stored(v, v_cache.dtype)
            # 4-D on purpose: PyTorch's fused CPU (flash) kernel takes grouped K/V only with a
            # batch dimension; 3-D inputs fall back to the math path, which builds the whole
            # [H, T, T] score matrix (3-4x slower at 512 tokens)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=scale, enable_gqa=True,
            )  # fmt: skip
            return out[0].transpose(0, 1)
        assert meta.token_seqs is not None and meta.token_rows is not None
        mask = meta.prefill_mask
        assert mask is not None
        batch, max_q, keys_len = mask.shape[0], mask.shape[2], mask.shape[3]
        table = meta.block_tables[:, : keys_len // k_cache.shape[1]]
        head_dim = q.shape[-1]
        keys = kv_quant.read_kv(k_cache, table, q.dtype, head_dim).flatten(1, 2).transpose(1, 2)
        values = kv_quant.read_kv(v_cache, table, q.dtype, head_dim).flatten(1, 2).transpose(1, 2)
        queries = q.new_zeros(batch, max_q, *q.shape[1:])
        queries[meta.token_seqs, meta.token_rows] = q
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [B, H, max_q, D]
        return out.transpose(1, 2)[meta.token_seqs, meta.token_rows]

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
        head_dim = q.shape[-1]
        keys = kv_quant.read_kv(k_cache, meta.block_tables, q.dtype, head_dim).flatten(1, 2)
        values = kv_quant.read_kv(v_cache, meta.block_tables, q.dtype, head_dim).flatten(1, 2)
        mask = meta.decode_mask_for(keys.shape[1])
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


def _windowed_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """The reference for sliding-window and soft-capped layers, any step kind: each sequence's
    new queries against its whole context read back from the cache (this step's K/V are stored),
    under a mask that is causal and, with ``window``, drops keys ``window`` or more positions
    back. One sequence at a time: plain and obviously right, the yardstick for the kernels."""
    out = torch.empty_like(q)
    start = 0
    block_size = k_cache.shape[1]
    for seq, (n_new, ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        if not meta.is_prefill:
            n_new = 1
        blocks = meta.block_tables[seq, : -(-ctx // block_size)]
        keys = kv_quant.read_kv(k_cache, blocks, q.dtype, q.shape[-1])  # [n, BS, KVH, D]
        keys = keys.flatten(0, 1)[:ctx].transpose(0, 1)  # [KVH, ctx, D]
        values = kv_quant.read_kv(v_cache, blocks, q.dtype, q.shape[-1])
        values = values.flatten(0, 1)[:ctx].transpose(0, 1)
        query_pos = torch.arange(ctx - n_new, ctx, device=q.device)[:, None]
        key_pos = torch.arange(ctx, device=q.device)[None, :]
        visible = key_pos <= query_pos
        if window is not None:
            visible &= key_pos > query_pos - window
        rows = slice(start, start + n_new)
        out[rows] = _attend(q[rows].transpose(0, 1), keys, values, visible, scale, softcap)
        start += n_new
    return out


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q ``[H, n, D]`` over keys/values ``[KVH, L, D]`` where ``visible`` ``[n, L]`` → ``[n, H, D]``."""
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=visible, scale=scale, enable_gqa=True
        )[0]
        return out.transpose(0, 1)
    group = q.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    scores = torch.matmul(q, keys.transpose(1, 2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, values).transpose(0, 1)
