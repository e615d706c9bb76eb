"""Prometheus metrics (names, movement, HTTP endpoint) and the structured log formats."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from services.common.errors import InvalidArgumentError, UnavailableError
from services.common.logging_setup import configure_logging
from services.common.metrics import TandemMetrics, serve_metrics_http

SPEC_METRICS = {
    # docs/metrics.md, exposed names (counters end in _total)
    "tandem:time_to_first_token_seconds": "histogram",
    "tandem:time_per_output_token_seconds": "histogram",
    "tandem:inter_token_latency_seconds": "histogram",
    "tandem:e2e_request_latency_seconds": "histogram",
    "tandem:request_queue_time_seconds": "histogram",
    "tandem:num_requests_running": "gauge",
    "tandem:num_requests_waiting": "gauge",
    "tandem:kv_cache_usage_perc": "gauge",
    "tandem:kv_blocks_in_use": "gauge",
    "tandem:prefix_cache_hits_total": "counter",
    "tandem:spec_decode_num_draft_tokens_total": "counter",
    "tandem:spec_decode_num_accepted_tokens_total": "counter",
    "tandem:kv_transfer_bytes_total": "counter",
    "tandem:kv_transfer_seconds": "histogram",
    "tandem:kv_transfer_failures_total": "counter",
    "tandem:prompt_tokens_total": "counter",
    "tandem:generation_tokens_total": "counter",
    "tandem:request_success_total": "counter",
    "tandem:safety_blocks_total": "counter",
    "tandem:requests_throttled_total": "counter",
    "tandem:prefill_path_total": "counter",
    "tandem:migrations_total": "counter",
    # docs/kv-handoff.md
    "tandem:kv_transfer_leases_expired_total": "counter",
    "tandem:kv_reservations_total": "counter",
    "tandem:decode_admission_waits_total": "counter",
    "tandem:decode_admission_timeouts_total": "counter",
}


def _types(metrics: TandemMetrics) -> dict[str, str]:
    """Exposed sample-family name -> type, parsed back from the rendered text."""
    found: dict[str, str] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        name = family.name + "_total" if family.type == "counter" else family.name
        found[name] = family.type
    return found


def test_render_has_every_spec_metric_with_its_type() -> None:
    metrics = TandemMetrics()
    types = _types(metrics)
    for name, kind in SPEC_METRICS.items():
        assert types.get(name) == kind, name
    text = metrics.render().decode()
    assert "# TYPE tandem:time_to_first_token_seconds histogram" in text
    assert 'tandem:request_success_total{finished_reason="stop"} 0.0' in text
    assert 'tandem:safety_blocks_total{stage="output"} 0.0' in text
    assert "process_resident_memory_bytes" in text or "python_info" in text


def test_values_move() -> None:
    metrics = TandemMetrics(process_metrics=False)
    sample = metrics.registry.get_sample_value

    metrics.time_to_first_token.observe(0.3)
    metrics.time_to_first_token.observe(0.05)
    assert sample("tandem:time_to_first_token_seconds_count") == 2
    assert sample("tandem:time_to_first_token_seconds_sum") == pytest.approx(0.35)
    assert sample("tandem:time_to_first_token_seconds_bucket", {"le": "0.1"}) == 1
    assert sample("tandem:time_to_first_token_seconds_bucket", {"le": "+Inf"}) == 2

    metrics.request_success.labels(finished_reason="length").inc()
    metrics.safety_blocks.labels(stage="input").inc(2)
    metrics.kv_transfer_bytes.inc(4096)
    metrics.kv_transfer_seconds.observe(0.002)
    metrics.kv_transfer_failures.labels(reason="checksum").inc()
    metrics.kv_transfer_leases_expired.inc()
    metrics.prompt_tokens.inc(12)
    metrics.generation_tokens.inc(5)
    metrics.prefix_cache_hits.inc(16)
    metrics.record_kv_state(blocks_in_use=3, blocks_total=12)
    metrics.record_queue_state(running=2, waiting=1)
    metrics.record_throttled("rate_limit_exceeded")
    metrics.record_throttled(None)  # a worker's 429 without a known code
    metrics.record_throttled("made_up")

    assert sample("tandem:request_success_total", {"finished_reason": "length"}) == 1
    assert sample("tandem:request_success_total", {"finished_reason": "stop"}) == 0
    assert sample("tandem:safety_blocks_total", {"stage": "input"}) == 2
    assert sample("tandem:kv_transfer_bytes_total") == 4096
    assert sample("tandem:kv_transfer_seconds_count") == 1
    assert sample("tandem:kv_transfer_failures_total", {"reason": "checksum"}) == 1
    assert sample("tandem:kv_transfer_leases_expired_total") == 1
    assert sample("tandem:prompt_tokens_total") == 12
    assert sample("tandem:generation_tokens_total") == 5
    assert sample("tandem:prefix_cache_hits_total") == 16
    assert sample("tandem:kv_blocks_in_use") == 3
    assert sample("tandem:kv_cache_usage_perc") == pytest.approx(0.25)
    assert sample("tandem:num_requests_running") == 2
    assert sample("tandem:num_requests_waiting") == 1
    assert sample("tandem:requests_throttled_total", {"code": "rate_limit_exceeded"}) == 1
    assert sample("tandem:requests_throttled_total", {"code": "server_overloaded"}) == 0
    assert sample("tandem:requests_throttled_total", {"code": "other"}) == 2

    metrics.record_kv_state(blocks_in_use=0, blocks_total=0)
    assert sample("tandem:kv_cache_usage_perc") == 0
    assert b"tandem:kv_transfer_bytes_total 4096.0" in metrics.render()


def test_instances_are_independent_and_registries_can_be_shared() -> None:
    first, second = TandemMetrics(), TandemMetrics()
    first.generation_tokens.inc(3)
    assert second.registry.get_sample_value("tandem:generation_tokens_total") == 0

    registry = CollectorRegistry()
    TandemMetrics(registry)
    with pytest.raises(ValueError):  # prometheus_client refuses duplicate names on one registry
        TandemMetrics(registry)


async def test_serve_metrics_http() -> None:
    metrics = TandemMetrics()
    metrics.kv_blocks_in_use.set(7)
    server = await serve_metrics_http(metrics, host="127.0.0.1", port=0)
    try:
        assert server.port > 0
        async with aiohttp.ClientSession() as session:
            async with session.get(server.url) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/plain")
                body = await resp.text()
            async with session.get(f"http://127.0.0.1:{server.port}/health") as resp:
                assert resp.status == 200
        assert "tandem:kv_blocks_in_use 7.0" in body

        with pytest.raises(UnavailableError, match="could not serve metrics"):
            await serve_metrics_http(metrics, host="127.0.0.1", port=server.port)
    finally:
        await server.close()


# --- logging --------------------------------------------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def test_text_logs_are_one_line_with_extras(restore_logging: None) -> None:
    stream = io.StringIO()
    configure_logging("debug", stream=stream)
    configure_logging("INFO", stream=stream)  # reconfiguring replaces, never duplicates
    log = logging.getLogger("services.test")
    log.debug("hidden")
    log.info("prefill done\nsecond", extra={"request_id": "req-1", "num_tokens": 12, "note": "a b"})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    line = lines[0]
    assert line.endswith(
        'INFO services.test: prefill done\\nsecond request_id=req-1 num_tokens=12 note="a b"'
    )
    assert line[:4].isdigit() and line[10] == "T" and line.split(" ")[0].endswith("Z")


def test_control_characters_in_logged_text_are_escaped(restore_logging: None) -> None:
    """A client's text reaches log lines (a model name, an error quoting its input): a terminal
    escape or a carriage return in it must not forge a line or drive the reader's terminal."""
    stream = io.StringIO()
    configure_logging("INFO", stream=stream)
    logging.getLogger("services.test").info(
        "model %s not found", "x\x1b[2J\rINFO forged", extra={"model": "m\x07\x9b"})
    line = stream.getvalue().rstrip("\n")
    assert "\n" not in line and "\r" not in line
    assert not any(c < " " or "\x7f" <= c <= "\x9f" for c in line)
    assert line.endswith('model x\\x1b[2J\\rINFO forged not found model="m\\u0007\\u009b"')


def test_json_logs(restore_logging: None) -> None:
    stream = io.StringIO()
    configure_logging("INFO", json=True, stream=stream)
    log = logging.getLogger("services.test")
    try:
        raise RuntimeError("broken")
    except RuntimeError:
        log.exception("failed", extra={"request_id": "req-2"})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["level"] == "ERROR" and entry["logger"] == "services.test"
    assert entry["message"] == "failed" and entry["request_id"] == "req-2"
    assert "RuntimeError: broken" in entry["exc"]
    assert set(entry) == {"ts", "level", "logger", "message", "request_id", "exc"}


def test_bad_level_is_a_typed_error(restore_logging: None) -> None:
    with pytest.raises(InvalidArgumentError, match="log level"):
        configure_logging("loud")
