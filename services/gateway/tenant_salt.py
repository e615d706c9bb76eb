"""Each API key's prompts cached apart: the prefix-cache salt a request runs under is derived
from the key that authenticated it, never taken from the client alone.

Why: prefix-cache hits are observable (``usage.prompt_tokens_details.cached_tokens``, and a
faster first token), so tenants that share a cache can learn whether another sent a given prefix
— a system prompt, a document, a previous turn. vLLM's ``cache_salt`` lets a careful client opt
out, but the default (no salt) shares everything, and a client could also pick another tenant's
salt. Here, with API keys configured, the salt on the wire is a digest of the key's id and the
client's own ``cache_salt``: requests of one key (with one client salt) share cached blocks,
requests of different keys never do, and a client salt can only narrow what its key shares
(split one key's traffic further), never widen it to another key's. The workers, the router's
prefix-aware ranking and the KV hand-off all key on this salt as before (``prefix_hash.py``).
Without API keys (``anonymous``) the client's salt is used as sent: a deployment with no tenants.
"""

from __future__ import annotations

import hashlib

from services.gateway.auth import ANONYMOUS


def tenant_cache_salt(key_id: str, client_salt: str) -> str:
    """The salt a request of ``key_id`` (``auth.key_id``) with ``client_salt`` runs under."""
    if key_id == ANONYMOUS:
        return client_salt
    digest = hashlib.sha256(f"tandem-tenant\0{key_id}\0{client_salt}".encode()).hexdigest()
    return "tenant-" + digest[:48]
