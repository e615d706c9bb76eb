"""How a failed KV transfer is labelled in ``tandem:kv_transfer_failures_total{reason}``.

Both ends classify their typed errors the same way: a bad checksum or byte count is
``checksum``, a layout mismatch ``layout``, a refusal (no room, aborted, no reservation for
this prompt) ``refused``, a broken connection ``connection``, anything that ran out of time
(lease, park or stall timeouts, marked with ``code=TIMEOUT_CODE``) ``timeout``, the rest
``other``.
"""

from __future__ import annotations

from services.common.errors import (
    AbortedError,
    DataLossError,
    FailedPreconditionError,
    PermissionDeniedError,
    ResourceExhaustedError,
    TandemError,
    UnavailableError,
)

TIMEOUT_CODE = "kv_timeout"
"""``TandemError.code`` of transfers that ran out of time (lease, park or stall timeouts)."""


def failure_reason(err: BaseException) -> str:
    """The ``reason`` label of ``tandem:kv_transfer_failures_total`` for an error."""
    if isinstance(err, TandemError) and err.code == TIMEOUT_CODE:
        return "timeout"
    if isinstance(err, DataLossError):
        return "checksum"
    if isinstance(err, FailedPreconditionError):
        return "layout"
    if isinstance(err, (ResourceExhaustedError, AbortedError, PermissionDeniedError)):
        return "refused"
    if isinstance(err, UnavailableError):
        return "connection"
    return "other"
