"""The hash chain that names KV-cache prefixes, shared by the block manager and the router.

Every *full* block of ``block_size`` tokens is keyed by ``key_i = sha256(key_{i-1} || tokens_i)``
with token ids packed as little-endian int64 and ``key_{-1} = root``. The key of block i names the
whole prefix up to the end of block i and is the same in every process of a deployment, so a
gateway can hash a prompt and ask which worker's prefix cache already holds it, without ever
seeing the KV.

The chain's ``root`` (:func:`prefix_root`) salts it, so the keys workers publish on
``PrefixCache.Watch`` are not raw prompt-prefix hashes anyone could compute:

1. per deployment: a salt every process of the deployment derives alike (a digest of the
   deployment CA's certificate, ``internal_tls.InternalTls.prefix_salt``; plaintext deployments
   have none), so keys mean nothing across deployments;
2. per tenant: a request's ``cache_salt`` (vLLM's field) — requests share cached blocks only
   with requests of the same salt, so one tenant's prompts can neither be reused by another
   (no timing side channel through ``cached_tokens``) nor recognised in the published keys.

With neither salt the root is ``b""`` (the original chain).

Workers publish their cached keys to routers as :func:`routing_key` values (the digest's first
8 bytes as an unsigned int): a collision can only mis-route a request, never corrupt it (workers
match on the full digest), and 8 bytes keep a snapshot of a worker's cache small.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence

from services.common.errors import InvalidArgumentError


def prefix_root(deployment_salt: bytes = b"", cache_salt: str = "") -> bytes:
    """The chain's ``key_{-1}`` for a deployment's salt and a request's ``cache_salt``."""
    if not deployment_salt and not cache_salt:
        return b""
    salt = cache_salt.encode("utf-8")
    return hashlib.sha256(b"tandem-prefix-root\0" + struct.pack("<I", len(deployment_salt))
                          + deployment_salt + salt).digest()  # fmt: skip


def block_hashes(token_ids: Sequence[int], block_size: int, root: bytes = b"") -> list[bytes]:
    """Hash-chain keys of the full blocks of ``token_ids`` (a trailing partial block has none).

    Args:
        token_ids: the token sequence, from its first token.
        block_size: tokens per block.
        root: the chain's salt (:func:`prefix_root`).

    Returns:
        ``len(token_ids) // block_size`` 32-byte sha256 digests; entry i names the prefix
        ``token_ids[: (i + 1) * block_size]``.
    """
    if block_size < 1:
        raise InvalidArgumentError("block_size must be positive", param="block_size")
    return list(iter_block_hashes(token_ids, block_size, root))


def iter_block_hashes(
    token_ids: Sequence[int], block_size: int, root: bytes = b""
) -> Iterator[bytes]:
    """:func:`block_hashes`, lazily (a caller that stops at the first miss hashes no more)."""
    parent = root
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


def routing_keys(token_ids: Sequence[int], block_size: int, root: bytes = b"") -> list[int]:
    """The routing keys of every full block of ``token_ids`` under ``root``."""
    return [routing_key(d) for d in iter_block_hashes(token_ids, block_size, root)]


RESERVATION_DIGEST_BYTES = 32
"""Length of :func:`reservation_digest` (SHA-256)."""


def reservation_digest(token_ids: Sequence[int], cache_salt: str) -> bytes:
    """What a decode reservation binds (``Decode.Reserve``'s ``prompt_digest``): SHA-256 over
    the prompt's token ids and the ``cache_salt`` its KV will be cached under.

    The gateway computes it from the prompt and salt it is serving; the decode worker admits a
    ``TransferKV`` header only when the header's prompt and ``params.cache_salt`` give the same
    digest, so a sender cannot place KV under a prompt or salt the gateway did not reserve for
    (``services/engine/kv_transfer/receiver.py``). The salt is length-prefixed, so no salt and
    token list can be shifted into another pair with the same bytes.
    """
    salt = cache_salt.encode("utf-8")
    digest = hashlib.sha256(b"tandem-kv-reservation\0")
    digest.update(struct.pack("<I", len(salt)) + salt)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()
