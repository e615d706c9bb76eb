"""Paged-KV block bookkeeping: reference counts, a free list and a prefix cache (docs/engine.md).

Pure Python, no torch: the block manager only hands out integer block ids; the model runner owns
the KV tensor those ids index. Keeping it torch-free lets routers and tests use it cheaply.

Each block holds ``block_size`` token slots for all layers. A sequence's block table is the list
of ids returned here; token ``t`` lives in ``block_ids[t // block_size]`` at slot
``t % block_size``::

    tokens   | t0 .. t15 | t16 .. t31 | t32 t33 _ _ ... |
    blocks   |  id 7     |  id 2      |  id 9 (partial) |
    hashes   |  h0       |  h1 = H(h0, t16..t31) | none (only full blocks are cached)

Prefix caching keys every *full* block by a hash chain, ``key_i = sha256(key_{i-1} || tokens_i)``
with token ids packed as little-endian int64 and ``key_{-1} = b""``. The key of block i therefore
names the whole prefix up to the end of block i, and is the same in every process, so a router
elsewhere can compute it with :func:`block_hashes` (``services/common/prefix_hash.py``) and ask
who holds a prefix. ``on_event`` (optional) hears every key stored, evicted or cleared, in order:
the feed a worker publishes to KV-aware routers.

A block is always in exactly one of three states::

              allocate / allocate_prompt
      FREE  ------------------------------>  IN USE (ref_count >= 1)
       ^  ^                                   |   |  ^
       |  +------ free, ref -> 0, no hash ----+   |  |
       |                                          |  | prefix hit (ref += 1)
       |                  free, ref -> 0, hashed  v  |
       +------ evict (hash dropped) -------  EVICTABLE (cached, ref 0, LRU)

Lifecycle of a request's blocks:

1. ``allocate_prompt(prompt)`` reuses cached full blocks matching the prompt's hash chain and
   appends fresh blocks for the rest; ``num_cached_tokens`` tokens need no prefill.
2. After the model writes KV for more tokens, ``cache_full_blocks(block_ids, tokens)`` registers
   the newly full blocks so later prompts can hit them. Only call it for computed tokens.
3. Decode grows the table with ``ensure_capacity(block_ids, num_tokens)`` before each step.
4. ``free(block_ids)`` drops the request's references, tail first; cached blocks stay evictable
   (a session/prefix cache) until fresh allocations run out of truly free blocks.

Allocation takes blocks from the free list first (FIFO; initially 0, 1, 2, ...) and only when it is
empty evicts the least recently freed cached block. Every mutating call is atomic: when blocks run
short it raises :class:`NoFreeBlocksError` and changes nothing.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.common.errors import InvalidArgumentError, ResourceExhaustedError, TandemError
from services.common.prefix_hash import block_hashes, chain_hash, iter_block_hashes

__all__ = ["BlockManager", "BlockManagerStats", "DoubleFreeError", "NoFreeBlocksError",
           "PrefixAllocation", "PrefixEvent", "block_hashes"]

PrefixEvent = Callable[[str, Sequence[bytes]], None]
"""``on_event(kind, digests)``: ``kind`` is ``"stored"`` (keys now cached), ``"removed"``
(evicted) or ``"cleared"`` (every key dropped; ``digests`` empty). Called on the mutating thread."""

logger = logging.getLogger(__name__)


class NoFreeBlocksError(ResourceExhaustedError):
    """Not enough free or evictable KV blocks for the request (the scheduler should preempt)."""


class DoubleFreeError(TandemError):
    """A block was freed more often than it was referenced: a bug in the caller (gRPC INTERNAL)."""


@dataclass(frozen=True, slots=True)
class PrefixAllocation:
    """The blocks given to a new prompt.

    Attributes:
        block_ids: the sequence's block table: cached prefix blocks first, then fresh ones. The
            list itself is mutable on purpose: the engine keeps it as the sequence's table and
            grows it with :meth:`BlockManager.ensure_capacity`.
        num_cached_tokens: leading prompt tokens whose KV is already in ``block_ids`` (a multiple
            of ``block_size``, always less than the prompt length).
    """

    block_ids: list[int]
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class BlockManagerStats:
    """A snapshot for metrics.

    Attributes:
        num_blocks: total blocks managed.
        num_free: blocks allocatable now (free list + evictable cached blocks).
        num_in_use: blocks with a reference count above zero.
        num_cached: evictable blocks (cached, unreferenced).
        prefix_hits: prompt tokens served from the prefix cache by ``allocate_prompt``.
        prefix_queries: prompt tokens passed to ``allocate_prompt``.
    """

    num_blocks: int
    num_free: int
    num_in_use: int
    num_cached: int
    prefix_hits: int
    prefix_queries: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class BlockManager:
    """Hands out KV block ids with reference counts and a hash-chain prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_event: PrefixEvent | None = None,
    ) -> None:
        if num_blocks < 1:
            raise InvalidArgumentError("num_blocks must be positive", param="num_blocks")
        if block_size < 1:
            raise InvalidArgumentError("block_size must be positive", param="block_size")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest-freed first
        self._block_hash: dict[int, bytes] = {}
        self._hash_to_block: dict[bytes, int] = {}
        self._prefix_hits = 0
        self._prefix_queries = 0
        self.on_event = on_event

    # ----------------------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: the free list plus evictable (unreferenced cached) blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_blocks_in_use(self) -> int:
        """Blocks with a reference count above zero."""
        return self.num_blocks - len(self._free) - len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        """Current reference count of ``block_id``."""
        self._check_id(block_id)
        return self._ref[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks required to hold ``num_tokens`` tokens."""
        if num_tokens < 0:
            raise InvalidArgumentError("num_tokens must be non-negative", param="num_tokens")
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``allocate(num_blocks)`` would succeed now."""
        return num_blocks <= self.num_free_blocks

    def match_prefix(self, token_ids: Sequence[int], root: bytes = b"") -> int:
        """Tokens of this prompt already cached, exactly as ``allocate_prompt`` would reuse them.

        Read-only (no reference counts, LRU order or statistics change), for routing decisions.
        """
        return len(self._match(token_ids, root)) * self.block_size

    def cached_digests(self) -> list[bytes]:
        """Every key the prefix cache holds now (blocks in use or evictable): a snapshot that,
        with the ``on_event`` calls after it, is the cache's exact contents."""
        return list(self._hash_to_block)

    def stats(self) -> BlockManagerStats:
        """A snapshot of occupancy and prefix-cache counters."""
        return BlockManagerStats(
            num_blocks=self.num_blocks,
            num_free=self.num_free_blocks,
            num_in_use=self.num_blocks_in_use,
            num_cached=len(self._evictable),
            prefix_hits=self._prefix_hits,
            prefix_queries=self._prefix_queries,
        )

    # ----------------------------------------------------------------------------- allocation

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` fresh blocks, each with reference count 1.

        Raises:
            NoFreeBlocksError: fewer than ``num_blocks`` are allocatable; nothing was taken.
        """
        if num_blocks < 0:
            raise InvalidArgumentError("num_blocks must be non-negative", param="num_blocks")
        if not self.can_allocate(num_blocks):
            raise NoFreeBlocksError(
                f"need {num_blocks} KV blocks, {self.num_free_blocks} free", code="no_free_blocks"
            )
        return [self._take_fresh() for _ in range(num_blocks)]

    def allocate_prompt(
        self, token_ids: Sequence[int], extra_tokens: int = 0, *, root: bytes = b"",
        match: bool = True,
    ) -> PrefixAllocation:
        """Blocks for a new prompt, reusing cached full blocks of its prefix (keyed under the
        chain ``root``: the deployment's and the request's salt, ``prefix_hash.prefix_root``).

        The result holds at least ``len(token_ids) + extra_tokens`` slots. ``match=False`` takes
        only fresh blocks (a prompt that must be computed whole: ``prompt_logprobs``). Matched blocks gain a
        reference (and leave the evictable LRU); the rest are fresh. At least one prompt token is
        always left to compute, so a fully cached prompt reuses all but its last full block::

            prompt  |  A  |  B  |  C  |          (3 full blocks, all cached)
            result  |  A  |  B  | new |          num_cached_tokens = 2 * block_size

        Raises:
            NoFreeBlocksError: not enough blocks; nothing changed (no refs, no statistics).
        """
        if extra_tokens < 0:
            raise InvalidArgumentError("extra_tokens must be non-negative", param="extra_tokens")
        matched = self._match(token_ids, root) if match else []
        num_fresh = self.blocks_needed(len(token_ids) + extra_tokens) - len(matched)
        reclaimed = sum(1 for b in matched if b in self._evictable)
        if num_fresh > self.num_free_blocks - reclaimed:
            raise NoFreeBlocksError(
                f"need {num_fresh} fresh KV blocks, {self.num_free_blocks - reclaimed} free",
                code="no_free_blocks",
            )
        for block_id in matched:
            self._evictable.pop(block_id, None)
            self._ref[block_id] += 1
        block_ids = matched + [self._take_fresh() for _ in range(num_fresh)]
        num_cached = len(matched) * self.block_size
        self._prefix_hits += num_cached
        self._prefix_queries += len(token_ids)
        return PrefixAllocation(block_ids=block_ids, num_cached_tokens=num_cached)

    def ensure_capacity(self, block_ids: list[int], num_tokens: int) -> None:
        """Append fresh blocks to ``block_ids`` in place until it holds ``num_tokens`` slots.

        Raises:
            NoFreeBlocksError: not enough blocks; ``block_ids`` is unchanged.
        """
        missing = self.blocks_needed(num_tokens) - len(block_ids)
        if missing > 0:
            block_ids.extend(self.allocate(missing))

    def cache_full_blocks(
        self, block_ids: Sequence[int], token_ids: Sequence[int], root: bytes = b""
    ) -> None:
        """Register the hash-chain key of every full block of ``token_ids`` whose KV is written.

        Idempotent: blocks already registered are skipped (their stored key is reused as the
        chain's parent, so repeated calls hash only new blocks). When another block already
        holds the same key, the map is left as is and this block stays unregistered.

        Args:
            block_ids: the sequence's block table (in use).
            token_ids: the tokens whose KV has been computed into those blocks.
            root: the chain's salt (as given to ``allocate_prompt``).
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(len(token_ids) // self.block_size, len(block_ids))
        parent = root
        stored: list[bytes] = []
        for i in range(num_full):
            block_id = block_ids[i]
            known = self._block_hash.get(block_id)
            if known is not None:
                parent = known
                continue
            self._check_id(block_id)
            if self._ref[block_id] == 0:
                raise InvalidArgumentError(
                    f"cannot cache block {block_id}: it is not in use", param="block_ids"
                )
            start = i * self.block_size
            parent = chain_hash(parent, token_ids[start : start + self.block_size])
            if parent not in self._hash_to_block:
                self._hash_to_block[parent] = block_id
                self._block_hash[block_id] = parent
                stored.append(parent)
        if stored and self.on_event is not None:
            self.on_event("stored", stored)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block, tail first.

        A block reaching zero becomes evictable if it is cached, else returns to the free list.
        Freeing tail blocks first makes them older in the LRU, so eviction eats sequences from
        their ends and keeps shared prefixes longest.

        Raises:
            DoubleFreeError: some block would drop below zero; nothing was freed.
        """
        for block_id, times in Counter(block_ids).items():
            self._check_id(block_id)
            if self._ref[block_id] < times:
                raise DoubleFreeError(
                    f"block {block_id} freed {times}x with ref count {self._ref[block_id]}"
                )
        for block_id in reversed(block_ids):
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                if block_id in self._block_hash:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached key; evictable blocks return to the free list (oldest first).

        Blocks still in use keep their KV and references but will no longer be matched.
        """
        logger.info("resetting prefix cache (%d keys, %d evictable blocks)",
                    len(self._hash_to_block), len(self._evictable))
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._block_hash.clear()
        self._hash_to_block.clear()
        if self.on_event is not None:
            self.on_event("cleared", ())

    # ----------------------------------------------------------------------------- internals

    def _match(self, token_ids: Sequence[int], root: bytes = b"") -> list[int]:
        """Cached blocks for the prompt's longest cached prefix, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching or not self._hash_to_block:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size if token_ids else 0
        matched: list[int] = []
        prefix = token_ids[: max_blocks * self.block_size]
        for key in iter_block_hashes(prefix, self.block_size, root):
            block_id = self._hash_to_block.get(key)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def _take_fresh(self) -> int:
        """One block with ref 1: free list first, else evict the least recently freed block."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            key = self._block_hash.pop(block_id)
            del self._hash_to_block[key]
            if self.on_event is not None:
                self.on_event("removed", (key,))
        self._ref[block_id] = 1
        return block_id

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise InvalidArgumentError(f"block id {block_id} out of range", param="block_ids")
