"""The hash chain that names KV-cache prefixes, shared by the block manager and the router.

Every *full* block of ``block_size`` tokens is keyed by ``key_i = sha256(key_{i-1} || tokens_i)``
with token ids packed as little-endian int64 and ``key_{-1} = b""``. The key of block i names the
whole prefix up to the end of block i and is the same in every process, so a gateway can hash a
prompt and ask which worker's prefix cache already holds it, without ever seeing the KV.

Workers publish their cached keys to routers as :func:`routing_key` values (the digest's first
8 bytes as an unsigned int): a collision can only mis-route a request, never corrupt it (workers
match on the full digest), and 8 bytes keep a snapshot of a worker's cache small.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence

from services.common.errors import InvalidArgumentError


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hash-chain keys of the full blocks of ``token_ids`` (a trailing partial block has none).

    Args:
        token_ids: the token sequence, from its first token.
        block_size: tokens per block.

    Returns:
        ``len(token_ids) // block_size`` 32-byte sha256 digests; entry i names the prefix
        ``token_ids[: (i + 1) * block_size]``.
    """
    if block_size < 1:
        raise InvalidArgumentError("block_size must be positive", param="block_size")
    return list(iter_block_hashes(token_ids, block_size))


def iter_block_hashes(token_ids: Sequence[int], block_size: int) -> Iterator[bytes]:
    """:func:`block_hashes`, lazily (a caller that stops at the first miss hashes no more)."""
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        yield parent


def chain_hash(parent: bytes, block_tokens: Sequence[int]) -> bytes:
    """The key of a block holding ``block_tokens`` after the prefix keyed ``parent``."""
    payload = struct.pack(f"<{len(block_tokens)}q", *block_tokens)
    return hashlib.sha256(parent + payload).digest()


def routing_key(digest: bytes) -> int:
    """The 64-bit key workers publish for a block digest (see the module docstring)."""
    return int.from_bytes(digest[:8], "little")


def routing_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The routing keys of every full block of ``token_ids``."""
    return [routing_key(d) for d in iter_block_hashes(token_ids, block_size)]
