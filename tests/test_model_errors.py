"""A bad ``--model`` path, a corrupt file and an unsupported architecture each give a one-line
clear error from ``tandem generate`` (exit code 2, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.errors import ModelLoadError
from services.engine.core.loaders import load_model


def _generate(model: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services", "generate", "--model", model, "--prompt", "hi"],
        capture_output=True, text=True, timeout=120,
    )


def _assert_one_line_error(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tandem: error:") and needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


def test_missing_path(tmp_path: Path) -> None:
    _assert_one_line_error(_generate(str(tmp_path / "nope.gguf")), "does not exist")


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    _assert_one_line_error(_generate(str(bad)), "corrupt")


def test_truncated_default_gguf(tmp_path: Path, smollm2_gguf: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_gguf.read_bytes()[:2_000_000])
    _assert_one_line_error(_generate(str(cut)), "corrupt")


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    _assert_one_line_error(_generate(str(tmp_path)), "unsupported architecture")


def test_folder_without_weights(tmp_path: Path, tiny_llama_dir: Path) -> None:
    (tmp_path / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path))


def test_unknown_dummy_shape() -> None:
    with pytest.raises(ModelLoadError, match="unknown dummy shape"):
        load_model("dummy:gpt-17")
