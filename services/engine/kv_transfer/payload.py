"""A request's KV payload: its blocks, in block-table order, concatenated as bytes.

Block ``i`` of the request occupies payload bytes ``[i * block_bytes, (i + 1) * block_bytes)``
and is ``KVPool.data[block_ids[i]]`` (one contiguous region: all layers' K and V). Chunks are
byte ranges of this payload::

    payload | block 0 | block 1 | block 2 | block 3 | block 4 |
    chunks  |   chunk 0 (2 whole)  |   chunk 1 (2 whole)  | c2 |     block_bytes <= budget
    chunks  | c0 | c1 | c2 | c3 | ...                              block_bytes > budget: split

:func:`plan_chunks` cuts whole blocks per chunk while they fit the byte budget, and splits a
block only when one alone is larger. :func:`read_payload` / :func:`write_payload` copy a byte
range out of / into the pool; call them on the engine thread (``EngineLoop.call``) so they never
race a model step.

The pool they are given is :func:`handoff_pool`'s: the engine's ``KVPool`` at width 1, or on a
tensor-parallel worker rank 0's whole-width view of every rank's KV heads
(``core/tp_kv.FullWidthKV``), so a payload always holds all the model's KV heads, whatever
either worker's width. A byte range that cuts a block (a block larger than a chunk) is copied
straight from / into the pool's memory at width 1; through the whole-width view the touched
blocks are gathered, and on a write patched and scattered back.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from services.common.errors import DataLossError, InvalidArgumentError
from services.common.pb import common_pb2
from services.common.sampling_params import SamplingParams
from services.engine.core.engine import LLMEngine
from services.engine.core.kv_cache import KVLayout, KVPool
from services.engine.core.sampler import TokenLogprobs
from services.engine.core.tp_kv import FullWidthKV, handoff_kv

HandoffPool = KVPool | FullWidthKV


def handoff_pool(engine: LLMEngine) -> HandoffPool:
    """What a hand-off reads from / writes into on ``engine``: its pool, or on rank 0 of a
    tensor-parallel worker the whole-width view of all its ranks' pools."""
    sharding = engine.loaded.sharding
    return handoff_kv(engine.kv, sharding.group if sharding is not None else None,
                      engine.loaded.config)  # fmt: skip


@dataclass(frozen=True, slots=True)
class PrefilledRequest:
    """A request whose prompt KV fills ``num_blocks`` blocks: what prefill ships and what decode
    admits into its batch once the transfer is committed."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    first_token_id: int
    first_logprob: TokenLogprobs | None
    num_blocks: int
    num_cached_tokens: int = 0
    # The sampling parameters exactly as they arrived on the wire (the gateway's message), when
    # they did: the KV header forwards this message to decode instead of rebuilding it.
    wire_params: common_pb2.SamplingParams | None = None
    # The blocks the prefill left the KV in (its table), when the sender knows them: a CPU pool
    # is then read without a trip through the engine thread (sender.py).
    block_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """One chunk: ``length`` payload bytes from ``offset``, touching ``num_blocks`` blocks from
    the request's block ``first_block``."""

    offset: int
    length: int
    first_block: int
    num_blocks: int


def blocks_touched(offset: int, length: int, block_bytes: int) -> tuple[int, int]:
    """``(first_block, num_blocks)`` covered by payload bytes ``[offset, offset + length)``."""
    first = offset // block_bytes
    last = -(-(offset + length) // block_bytes)
    return first, last - first


def plan_chunks(num_blocks: int, block_bytes: int, max_chunk_bytes: int) -> list[ChunkPlan]:
    """Cut a payload of ``num_blocks`` blocks into chunks of at most ``max_chunk_bytes``."""
    if block_bytes < 1 or max_chunk_bytes < 1:
        raise InvalidArgumentError("block_bytes and max_chunk_bytes must be positive")
    total = num_blocks * block_bytes
    step = (max_chunk_bytes // block_bytes) * block_bytes if block_bytes <= max_chunk_bytes else 0
    plans: list[ChunkPlan] = []
    offset = 0
    while offset < total:
        if step:
            length = min(step, total - offset)
        else:  # one block is bigger than a chunk: split it, never crossing into the next block
            block_end = (offset // block_bytes + 1) * block_bytes
            length = min(max_chunk_bytes, block_end - offset)
        plans.append(ChunkPlan(offset, length, *blocks_touched(offset, length, block_bytes)))
        offset += length
    return plans


def _block_bytes_view(kv: KVPool, block_id: int) -> torch.Tensor:
    return kv.data[block_id].reshape(-1).view(torch.uint8)


def _as_bytes(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.reshape(-1).view(torch.uint8)


def _block_shape(layout: KVLayout) -> tuple[int, ...]:
    return (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.row)


def read_payload(kv: HandoffPool, block_ids: list[int], offset: int, length: int) -> bytes:
    """Payload bytes ``[offset, offset + length)`` of a request whose table is ``block_ids``."""
    block_bytes = kv.layout.block_bytes
    first, count = blocks_touched(offset, length, block_bytes)
    _check_range(block_ids, first, count)
    if offset % block_bytes == 0 and length % block_bytes == 0:
        blocks = kv.read_blocks(block_ids[first : first + count])
        return _as_bytes(blocks).cpu().numpy().tobytes()
    if not isinstance(kv, KVPool):  # the whole-width view: the touched blocks, then the range
        start = offset - first * block_bytes
        touched = _as_bytes(kv.read_blocks(block_ids[first : first + count]))
        return touched[start : start + length].cpu().numpy().tobytes()
    parts: list[bytes] = []
    for i in range(first, first + count):
        start = max(offset, i * block_bytes) - i * block_bytes
        end = min(offset + length, (i + 1) * block_bytes) - i * block_bytes
        parts.append(_block_bytes_view(kv, block_ids[i])[start:end].cpu().numpy().tobytes())
    return b"".join(parts)


def write_payload(kv: HandoffPool, block_ids: list[int], offset: int, data: bytes) -> None:
    """Copy ``data`` into payload bytes ``[offset, offset + len(data))`` of ``block_ids``."""
    block_bytes = kv.layout.block_bytes
    first, count = blocks_touched(offset, len(data), block_bytes)
    _check_range(block_ids, first, count)
    with warnings.catch_warnings():  # read-only source buffer: we only copy out of it
        warnings.simplefilter("ignore", UserWarning)
        source = torch.frombuffer(data, dtype=torch.uint8)
    if offset % block_bytes == 0 and len(data) % block_bytes == 0:
        shape = (count, *_block_shape(kv.layout))
        blocks = source.view(kv.layout.storage_dtype).view(shape)
        kv.write_blocks(block_ids[first : first + count], blocks)
        return
    if not isinstance(kv, KVPool):  # the whole-width view: read, patch and write back
        ids = block_ids[first : first + count]
        touched = kv.read_blocks(ids).contiguous()
        start = offset - first * block_bytes
        _as_bytes(touched)[start : start + len(data)].copy_(source)
        kv.write_blocks(ids, touched)
        return
    for i in range(first, first + count):
        start = max(offset, i * block_bytes)
        end = min(offset + len(data), (i + 1) * block_bytes)
        target = _block_bytes_view(kv, block_ids[i])[start - i * block_bytes : end - i * block_bytes]
        target.copy_(source[start - offset : end - offset])


def _check_range(block_ids: list[int], first: int, count: int) -> None:
    if first + count > len(block_ids):
        raise DataLossError(
            f"payload range covers blocks {first}..{first + count - 1}, request has "
            f"{len(block_ids)}"
        )
