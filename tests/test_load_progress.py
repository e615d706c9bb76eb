"""A big checkpoint's load shows progress: a log line per quarter where stderr is not a terminal
(a worker under ``tandem up`` or a container), nothing for a small one."""

from __future__ import annotations

import logging

import pytest

from services.engine.core.loaders import progress as progress_module
from services.engine.core.loaders.progress import BIG_CHECKPOINT_BYTES, progress


def test_a_big_load_logs_each_quarter_and_a_small_one_nothing(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress_module.sys.stderr, "isatty", lambda: False, raising=False)
    total = 2 * BIG_CHECKPOINT_BYTES
    with caplog.at_level(logging.INFO, logger=progress_module.__name__):
        with progress(total, "loading GGUF") as shown:
            for _ in range(8):
                shown.update(total // 8)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[1].split("%")[0].strip() for line in lines] == ["25", "50", "75", "100"]
    assert all(line.startswith("loading GGUF: ") and "1024 MiB" in line for line in lines)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=progress_module.__name__):
        with progress(BIG_CHECKPOINT_BYTES - 1, "loading small") as shown:
            shown.update(BIG_CHECKPOINT_BYTES - 1)
    assert not caplog.records
