"""The version of what Tandem's internal protos mean, so a mixed fleet fails loudly instead of
silently dropping a field.

Protobuf lets an old peer ignore a field it does not know: a worker that predates
``SamplingParams.cache_salt`` would serve a salted request from the shared prefix cache, and one
that predates a sampling field would sample without it. Every worker and the tokenizer advertise
:data:`PROTOCOL_VERSION` (``WorkerStats.protocol_version``, ``ModelInfo.protocol_version``; 0
means a peer older than this field), and the gateway routes only to peers it can speak to
(:func:`check_peer`). Bump :data:`PROTOCOL_VERSION` when a message gains a field whose absence
would change results, and raise :data:`OLDEST_COMPATIBLE` when older peers can no longer be
served; roll the gateways last, after every worker speaks the new version.

History:
  1. mutual TLS roles, ``cache_salt``, weights in the model fingerprint (issue 32).
  2. ``SamplingParams.speculative`` and ``prompt_logprobs`` (a v1 worker would drop prompt
     logprobs silently), ``TokenizeRequest.chat_template_kwargs_json`` (a v1 tokenizer would
     render without them), the pair group's sealed payload (``KVChannelOffer.payload_key``),
     ``Prefill.Embed`` (issues 45-47).
  3. ``ReserveRequest.prompt_digest``: a decode worker takes KV only under a reservation for that
     prompt and ``cache_salt`` (issue 47); a v2 decode worker would accept KV nobody reserved
     for, so v2 workers are no longer routed to, and a v2 gateway's reservations (no digest) are
     refused by v3 workers.
"""

from __future__ import annotations

PROTOCOL_VERSION = 3
OLDEST_COMPATIBLE = 3


def check_peer(version: int) -> str | None:
    """None when a peer advertising ``version`` can be spoken to, else why not."""
    if OLDEST_COMPATIBLE <= version <= PROTOCOL_VERSION:
        return None
    if version < OLDEST_COMPATIBLE:
        return (f"it speaks internal protocol {version}, older than this gateway's oldest "
                f"compatible {OLDEST_COMPATIBLE}: upgrade it")
    return (f"it speaks internal protocol {version}, newer than this gateway's "
            f"{PROTOCOL_VERSION}: upgrade the gateway")
