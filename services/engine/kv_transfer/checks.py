"""What a well-formed KV transfer looks like; the receiver checks it before trusting a byte.

  1. Header: the layout must match this worker (FAILED_PRECONDITION, see ``layout.py``); the
     token, block and byte counts must agree with each other and the prompt must fit the
     context, ids the vocabulary, params their ranges (INVALID_ARGUMENT).
  2. Each chunk: it starts where the previous one ended, stays inside the payload, matches its
     crc32 and names the blocks its bytes touch (DATA_LOSS). A chunk the receiver copies on the
     device itself (CUDA IPC: ``channel_bytes``, no data) gets the same checks but the crc32.
  3. Commit: the byte and chunk totals match what arrived (DATA_LOSS).

A header must also match its request's reservation: the digest of its prompt and ``cache_salt``
is the one reserved for (PERMISSION_DENIED, :func:`check_reserved_for`).

A reservation (``Decode.Reserve``, before the header) names its request, a prompt of at least one
token that fits the context, the 32-byte digest of that prompt and its ``cache_salt`` (what the
header must match, ``receiver.py``), and a lease that is not negative (INVALID_ARGUMENT).
"""

from __future__ import annotations

import hmac
import math
import zlib

from services.common.errors import DataLossError, InvalidArgumentError, PermissionDeniedError
from services.common.pb import common_pb2, decode_pb2
from services.common.prefix_hash import RESERVATION_DIGEST_BYTES, reservation_digest
from services.common.wire import sampling_params_from_proto, token_logprobs_from_proto
from services.engine.kv_transfer.layout import check_layout
from services.engine.kv_transfer.payload import PrefilledRequest, blocks_touched
from services.engine.core.sampler import TokenLogprobs


def check_header(
    header: decode_pb2.KVHeader,
    layout: common_pb2.KVLayout,
    *,
    block_bytes: int,
    vocab_size: int,
    max_model_len: int,
) -> PrefilledRequest:
    """Check a header against this worker; returns what decoding the request needs."""
    check_layout(header.layout, layout)
    if not header.request_id:
        raise InvalidArgumentError("the KV header has no request id", param="request_id")
    n = header.num_tokens
    if n < 1 or n != len(header.prompt_token_ids) or n != header.num_prompt_tokens:
        raise InvalidArgumentError("KV header token counts disagree", param="num_tokens")
    if header.num_blocks != -(-n // layout.block_size):
        raise InvalidArgumentError("KV header block count disagrees", param="num_blocks")
    if header.total_bytes != header.num_blocks * block_bytes:
        raise InvalidArgumentError("KV header byte count disagrees", param="total_bytes")
    if n + 1 > max_model_len:
        raise InvalidArgumentError(
            f"the prompt does not fit the {max_model_len}-token context", param="prompt"
        )
    tokens = tuple(header.prompt_token_ids)
    if max(tokens) >= vocab_size or header.first_token_id >= vocab_size:
        raise InvalidArgumentError(f"token ids must be below {vocab_size}", param="prompt")
    params = sampling_params_from_proto(header.params)
    first_logprob = None
    if header.HasField("first_logprob"):
        first_logprob = token_logprobs_from_proto(header.first_logprob, TokenLogprobs)
    return PrefilledRequest(header.request_id, tokens, params, header.first_token_id, first_logprob,
                            header.num_blocks, min(header.num_cached_tokens, len(tokens)))


def check_reservation(
    request_id: str,
    num_tokens: int,
    lease_seconds: float,
    prompt_digest: bytes,
    *,
    max_model_len: int,
) -> None:
    """Check a ``Reserve`` call's arguments (the same prompt limits as a header's, and the
    digest of the prompt and salt it binds: ``prefix_hash.reservation_digest``)."""
    if len(prompt_digest) != RESERVATION_DIGEST_BYTES:
        raise InvalidArgumentError(
            f"a reservation names the {RESERVATION_DIGEST_BYTES}-byte digest of its prompt and "
            f"cache_salt (got {len(prompt_digest)} bytes)", param="prompt_digest")
    if not request_id:
        raise InvalidArgumentError("the reservation has no request id", param="request_id")
    if num_tokens < 1:
        raise InvalidArgumentError("a reservation needs at least one token", param="num_tokens")
    if num_tokens + 1 > max_model_len:
        raise InvalidArgumentError(
            f"the prompt does not fit the {max_model_len}-token context", param="num_tokens"
        )
    if not (math.isfinite(lease_seconds) and lease_seconds >= 0):
        raise InvalidArgumentError("lease_seconds must be >= 0 (0: the worker's default)",
                                   param="lease_seconds")


def check_reserved_for(ready: PrefilledRequest, reserved_digest: bytes) -> None:
    """Check that a header's prompt and ``params.cache_salt`` are the ones its request's
    reservation was made for (``prefix_hash.reservation_digest``); PERMISSION_DENIED otherwise:
    the sender may not put KV under another prompt or salt than the gateway reserved."""
    digest = reservation_digest(ready.prompt_token_ids, ready.params.cache_salt)
    if not hmac.compare_digest(digest, reserved_digest):
        raise PermissionDeniedError(
            f"the KV header of request {ready.request_id!r} names another prompt or cache_salt "
            "than the one reserved for it", param="prompt_token_ids", code="reservation_mismatch",
        )  # fmt: skip


def check_chunk(
    chunk: decode_pb2.KVChunk,
    received: int,
    total_bytes: int,
    block_bytes: int,
    *,
    on_device: bool = False,
) -> int:
    """Check one chunk, ``received`` payload bytes into a ``total_bytes`` transfer; returns its
    length. ``on_device``: this transfer agreed that the receiver copies announced chunks
    (``channel_bytes``, no data) on the device itself."""
    data = chunk.data
    if chunk.channel_bytes and not on_device:  # the distributed endpoint fills data in first
        raise DataLossError("a KV chunk came over a channel this transfer did not agree on")
    if chunk.channel_bytes and data:
        raise DataLossError(f"KV chunk at offset {chunk.offset} announces bytes and carries data")
    length = chunk.channel_bytes or len(data)
    if chunk.offset != received:
        raise DataLossError(f"KV chunk at offset {chunk.offset}, expected {received}")
    if not length or received + length > total_bytes:
        raise DataLossError(f"KV chunk of {length} bytes overruns the payload")
    # An announced chunk has no crc32 to check: its bytes are copied inside one GPU's memory, with
    # no wire or host buffer between the pools to corrupt them, and computing one would read the
    # payload back to the host, which costs more than the copy itself.
    if not chunk.channel_bytes and zlib.crc32(data) != chunk.crc32:
        raise DataLossError(
            f"KV chunk at offset {chunk.offset} failed its crc32 check", code="kv_checksum"
        )
    if (chunk.first_block, chunk.num_blocks) != blocks_touched(received, length, block_bytes):
        raise DataLossError(f"KV chunk at offset {chunk.offset} names the wrong blocks")
    return length


def check_commit(
    header: decode_pb2.KVHeader, commit: decode_pb2.KVCommit, received: int, chunks: int
) -> None:
    """Check the commit against the header and what arrived."""
    if commit.total_bytes != header.total_bytes or received != header.total_bytes:
        raise DataLossError(
            f"KV commit after {received} of {header.total_bytes} bytes "
            f"(commit says {commit.total_bytes})"
        )
    if commit.num_chunks != chunks:
        raise DataLossError(f"KV commit says {commit.num_chunks} chunks, {chunks} arrived")
