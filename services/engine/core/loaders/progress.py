"""Progress of loading a big checkpoint: a byte-counting bar on a terminal, a log line at every
quarter otherwise (a worker under ``tandem up``, compose or Kubernetes writes to a log, and a
long first load should not look like a hang). Quiet for small checkpoints."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

logger = logging.getLogger(__name__)

BIG_CHECKPOINT_BYTES = 512 * 1024 * 1024
QUARTERS = 4


class LoadProgress:
    """Counts loaded bytes into a tqdm bar (terminal) or quarter-by-quarter log lines (not)."""

    def __init__(self, total_bytes: int, description: str) -> None:
        big = total_bytes >= BIG_CHECKPOINT_BYTES
        terminal = sys.stderr.isatty()
        self.total = max(1, total_bytes)
        self.description = description
        self.done = 0
        self._logged = 0  # quarters logged so far
        self._log = big and not terminal
        self._start = time.perf_counter()
        self.bar = tqdm(total=total_bytes, desc=description, unit="B", unit_scale=True,
                        disable=not (big and terminal), leave=False)  # fmt: skip

    def update(self, n: int) -> None:
        self.done += n
        self.bar.update(n)
        quarter = min(QUARTERS, self.done * QUARTERS // self.total)
        if self._log and quarter > self._logged:
            self._logged = quarter
            logger.info("%s: %d%% of %.0f MiB (%.1f s)", self.description,
                        100 * quarter // QUARTERS, self.total / 2**20,
                        time.perf_counter() - self._start)  # fmt: skip

    def close(self) -> None:
        self.bar.close()


@contextmanager
def progress(total_bytes: int, description: str) -> Iterator[LoadProgress]:
    """Yield a :class:`LoadProgress` for ``total_bytes``; shown only for checkpoints over 512 MiB."""
    shown = LoadProgress(total_bytes, description)
    try:
        yield shown
    finally:
        shown.close()
