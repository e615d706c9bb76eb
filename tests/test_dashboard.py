"""The Grafana dashboard (deploy/grafana/dashboards/tandem.json) against Tandem's real metrics.

1. Offline: the JSON is a well-formed dashboard (unique ids, panels on the 24-column grid without
   overlaps, every query on the ``$datasource`` variable), every ``tandem:`` series it queries is
   one :class:`~services.common.metrics.TandemMetrics` exposes, and ``promtool check rules``
   accepts every query as PromQL (when Debian's ``prometheus`` package is installed).
2. Live: ``tandem up`` (default model, every prompt through the KV hand-off) serves a few
   requests while a real Prometheus scrapes every service's metrics address from the ready table
   each second; then every dashboard query, with Grafana's variables substituted, returns data
   with at least one finite value. Skipped without the ``prometheus`` binary
   (scripts/install_browser.sh installs it).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import TandemMetrics
from tests.ports import free_ports
from tests.up_process import StartUp, Up, port_flags

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "tandem.json"
DATASOURCE = REPO / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
JOBS = {"gateway": "tandem-gateway", "tokenizer": "tandem-tokenizer", "prefill": "tandem-prefill",
        "decode": "tandem-decode"}  # fmt: skip
# Grafana's variables, as it would expand them for a 1-hour view (the dashboard's default).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
SERIES = re.compile(r"\btandem:[A-Za-z0-9_:]+")


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(panel title, refId, PromQL with Grafana's variables substituted) for every target."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            yield panel["title"], target["refId"], expr


def test_dashboard_is_well_formed() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] == "tandem-overview" and dashboard["title"] == "Tandem"
    (variable,) = dashboard["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == (
        "datasource", "datasource", "prometheus"
    )  # fmt: skip
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] >= 1 and pos["x"] + pos["w"] <= 24, panel["title"]
        covered = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                   for y in range(pos["y"], pos["y"] + pos["h"])}  # fmt: skip
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel.get("description"), panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip()
    provisioned = yaml.safe_load(DATASOURCE.read_text())["datasources"][0]
    assert provisioned["type"] == "prometheus" and provisioned["isDefault"] is True


def test_every_queried_series_is_a_tandem_metric() -> None:
    exposed: set[str] = set()
    for family in text_string_to_metric_families(TandemMetrics().render().decode()):
        exposed |= {sample.name for sample in family.samples}  # labelled ones may have none yet
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
        exposed |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    used = {name for _, _, expr in queries(load_dashboard()) for name in SERIES.findall(expr)}
    assert used and not used - exposed, f"not exposed by TandemMetrics: {sorted(used - exposed)}"
    # What operators asked for is on it.
    for needed in (
        "tandem:request_success_total", "tandem:time_to_first_token_seconds_bucket",
        "tandem:time_per_output_token_seconds_bucket", "tandem:inter_token_latency_seconds_bucket",
        "tandem:e2e_request_latency_seconds_bucket", "tandem:num_requests_running",
        "tandem:num_requests_waiting", "tandem:kv_cache_usage_perc",
        "tandem:prefix_cache_hits_total", "tandem:prefix_cache_queries_total",
        "tandem:worker_prefix_cache_hit_rate", "tandem:kv_transfer_bytes_total",
        "tandem:kv_transfer_seconds_bucket", "tandem:kv_transfer_failures_total",
        "tandem:safety_blocks_total", "tandem:requests_throttled_total",
    ):  # fmt: skip
        assert needed in used, needed


def test_every_query_parses_as_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found (Debian: apt-get install prometheus; "
                    "scripts/install_browser.sh)")  # fmt: skip
    rules = [{"record": f"tandem_dashboard:query_{i}", "expr": expr}
             for i, (_, _, expr) in enumerate(queries(load_dashboard()))]  # fmt: skip
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


# --- live: a real Prometheus scraping a real `tandem up` -----------------------------------------


def _get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    body = _get_json(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert body["status"] == "success", body
    return body["data"]["result"]


def _post_chat(gateway: str, content: str, *, stream: bool, max_tokens: int) -> None:
    body = json.dumps({
        "model": "SmolLM2-135M-Instruct", "stream": stream, "max_tokens": max_tokens,
        "temperature": 0, "messages": [{"role": "user", "content": content}],
    }).encode()  # fmt: skip
    request = urllib.request.Request(gateway + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=180) as response:
        assert response.status == 200
        response.read()


def _metrics_targets(up: Up) -> dict[str, list[str]]:
    """Job name -> ``host:port`` of every metrics address in ``tandem up``'s ready table."""
    header = next(i for i, line in enumerate(up.stdout_lines) if line.startswith("service "))
    targets: dict[str, list[str]] = {}
    for line in up.stdout_lines[header + 1 : -1]:
        name, _address, metrics_url, _pid = line.split()
        parsed = urllib.parse.urlsplit(metrics_url)
        assert parsed.path == "/metrics", line
        targets.setdefault(JOBS[name.split("-")[0]], []).append(parsed.netloc)
    return targets


def _wait_for(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = check()
        except (OSError, urllib.error.URLError, ValueError):
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.5)


@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_real_prometheus(
    start_up: StartUp, tmp_path: Path
) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not found (Debian: apt-get install prometheus; "
                    "scripts/install_browser.sh)")  # fmt: skip
    gateway_port, prom_port = free_ports(2)
    up = start_up(
        "--prefill", "1", "--decode", "1", *port_flags(1, 1), "--gateway-port", str(gateway_port),
        "--gateway-args", "--remote-prefill-min-tokens 0",  # every prompt crosses the KV hand-off
        "--speculative", "ngram",  # the speculative-decoding panels need drafts
        gateway=True,
    )  # fmt: skip
    up.wait_ready()
    gateway = up.rows["gateway"][0]
    targets = _metrics_targets(up)
    assert set(targets) == set(JOBS.values())
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": addresses}]}
                           for job, addresses in sorted(targets.items())],
    }  # fmt: skip
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("w")
    prometheus = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{prom_port}"
    try:
        count = sum(len(addresses) for addresses in targets.values())
        _wait_for("every target scraped and up",
                  lambda: len(_query(base, 'up{job=~"tandem-.*"} == 1')) == count, timeout=60)
        # Requests after the first scrape, so every counter and histogram moves within the window.
        for i in range(3):
            _post_chat(gateway, f"Name a color. ({i})", stream=True, max_tokens=12)
        _post_chat(gateway, "Name a color. (0)", stream=False, max_tokens=8)  # a prefix-cache hit
        expected = sum(1 for _ in queries(load_dashboard()))
        # a few scrapes after the last request; on a loaded machine scrapes lag, so wait (up to
        # 30 s) until every query has data rather than a fixed 3 s (a fresh-clone run once
        # failed this beside other work, and passed alone)
        deadline = time.monotonic() + 30.0
        while True:
            time.sleep(1.0)
            empty: list[str] = []
            for title, ref, expr in queries(load_dashboard()):
                result = _query(base, expr)
                values = [float(r["value"][1]) for r in result]
                if not any(math.isfinite(v) for v in values):
                    empty.append(f"{title} [{ref}]: {expr} -> {result}")
            if not empty or time.monotonic() > deadline:
                break
        assert not empty, f"{len(empty)} of {expected} queries returned no data:\n" + "\n".join(
            empty
        )
    except BaseException:
        log.flush()
        print((tmp_path / "prometheus.log").read_text()[-3000:])
        raise
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(timeout=20)
        except subprocess.TimeoutExpired:
            prometheus.kill()
            prometheus.wait()
        log.close()

