"""A byte-counting progress bar for big checkpoints (quiet for small ones and non-terminals)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

BIG_CHECKPOINT_BYTES = 512 * 1024 * 1024


@contextmanager
def progress(total_bytes: int, description: str) -> Iterator[tqdm]:
    """Yield a tqdm bar in bytes; shown only for checkpoints over 512 MiB on a terminal."""
    quiet = total_bytes < BIG_CHECKPOINT_BYTES or not sys.stderr.isatty()
    with tqdm(
        total=total_bytes, desc=description, unit="B", unit_scale=True, disable=quiet, leave=False
    ) as bar:
        yield bar
