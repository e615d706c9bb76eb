"""BlockManager: exact block ids, reference counts and eviction order (block_size 4)."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest

from services.common.errors import InvalidArgumentError, ResourceExhaustedError
from services.engine.core.block_manager import (
    BlockManager,
    BlockManagerStats,
    DoubleFreeError,
    NoFreeBlocksError,
    PrefixAllocation,
    block_hashes,
)

BS = 4


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def run_prompt(bm: BlockManager, prompt: list[int], extra: int = 0) -> PrefixAllocation:
    """Allocate a prompt and register its full blocks, as the engine does after prefill."""
    alloc = bm.allocate_prompt(prompt, extra)
    bm.cache_full_blocks(alloc.block_ids, prompt)
    return alloc


def test_no_torch_import() -> None:
    code = "import sys, services.engine.core.block_manager; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_block_hashes_chain_is_sha256_of_parent_and_le_int64() -> None:
    toks = tokens(1, 10)
    hashes = block_hashes(toks, BS)
    assert len(hashes) == 2  # partial third block has no key
    h0 = hashlib.sha256(struct.pack("<4q", 1, 2, 3, 4)).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<4q", 5, 6, 7, 8)).digest()
    assert hashes == [h0, h1]
    # Same block content after a different prefix gives a different key.
    assert block_hashes([9, 9, 9, 9, 5, 6, 7, 8], BS)[1] != h1
    with pytest.raises(InvalidArgumentError):
        block_hashes(toks, 0)


def test_fresh_allocation_fifo_ids_and_refcounts() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert bm.allocate(3) == [0, 1, 2]
    assert bm.allocate(2) == [3, 4]
    assert [bm.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert bm.num_free_blocks == 3 and bm.num_blocks_in_use == 5
    bm.free([0, 1, 2])  # reverse order: 2, 1, 0 return to the free list
    assert bm.allocate(5) == [5, 6, 7, 2, 1]
    assert bm.allocate(0) == []
    assert bm.blocks_needed(0) == 0 and bm.blocks_needed(4) == 1 and bm.blocks_needed(5) == 2


def test_allocate_prompt_fresh_capacity_and_partial_block_not_cached() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = tokens(100, 10)  # 2 full blocks + 2 tokens
    alloc = run_prompt(bm, prompt, extra=3)  # 13 slots -> 4 blocks
    assert alloc == PrefixAllocation(block_ids=[0, 1, 2, 3], num_cached_tokens=0)
    assert bm.match_prefix(prompt + [7]) == 8  # only the 2 full blocks are keyed
    bm.free(alloc.block_ids)
    # Blocks 3 and 2 had no key: straight back to the free list; 1, 0 became evictable.
    assert bm.stats().num_cached == 2
    assert bm.allocate(2) == [4, 5]


def test_prefix_hit_shares_blocks_between_two_prompts() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    shared = tokens(0, 8)
    a = run_prompt(bm, shared + [50, 51, 52])
    assert a.block_ids == [0, 1, 2] and a.num_cached_tokens == 0
    b = bm.allocate_prompt(shared + [60, 61, 62, 63, 64])
    assert b.block_ids == [0, 1, 3, 4] and b.num_cached_tokens == 8
    assert [bm.ref_count(i) for i in range(5)] == [2, 2, 1, 1, 1]
    assert bm.num_blocks_in_use == 5
    bm.free(a.block_ids)
    assert [bm.ref_count(i) for i in range(5)] == [1, 1, 0, 1, 1]
    bm.free(b.block_ids)
    assert bm.num_blocks_in_use == 0 and bm.num_free_blocks == 10


def test_cached_unreferenced_blocks_hit_after_free() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    prompt = tokens(0, 9)
    first = run_prompt(bm, prompt)
    assert first.block_ids == [0, 1, 2]
    bm.free(first.block_ids)
    assert bm.stats().num_cached == 2 and bm.num_free_blocks == 6 and bm.num_blocks_in_use == 0
    again = bm.allocate_prompt(prompt)
    # Blocks 0 and 1 leave the LRU with ref 1; block 2 went to the free list tail.
    assert again.block_ids == [0, 1, 3] and again.num_cached_tokens == 8
    assert [bm.ref_count(i) for i in range(6)] == [1, 1, 0, 1, 0, 0]
    assert bm.stats().num_cached == 0


def test_lru_eviction_order_under_pressure() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = run_prompt(bm, tokens(0, 8))     # blocks [0, 1], both keyed
    b = run_prompt(bm, tokens(100, 8))   # blocks [2, 3], both keyed
    bm.free(a.block_ids)                 # LRU: 1, 0
    bm.free(b.block_ids)                 # LRU: 1, 0, 3, 2
    assert bm.stats().num_cached == 4
    # Free list first (4, 5), then evict least recently freed: 1 (a's tail), 0, ...
    assert bm.allocate(3) == [4, 5, 1]
    assert bm.match_prefix(tokens(0, 8) + [1]) == 4  # a's first block survives
    assert bm.allocate(1) == [0]
    assert bm.match_prefix(tokens(0, 8) + [1]) == 0
    assert bm.match_prefix(tokens(100, 8) + [1]) == 8  # b untouched
    assert bm.allocate(1) == [3]
    assert bm.match_prefix(tokens(100, 8) + [1]) == 4
    assert bm.allocate(1) == [2]
    assert bm.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1)


def test_hit_on_evictable_block_protects_it_from_eviction() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = run_prompt(bm, tokens(0, 8))     # [0, 1]
    bm.free(a.block_ids)                 # LRU: 1, 0; free: 2, 3
    # 0 is reclaimed by the hit, 1 is not matched (prompt only shares the first block).
    b = bm.allocate_prompt(tokens(0, 4) + [77, 78, 79, 80, 81], extra_tokens=3)  # 3 blocks
    assert b.block_ids == [0, 2, 3] and b.num_cached_tokens == 4
    assert bm.allocate(1) == [1]  # evicts the only evictable block; never block 0


def test_atomic_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=5, block_size=BS)
    a = run_prompt(bm, tokens(0, 8))  # [0, 1]
    table = bm.allocate(1)            # [2]
    bm.free(a.block_ids)              # LRU: 1, 0; free: 3, 4
    before = bm.stats()
    refs = [bm.ref_count(i) for i in range(5)]
    # Hits blocks 0 and 1, then needs 5 fresh blocks but only 2 allocatable remain.
    with pytest.raises(NoFreeBlocksError) as err:
        bm.allocate_prompt(tokens(0, 8) + [9], extra_tokens=20)
    assert isinstance(err.value, ResourceExhaustedError)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(5)
    with pytest.raises(NoFreeBlocksError):
        bm.ensure_capacity(table, 100)
    assert table == [2]
    assert bm.stats() == before
    assert [bm.ref_count(i) for i in range(5)] == refs
    # The cache survived: the same prompt with a fitting size still hits both blocks.
    assert bm.match_prefix(tokens(0, 8) + [9]) == 8
    ok = bm.allocate_prompt(tokens(0, 8) + [9])
    assert ok.block_ids == [0, 1, 3] and ok.num_cached_tokens == 8


def test_never_the_whole_prompt_is_cached() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = tokens(0, 12)  # exactly 3 full blocks
    first = run_prompt(bm, prompt)
    assert first.block_ids == [0, 1, 2]
    assert bm.match_prefix(prompt) == 8
    again = bm.allocate_prompt(prompt)
    # The last full block is recomputed into a fresh block; the first two are shared.
    assert again.block_ids == [0, 1, 3] and again.num_cached_tokens == 8
    assert [bm.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    # Registering the duplicate block leaves the map pointing at block 2.
    bm.cache_full_blocks(again.block_ids, prompt)
    bm.free(first.block_ids)
    bm.free(again.block_ids)
    assert bm.stats().num_cached == 3  # blocks 0, 1, 2; block 3 went to the free list
    assert bm.allocate_prompt(prompt + [5]).block_ids == [0, 1, 2, 4]
    # A one-token prompt and an empty one never hit.
    assert bm.match_prefix([0]) == 0 and bm.match_prefix([]) == 0


def test_cache_full_blocks_is_idempotent_and_incremental() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    alloc = bm.allocate_prompt(tokens(0, 6), extra_tokens=10)  # 16 slots -> [0, 1, 2, 3]
    seq = tokens(0, 6)
    bm.cache_full_blocks(alloc.block_ids, seq)
    assert bm.match_prefix(seq + [0] * 10) == 4
    seq += [6, 7, 8, 9, 10]  # decode filled block 1 and part of block 2
    bm.cache_full_blocks(alloc.block_ids, seq)
    bm.cache_full_blocks(alloc.block_ids, seq)
    assert bm._block_hash == dict(zip([0, 1], block_hashes(seq, BS)))  # noqa: SLF001
    assert bm.match_prefix(tokens(0, 9)) == 8


def test_ensure_capacity_grows_in_place() -> None:
    bm = BlockManager(num_blocks=5, block_size=BS)
    table = bm.allocate_prompt(tokens(0, 3)).block_ids
    assert table == [0]
    bm.ensure_capacity(table, 4)
    assert table == [0]
    bm.ensure_capacity(table, 5)
    assert table == [0, 1]
    bm.ensure_capacity(table, 17)
    assert table == [0, 1, 2, 3, 4]
    assert bm.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        bm.ensure_capacity(table, 21)
    assert table == [0, 1, 2, 3, 4]


def test_double_free_raises_and_frees_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    ids = bm.allocate(2)
    bm.free(ids)
    with pytest.raises(DoubleFreeError):
        bm.free([0])
    ids = bm.allocate(2)
    assert ids == [2, 3]
    with pytest.raises(DoubleFreeError):
        bm.free([2, 3, 3])
    assert bm.ref_count(2) == 1 and bm.ref_count(3) == 1
    with pytest.raises(InvalidArgumentError):
        bm.free([99])


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    a = run_prompt(bm, tokens(0, 9))
    bm.free(a.block_ids)
    b = bm.allocate_prompt(tokens(0, 9))
    assert b.block_ids == [3, 4, 5] and b.num_cached_tokens == 0
    assert bm.stats().num_cached == 0


def test_reset_prefix_cache() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = run_prompt(bm, tokens(0, 9))  # [0, 1, 2]
    held = run_prompt(bm, tokens(50, 5))  # [3, 4]
    bm.free(a.block_ids)  # free: 5, 2 ; LRU: 1, 0
    bm.reset_prefix_cache()
    assert bm.match_prefix(tokens(0, 9)) == 0
    assert bm.stats().num_cached == 0 and bm.num_free_blocks == 4
    assert bm.allocate(4) == [5, 2, 1, 0]
    bm.free(held.block_ids)  # key dropped: block 3 goes to the free list, not the LRU
    assert bm.stats().num_cached == 0


def test_stats_counts_tokens_and_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = run_prompt(bm, tokens(0, 10))       # 3 blocks, no hit
    b = bm.allocate_prompt(tokens(0, 9))    # hits 8 tokens
    with pytest.raises(NoFreeBlocksError):
        bm.allocate_prompt(tokens(0, 9), extra_tokens=100)  # failed calls are not counted
    bm.free(a.block_ids)
    # b holds [0, 1, 3]; blocks 0 and 1 were shared with a, a's block 2 went back to the free list.
    assert b.block_ids == [0, 1, 3]
    s = bm.stats()
    assert s == BlockManagerStats(
        num_blocks=8, num_free=5, num_in_use=3, num_cached=0, prefix_hits=8, prefix_queries=19
    )
    assert s.prefix_hit_rate == pytest.approx(8 / 19)
    bm.free(b.block_ids)
    s = bm.stats()
    assert (s.num_in_use, s.num_free, s.num_cached) == (0, 8, 2)


def test_invalid_arguments() -> None:
    with pytest.raises(InvalidArgumentError):
        BlockManager(num_blocks=0, block_size=BS)
    with pytest.raises(InvalidArgumentError):
        BlockManager(num_blocks=4, block_size=0)
    bm = BlockManager(num_blocks=4, block_size=BS)
    with pytest.raises(InvalidArgumentError):
        bm.allocate(-1)
    with pytest.raises(InvalidArgumentError):
        bm.ref_count(4)
    with pytest.raises(InvalidArgumentError):
        bm.allocate_prompt([1, 2], extra_tokens=-1)
    with pytest.raises(InvalidArgumentError):
        bm.cache_full_blocks([0], tokens(0, 4))  # block 0 is not in use
