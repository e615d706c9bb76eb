"""Draw the Grafana dashboard with real data, for the docs: docs/img/grafana-dashboard.png.

    .venv/bin/python scripts/dashboard_snapshot.py [--seconds 180] [--out docs/img/grafana-dashboard.png]

Grafana itself is not needed (nor reachable where the docs are built): this starts ``tandem up``
(default model, one prefill and one decode worker, prompts from 64 tokens through the KV hand-off,
``--speculative ngram``), a real Prometheus (Debian's ``prometheus``; scripts/install_browser.sh)
scraping every service each second under the dashboard's job names, and a few minutes of load in
phases (concurrency 1, 2, then 4 with some clients leaving mid-stream, repeated prompts for
prefix-cache hits, a few over-long requests refused); then it evaluates every query of
deploy/grafana/dashboards/tandem.json over that window through Prometheus' range API and draws
each panel where the dashboard places it (its 24-column grid, its units and legends, Grafana's
dark theme). What the picture shows is what those queries return; only Grafana's own chrome is
missing.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "tandem.json"
MODEL = "SmolLM2-135M-Instruct"
WORDS = ("river stone garden lamp violin harbor copper meadow signal lantern orchard thunder "
         "pebble compass falcon ember glacier saffron").split()  # fmt: skip


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def wait_for(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    raise SystemExit(f"timed out after {timeout:g}s waiting for {what}")


def chat(gateway: str, prompt: str, *, max_tokens: int, leave_after: int | None = None) -> None:
    """One streamed chat request; ``leave_after`` chunks, then the client hangs up."""
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": max_tokens,
                       "temperature": 0.7, "messages": [{"role": "user", "content": prompt}]})
    request = urllib.request.Request(gateway + "/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            for i, _line in enumerate(response):
                if leave_after is not None and i >= leave_after:
                    return
    except urllib.error.HTTPError as err:  # refusals are part of the picture (400 / 429 panels)
        if err.code == 429:  # a client that waits as told, as the SDKs do
            time.sleep(float(err.headers.get("Retry-After") or 1))


def load(gateway: str, seconds: float) -> None:
    """Three phases of clients: 1, 2, then 4 at once (a fifth of them leaving mid-stream)."""
    rng = random.Random(7)
    system = " ".join(rng.choice(WORDS) for _ in range(90))  # a shared prefix: cache hits
    phases = [(1, seconds * 0.25), (2, seconds * 0.35), (4, seconds * 0.40)]
    for clients, length in phases:
        stop = time.monotonic() + length

        def client(k: int, stop: float = stop) -> None:
            n = 0
            while time.monotonic() < stop:
                n += 1
                words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 80)))
                prompt = f"{system}\nRepeat these words, then describe them: {words}"
                leave = 4 if (k + n) % 5 == 0 else None
                chat(gateway, prompt, max_tokens=rng.choice((24, 48, 64)), leave_after=leave)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def substitute(expr: str, step: int) -> str:
    return (expr.replace("$__rate_interval", "20s").replace("$__interval", f"{step}s")
            .replace("$__range", "10m"))  # fmt: skip


def legend(fmt: str, metric: dict[str, str], fallback: str) -> str:
    if not fmt:
        return fallback
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt).strip()


def collect(base: str, start: float, end: float, step: int) -> dict[int, list[tuple[str, list]]]:
    """Panel id -> [(legend, [(t, value), ...]), ...] for every target of every panel."""
    out: dict[int, list[tuple[str, list]]] = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        series = []
        for target in panel.get("targets", []):
            query = urllib.parse.urlencode({"query": substitute(target["expr"], step),
                                            "start": start, "end": end, "step": step})
            body = get_json(f"{base}/api/v1/query_range?{query}", timeout=60)
            for result in body["data"]["result"]:
                points = [(float(t), float(v)) for t, v in result["values"]]
                name = legend(target.get("legendFormat", ""), result["metric"], target["refId"])
                series.append((name, points))
        out[panel["id"]] = series
    return out


def fmt_value(value: float, unit: str | None) -> str:
    if not math.isfinite(value):
        return "—"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
    if unit == "percentunit":
        return f"{value * 100:.0f}%"
    if unit == "Bps":
        for scale, name in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
            if value >= scale:
                return f"{value / scale:.1f} {name}"
        return f"{value:.0f} B/s"
    if unit == "reqps":
        return f"{value:.2f} req/s"
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def axis_value(value: float, unit: str | None) -> str:
    if unit == "s":
        return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.0f} s"
    if unit == "percentunit":
        return f"{value * 100:.1f}%" if abs(value) < 0.1 else f"{value * 100:.0f}%"
    if unit == "Bps":
        return f"{value / 1e6:.1f} MB/s" if value >= 1e6 else f"{value / 1e3:.0f} kB/s"
    return f"{value:.3g}"


def stat_value(panel: dict[str, Any], points: list[float]) -> float:
    """What Grafana's stat shows: the panel's reducer over the window (default: last value)."""
    calcs = panel.get("options", {}).get("reduceOptions", {}).get("calcs") or ["lastNotNull"]
    finite = [v for v in points if math.isfinite(v)]
    if not finite:
        return float("nan")
    return {"mean": sum(finite) / len(finite), "max": max(finite), "min": min(finite)}.get(
        calcs[0], finite[-1])


def draw(data: dict[int, list[tuple[str, list]]], start: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_w, unit_h = 0.62, 0.36  # inches per grid column / grid row
    fig = plt.figure(figsize=(24 * unit_w, (rows + 1.6) * unit_h), facecolor="#111217")
    total_h = rows + 1.6
    fig.text(0.01, 1 - 0.8 / total_h, "Tandem", color="#ccccdc", fontsize=15, weight="bold",
             va="center")
    fig.text(0.99, 1 - 0.8 / total_h, "tandem up (default model) under load · Prometheus · "
             "deploy/grafana/dashboards/tandem.json", color="#8e8e9e", fontsize=9, ha="right",
             va="center")  # fmt: skip
    colors = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff",
              "#fade2a", "#37872d", "#c4162a"]  # fmt: skip

    def box(pos: dict[str, int], pad: float = 0.08) -> list[float]:
        x = (pos["x"] + pad) / 24
        w = (pos["w"] - 2 * pad) / 24
        top = (pos["y"] + 1.6 + pad) / total_h
        h = (pos["h"] - 2 * pad) / total_h
        return [x, 1 - top - h, w, h]

    for panel in panels:
        pos, kind = panel["gridPos"], panel["type"]
        if kind == "row":
            x, y, _, h = box(pos, pad=0.0)
            fig.text(x + 0.004, y + h / 2, panel["title"], color="#ccccdc", fontsize=11,
                     weight="bold", va="center")
            continue
        rect = box(pos)
        frame = fig.add_axes(rect)
        frame.set_axis_off()
        frame.add_patch(FancyBboxPatch((0, 0), 1, 1, boxstyle="round,pad=0,rounding_size=0.01",
                                       facecolor="#181b1f", edgecolor="#2a2d35",
                                       transform=frame.transAxes))  # fmt: skip
        frame.text(0.015, 0.97, panel["title"], color="#ccccdc", fontsize=9, va="top",
                   transform=frame.transAxes)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        series = data.get(panel["id"], [])
        if kind == "stat":
            values = [stat_value(panel, [v for _, v in pts]) for _, pts in series if pts]
            value = max(values) if values else float("nan")
            frame.text(0.5, 0.42, fmt_value(value, unit), color="#73bf69", fontsize=20,
                       weight="bold", ha="center", va="center", transform=frame.transAxes)
            continue
        left = 0.1 if pos["w"] <= 8 else 0.07  # room for the y labels
        inner = [rect[0] + rect[2] * left, rect[1] + rect[3] * 0.2, rect[2] * (0.97 - left),
                 rect[3] * 0.62]  # fmt: skip
        ax = fig.add_axes(inner, facecolor="#181b1f")
        for i, (name, pts) in enumerate(series[:10]):
            xs = [(t - start) / 60 for t, v in pts if math.isfinite(v)]
            ys = [v for _, v in pts if math.isfinite(v)]
            ax.plot(xs, ys, color=colors[i % len(colors)], linewidth=1.2, label=name or " ")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
            lambda v, _p, u=unit: axis_value(v, u)))
        ax.tick_params(colors="#8e8e9e", labelsize=7, length=0)
        ax.grid(color="#2a2d35", linewidth=0.6)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_xlabel("minutes", color="#8e8e9e", fontsize=7, labelpad=1)
        if series:
            shown = [line for line in ax.get_lines() if any(y != 0 for y in line.get_ydata())]
            ax.legend(handles=(shown if len(series) > 6 and shown else None) or ax.get_lines(),
                      loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4,
                      fontsize=7, frameon=False, labelcolor="#ccccdc", handlelength=1.2)
        else:
            ax.text(0.5, 0.5, "No data", color="#8e8e9e", ha="center", transform=ax.transAxes)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, facecolor=fig.get_facecolor())
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="load duration")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "grafana-dashboard.png")
    args = parser.parse_args(argv)
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        print("prometheus not found (scripts/install_browser.sh installs it)", file=sys.stderr)
        return 2
    (gw, gw_m, tok, tok_m, pre, pre_m, dec, dec_m, prom) = free_ports(9)
    tandem = REPO / ".venv" / "bin" / "tandem"
    up = subprocess.Popen(
        [str(tandem), "up", "--speculative", "ngram", "--gateway-port", str(gw),
         "--gateway-metrics-port", str(gw_m), "--tokenizer-port", str(tok),
         "--tokenizer-metrics-port", str(tok_m), "--prefill-port", str(pre),
         "--prefill-metrics-port", str(pre_m), "--decode-port", str(dec),
         "--decode-metrics-port", str(dec_m),
         "--gateway-args", "--remote-prefill-min-tokens 64 --max-in-flight 3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="tandem-dashboard-"))
    jobs = {"tandem-gateway": gw_m, "tandem-tokenizer": tok_m, "tandem-prefill": pre_m,
            "tandem-decode": dec_m}  # fmt: skip
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": job, "static_configs": [
                  {"targets": [f"127.0.0.1:{port}"]}]} for job, port in jobs.items()]}
    (work / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    prom_proc = subprocess.Popen(
        [prometheus, f"--config.file={work / 'prometheus.yml'}",
         f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{prom}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base, gateway = f"http://127.0.0.1:{prom}", f"http://127.0.0.1:{gw}"
    try:
        wait_for("tandem up ready", lambda: get_json(gateway + "/ready")["status"] == "ready", 300)
        wait_for("every target up", lambda: len(get_json(
            f"{base}/api/v1/query?query=" + urllib.parse.quote('up{job=~"tandem-.*"} == 1')
        )["data"]["result"]) == len(jobs), 60)  # fmt: skip
        start = time.time()
        time.sleep(5)
        for _ in range(3):  # over-long requests: 400s in the failures row
            chat(gateway, "word " * 9000, max_tokens=8)
        load(gateway, args.seconds)
        end = time.time() + 3  # the stats' last values are the load's, not an idle tail
        time.sleep(4)
        data = collect(base, start, end, step=2)
        draw(data, start, args.out)
    finally:
        for proc in (prom_proc, up):
            proc.terminate()
        for proc in (prom_proc, up):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
