"""Sealing KV payload pieces that cross a collective channel (the distributed transport's pair
groups): AES-256-GCM, one fresh key per transfer.

Why: a pair group (Gloo on CPU) carries the payload's bytes outside the mutual-TLS gRPC stream,
in plaintext, checked only by the chunk's CRC-32 — and a CRC is linear, so anyone on the path can
change bytes in a way that leaves it unchanged, or read a tenant's KV. Sealed, a piece is
unreadable on the wire and any change to it fails its tag. The key is made by the sender for each
transfer and sent in the header's channel offer, which rides the mutual-TLS stream (so only the
receiver the certificate names learns it); the nonce is the piece's byte offset in the payload,
unique within a transfer, so a key never sees a nonce twice; the tag rides in the chunk's
announcement, on the same stream. AES-GCM from ``cryptography`` (OpenSSL, AES-NI and carry-less
multiply where the CPU has them) runs at memory-copy speeds on current CPUs, faster than an
HMAC-SHA-256 of the same bytes. Bytes over gRPC itself (the default transport) are already inside
TLS and are not sealed again; CUDA IPC copies inside one GPU and never crosses a wire.
"""

from __future__ import annotations

import secrets

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from services.common.errors import DataLossError

KEY_BYTES = 32
TAG_BYTES = 16


def new_key() -> bytes:
    """A fresh transfer key."""
    return secrets.token_bytes(KEY_BYTES)


def _nonce(offset: int) -> bytes:
    return offset.to_bytes(12, "little")


def seal(key: bytes, offset: int, data: bytes) -> tuple[bytes, bytes]:
    """The piece at payload ``offset`` encrypted (same length as ``data``) and its tag."""
    sealed = AESGCM(key).encrypt(_nonce(offset), data, None)
    return sealed[:-TAG_BYTES], sealed[-TAG_BYTES:]


def unseal(key: bytes, offset: int, sealed: bytes, tag: bytes) -> bytes:
    """The plaintext of a sealed piece; DataLossError when it or its tag was changed (or the key
    is not this transfer's)."""
    if len(key) != KEY_BYTES or len(tag) != TAG_BYTES:
        raise DataLossError(f"KV piece at offset {offset} came over the channel without its seal",
                            code="kv_checksum")  # fmt: skip
    try:
        return AESGCM(key).decrypt(_nonce(offset), sealed + tag, None)
    except InvalidTag:
        raise DataLossError(
            f"KV piece at offset {offset} failed its authentication tag: its bytes were changed "
            "on the channel", code="kv_checksum",
        ) from None  # fmt: skip
