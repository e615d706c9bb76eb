"""The prefill worker's own defaults, shared by its flags (``main.py``, torch-free) and its
start-up (``server.py``), so neither imports the other."""

from __future__ import annotations

DEFAULT_LEASE_SECONDS = 30.0  # how long prefill holds a request's KV for decode to acknowledge
