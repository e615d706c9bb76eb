"""The KV layout a prefill and a decode worker must agree on, as the ``KVLayout`` proto.

A receiver refuses KV it cannot use (FAILED_PRECONDITION) instead of decoding garbage: the model
fingerprint (weights' shape and architecture), dtype, block size, layer count, KV heads and head
dim must all match exactly. The bytes of one block are ``KVPool.data[block_id]``, C-contiguous,
``[num_layers, 2 (K then V), block_size, num_kv_heads, head_dim]`` elements of ``dtype``; both
ends are Tandem engines with the same pool layout, so equal fields mean equal bytes. The dtype is
the pool's (``--kv-cache-dtype``): a 16-bit cache moves half a float32 cache's bytes, a ``q8_0``
one (uint8 rows of int8 quants and float16 scales, ``kv_cache.py``) about half a 16-bit one's,
as stored; a worker holding another dtype is refused, not converted.
"""

from __future__ import annotations

import logging

from services.common.errors import FailedPreconditionError
from services.common.pb import common_pb2
from services.engine.core.engine import LLMEngine

logger = logging.getLogger(__name__)

_FIELDS = ("model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")


def engine_layout(engine: LLMEngine) -> common_pb2.KVLayout:
    """The layout of ``engine``'s KV pool."""
    layout = engine.layout
    return common_pb2.KVLayout(
        model_fingerprint=engine.loaded.fingerprint or engine.loaded.config.fingerprint(),
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
    )


def check_layout(remote: common_pb2.KVLayout, local: common_pb2.KVLayout) -> None:
    """Raise FailedPreconditionError naming every field where ``remote`` differs from ``local``.

    The message echoes only the sender's own values, never this worker's (a peer learns nothing
    about the receiver's layout by sending a wrong one); the full comparison is logged here.
    """
    fields = [name for name in _FIELDS if getattr(remote, name) != getattr(local, name)]
    if not fields:
        return
    logger.warning("refused KV of another layout: %s", ", ".join(
        f"{name} {getattr(remote, name)!r} (here {getattr(local, name)!r})" for name in fields))
    diffs = [f"{name} {getattr(remote, name)!r} is not this worker's" for name in fields]
    if remote.dtype != local.dtype:  # the one a flag decides: say which
        diffs.append("start prefill and decode workers with the same --kv-cache-dtype")
    raise FailedPreconditionError(
        "KV layout does not match this worker: " + ", ".join(diffs),
        param="layout",
        code="kv_layout_mismatch",
    )
