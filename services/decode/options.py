"""The decode worker's own defaults, shared by its flags (``main.py``, torch-free) and its
start-up (``server.py``), so neither imports the other."""

from __future__ import annotations

DEFAULT_WAIT_FOR_KV_SECONDS = 30.0  # how long Generate waits for its KV (and KV waits for Generate)
