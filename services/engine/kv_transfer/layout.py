"""The KV layout a prefill and a decode worker must agree on, as the ``KVLayout`` proto.

A receiver refuses KV it cannot use (FAILED_PRECONDITION) instead of decoding garbage: the model
fingerprint (weights' shape and architecture), dtype, block size, layer count, KV heads and head
dim must all match exactly. The bytes of one block are ``KVPool.data[block_id]``, C-contiguous,
``[num_layers, 2 (K then V), block_size, num_kv_heads, head_dim]`` elements of ``dtype``; both
ends are Tandem engines with the same pool layout, so equal fields mean equal bytes. The dtype is
the pool's (``--kv-cache-dtype``): a 16-bit cache moves half a float32 cache's bytes, a ``q8_0``
one (uint8 rows of int8 quants and float16 scales, ``kv_cache.py``) about half a 16-bit one's,
as stored; a worker holding another dtype is refused, not converted.

Tensor parallelism (docs/tensor-parallel.md): ``num_kv_heads`` is always the *whole model's*,
and a block's bytes hold every KV head, whatever the sender's width (a split worker's rank 0
gathers its ranks' heads before sending and scatters them to its ranks on receipt:
``core/tp_kv.py``). So any two widths that split the model hand KV to each other, and the width
is not a field that must match; the header states the sender's (``tensor_parallel_size``) and a
mismatch the receiver cannot place — a header whose ``num_kv_heads`` is not the model's, as a
split prefill worker that predates this sends (its rank 0's heads only) — is refused naming both
widths.
"""

from __future__ import annotations

import logging

from services.common.errors import FailedPreconditionError
from services.common.pb import common_pb2
from services.engine.core.engine import LLMEngine

logger = logging.getLogger(__name__)

_FIELDS = ("model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")


def engine_width(engine: LLMEngine) -> int:
    """``engine``'s tensor-parallel width (1 unsplit)."""
    sharding = engine.loaded.sharding
    return sharding.group.world if sharding is not None else 1


def engine_layout(engine: LLMEngine) -> common_pb2.KVLayout:
    """The layout of ``engine``'s KV as a hand-off moves it: every KV head of the model (a
    tensor-parallel rank's own pool holds its heads only), and ``engine``'s width."""
    layout = engine.layout
    return common_pb2.KVLayout(
        model_fingerprint=engine.loaded.fingerprint or engine.loaded.config.fingerprint(),
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=engine.loaded.config.num_kv_heads,
        head_dim=layout.head_dim,
        tensor_parallel_size=engine_width(engine),
    )


def check_layout(remote: common_pb2.KVLayout, local: common_pb2.KVLayout) -> None:
    """Raise FailedPreconditionError naming every field where ``remote`` differs from ``local``.

    The message echoes only the sender's own values, never this worker's (a peer learns nothing
    about the receiver's layout by sending a wrong one), except the tensor-parallel widths: where
    the KV heads differ, it states both, which is what tells an operator that a split sender
    (one that sends its rank 0's heads only) is the cause. The full comparison is logged here.
    """
    fields = [name for name in _FIELDS if getattr(remote, name) != getattr(local, name)]
    if not fields:
        return
    logger.warning("refused KV of another layout: %s", ", ".join(
        f"{name} {getattr(remote, name)!r} (here {getattr(local, name)!r})" for name in fields))
    diffs = [f"{name} {getattr(remote, name)!r} is not this worker's" for name in fields]
    if remote.dtype != local.dtype:  # the one a flag decides: say which
        diffs.append("start prefill and decode workers with the same --kv-cache-dtype")
    if "num_kv_heads" in fields:  # the widths: what a split worker's hand-off depends on
        sender = remote.tensor_parallel_size or 1
        diffs.append(
            f"the sender runs --tensor-parallel-size {sender} and this worker "
            f"{local.tensor_parallel_size or 1}: a hand-off carries every KV head of the model "
            "(gathered from all the sender's ranks); a split prefill worker that sends one "
            "rank's heads only predates hand-offs between widths: upgrade it"
        )  # fmt: skip
    raise FailedPreconditionError(
        "KV layout does not match this worker: " + ", ".join(diffs),
        param="layout",
        code="kv_layout_mismatch",
    )
