"""deploy/kubernetes (docs/kubernetes.md): the base and both overlays render, every object
validates offline against the Kubernetes OpenAPI schemas (strict: unknown fields fail), every
container's command is one the ``tandem`` CLI parses (after Kubernetes' ``$(VAR)`` expansion and
with the container's environment as the parser's defaults), and the pieces fit together: probes
on the right ports and gRPC service names, draining that outlasts the gateway's re-resolution,
headless Services the gateway finds the tokenizer replicas and the workers by, HPAs on metrics
the workers export, and internal services bound to the pod IP. The NetworkPolicies are
tests/test_kubernetes_network.py's.

No cluster is needed. The overlays use a small subset of kustomize (``resources``, ``images``,
strategic-merge ``patches`` found by kind and name), which tests/kubernetes_render.py's
:func:`render` implements; when ``kustomize`` or ``kubectl`` is installed, its rendering must
equal this one.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from services.cli import build_parser
from tests.kubernetes_render import (  # noqa: F401 - rendered is a fixture
    ADAPTER_RULES,
    DEPLOY,
    DEVICES,
    GPUS,
    IMAGES,
    OLDEST_K8S,
    POD_IP,
    POD_NAME,
    POOLS,
    RENDERINGS,
    ROLES,
    WIDTHS,
    WORKERS,
    Obj,
    by_kind,
    container_port,
    kustomization,
    load_docs,
    load_docs_text,
    one,
    pod_spec,
    render,
    rendered,
    the_container,
    yaml,
)
from tests.tls_identities import tls_flags


def _sorted(objects: list[Obj]) -> list[Obj]:
    return sorted(objects, key=lambda o: (o["kind"], o["metadata"]["name"]))


@pytest.mark.parametrize("name", RENDERINGS)
def test_rendering_matches_kustomize(name: str) -> None:
    if binary := shutil.which("kustomize"):
        argv = [binary, "build", str(DEPLOY / name)]
    elif binary := shutil.which("kubectl"):
        argv = [binary, "kustomize", str(DEPLOY / name)]
    else:
        pytest.skip("neither kustomize nor kubectl is installed; the in-test renderer stands")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert _sorted(load_docs_text(out.stdout)) == _sorted(render(DEPLOY / name))


def test_every_file_is_used() -> None:
    """Each YAML file is a kustomization, a resource or patch of one, or the adapter example."""
    used = {ADAPTER_RULES}
    for directory in (DEPLOY / name for name in RENDERINGS):
        spec = kustomization(directory)
        used |= {directory / "kustomization.yaml"}
        used |= {directory / e for e in spec.get("resources", []) if (directory / e).is_file()}
        used |= {directory / e["path"] for e in spec.get("patches", [])}
    files = {p for p in DEPLOY.rglob("*") if p.is_file()}
    assert files == {p.resolve() for p in used}


# --- offline schema validation ---------------------------------------------------------------


def _patch_files() -> set[Path]:
    return {(DEPLOY / n / e["path"]).resolve() for n in RENDERINGS
            for e in kustomization(DEPLOY / n).get("patches", [])}  # fmt: skip


def _documents() -> list[tuple[str, Obj]]:
    """Every object: each file's (patches only as rendered) and each rendering's."""
    patches = _patch_files()
    docs = [(str(path.relative_to(DEPLOY)), doc)
            for path in sorted(DEPLOY.rglob("*.yaml"))
            if path.name != "kustomization.yaml" and path.resolve() not in patches
            for doc in load_docs(path)]  # fmt: skip
    for name in RENDERINGS:
        docs += [(f"{name} (rendered)", doc) for doc in render(DEPLOY / name)]
    return docs


@pytest.mark.parametrize("version", [OLDEST_K8S, "latest"])
def test_every_object_validates_offline(version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate import utils

    if version == "latest":
        version = utils.latest_version()
    failures = []
    for source, doc in _documents():
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as err:
            where = ".".join(str(p) for p in err.path)
            failures.append(f"{source}: {doc['kind']}/{doc['metadata']['name']}: {where}: "
                            f"{err.message}")  # fmt: skip
        except utils.SchemaNotFoundError as err:
            failures.append(f"{source}: {err.message}")
    assert not failures, "\n".join(failures)


# --- commands ------------------------------------------------------------------------------


def cpu_cores(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def container_env(container: Obj, objects: list[Obj]) -> dict[str, str]:
    """The environment Kubernetes gives ``container`` (pod fields with stand-in values)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(one(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            env[var["name"]] = {"metadata.name": POD_NAME, "status.podIP": POD_IP}[
                ref["fieldRef"]["fieldPath"]
            ]
        elif "resourceFieldRef" in ref:
            field = ref["resourceFieldRef"]
            assert field["containerName"] == container["name"]
            kind, resource = field["resource"].split(".")
            assert resource == "cpu", "only CPU counts are used in commands"
            amount = cpu_cores(container["resources"][kind][resource])
            env[var["name"]] = str(math.ceil(amount / cpu_cores(field.get("divisor", "1"))))
        else:  # a Secret: optional, so absent unless the operator creates it
            assert ref["secretKeyRef"].get("optional") is True, var["name"]
    return env


def expand(word: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of ``$(VAR)`` in command and args (``$$`` escapes)."""

    def one_reference(m: re.Match[str]) -> str:
        return "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one_reference, word)


def argv_of(container: Obj, env: dict[str, str]) -> list[str]:
    words = [expand(str(w), env) for w in [*container["command"], *container.get("args", [])]]
    assert not [w for w in words if "$(" in w], f"unexpanded variable in {words}"
    return words


def parse(container: Obj, objects: list[Obj], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The container's command parsed by the real CLI, its environment in place (the worker
    parsers read TANDEM_MODEL / TANDEM_DEVICE / TANDEM_DTYPE as defaults)."""
    env = session_tls_files(container, container_env(container, objects))
    with monkeypatch.context() as m:
        for name in [n for n in os.environ if n.startswith("TANDEM_")]:
            m.delenv(name)
        for name, value in env.items():
            m.setenv(name, value)
        argv = argv_of(container, env)
        assert argv[0] == "tandem"
        return build_parser(argv[1:]).parse_args(argv[1:])  # builds the parser; runs nothing


def session_tls_files(container: Obj, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the TANDEM_TLS_* paths (which must lie in a volume the container mounts)
    replaced by the test session's files of the container's role, so the CLI can read them."""
    mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
    files = dict(zip(("TANDEM_TLS_CERT", "TANDEM_TLS_KEY", "TANDEM_TLS_CA"),
                     tls_flags(container["name"])[1::2]))  # fmt: skip
    out = dict(env)
    for name, path in files.items():
        assert any(env[name].startswith(mount + "/") for mount in mounts), (container["name"], name)
        out[name] = path
    return out


@pytest.mark.parametrize("name", RENDERINGS)
def test_every_command_is_accepted_by_the_cli(
    rendered: dict[str, list[Obj]], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = rendered[name]
    assert set(by_kind(objects, "Deployment")) == set(ROLES)
    for role in ROLES:
        container = the_container(objects, role)
        args = parse(container, objects, monkeypatch)
        assert (args.command, args.service, args.module) == ("serve", role, f"services.{role}.main")
        assert args.port == container_port(container, "http" if role == "gateway" else "grpc")
        # every role's /metrics on a port of its own (the gateway's not on the API's port)
        assert args.metrics_port == container_port(container, "metrics") != args.port
        if role != "gateway":
            assert args.host == POD_IP  # not every interface: network-policy.yaml says who
        else:
            assert args.host == "0.0.0.0"  # port-forward reaches it over the pod's loopback
        if role in WORKERS:
            assert args.device == DEVICES[name]
            assert args.model == "default"
            assert args.worker_id == POD_NAME
            assert args.advertise_address == f"{POD_IP}:{args.port}"
            limit = cpu_cores(container["resources"]["limits"]["cpu"])
            assert args.threads == math.ceil(limit) and args.threads >= 1
            assert args.kv_cache_gib > 0
            # its ranks all in this container, each with whole cores of its own
            width = WIDTHS.get(name, 1)
            assert args.tensor_parallel_size == width
            assert limit >= width * (1 if name in GPUS else 2), (name, role)
    from services.gateway.main import config_from_args

    config = config_from_args(parse(the_container(objects, "gateway"), objects, monkeypatch))
    assert config.vocab_model == "default"


# --- how the pieces fit ----------------------------------------------------------------------


@pytest.mark.parametrize("name", RENDERINGS)
def test_each_pod_mounts_only_its_own_role_certificate(
    rendered: dict[str, list[Obj]], name: str
) -> None:
    for role in ROLES:
        spec = pod_spec(one(rendered[name], "Deployment", role))
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == f"tandem-tls-{role}"
        assert volumes["tls"]["secret"]["defaultMode"] == 0o440
        mount = next(m for m in the_container(rendered[name], role)["volumeMounts"]
                     if m["name"] == "tls")  # fmt: skip
        assert mount["readOnly"] is True
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]


def _gateway_args(objects: list[Obj], monkeypatch: pytest.MonkeyPatch) -> Any:
    return parse(the_container(objects, "gateway"), objects, monkeypatch)


def _sleep_seconds(container: Obj) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return float(command[1])


@pytest.mark.parametrize("name", RENDERINGS)
def test_probes_resources_and_draining(
    rendered: dict[str, list[Obj]], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.common.grpc_server import DEFAULT_GRACE_SECONDS
    from services.launch_plan import GRPC_SERVICES

    objects = rendered[name]
    gateway = _gateway_args(objects, monkeypatch)
    for role in ROLES:
        deployment = one(objects, "Deployment", role)
        spec = pod_spec(deployment)
        container = the_container(objects, role)
        args = parse(container, objects, monkeypatch)
        probes = {kind: container[kind] for kind in ("startupProbe", "readinessProbe",
                                                      "livenessProbe")}  # fmt: skip
        if role == "gateway":
            paths = {kind: p["httpGet"]["path"] for kind, p in probes.items()}
            assert paths == {"startupProbe": "/health", "readinessProbe": "/ready",
                             "livenessProbe": "/health"}  # fmt: skip
            assert all(container_port(container, p["httpGet"]["port"]) == args.port
                       for p in probes.values())  # fmt: skip
            grace = args.shutdown_grace
        else:
            # kubelet's gRPC probes present no certificate: they ask the plaintext health-only
            # port, never the mutual-TLS one
            assert args.health_port == container_port(container, "health") != args.port
            for probe in probes.values():
                assert probe["grpc"] == {"port": args.health_port, "service": GRPC_SERVICES[role]}
            grace = args.grace if role == "tokenizer" else DEFAULT_GRACE_SECONDS
        # the model loads before the gRPC port opens: startup allows minutes, liveness waits
        startup = probes["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= (
            300 if role in WORKERS else 60
        )
        assert "initialDelaySeconds" not in probes["livenessProbe"]

        resources = container["resources"]
        for kind in ("cpu", "memory"):
            assert kind in resources["requests"] and kind in resources["limits"], (role, kind)
        assert cpu_cores(resources["requests"]["cpu"]) <= cpu_cores(resources["limits"]["cpu"])

        sleep = _sleep_seconds(container)
        assert spec["terminationGracePeriodSeconds"] >= sleep + grace + 5, role
        if role in POOLS:  # the gateway drops the pod before it stops taking new work
            assert sleep >= 2 * gateway.resolve_interval + 5, role

        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == args.metrics_port
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert isinstance(spec["securityContext"]["runAsUser"], int)  # the image's USER is a name
        assert spec["automountServiceAccountToken"] is False


@pytest.mark.parametrize("name", RENDERINGS)
def test_gateway_finds_workers_through_services(
    rendered: dict[str, list[Obj]], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.gateway.main import config_from_args
    from services.gateway.membership import is_name, split_address

    objects = rendered[name]
    services = by_kind(objects, "Service")
    assert set(services) == set(ROLES)
    for role in ROLES:
        service = services[role]["spec"]
        labels = one(objects, "Deployment", role)["spec"]["template"]["metadata"]["labels"]
        assert service["selector"].items() <= labels.items()
        assert one(objects, "Deployment", role)["spec"]["selector"]["matchLabels"] == (
            service["selector"]
        )
        headless = service.get("clusterIP") == "None"
        assert headless == (role in POOLS), role  # pools: one DNS record per ready pod
        if headless:
            assert service.get("publishNotReadyAddresses", False) is False
    gateway = _gateway_args(objects, monkeypatch)
    config = config_from_args(gateway)
    entries = {"tokenizer": config.tokenizer_addresses, "prefill": config.prefill_addresses,
               "decode": config.decode_addresses}  # fmt: skip
    for role, addresses in entries.items():
        assert len(addresses) == 1, role
        host, port = split_address(addresses[0])
        assert is_name(addresses[0]) and host == role  # a name the gateway re-resolves
        ports = services[role]["spec"]["ports"]
        grpc = next(p for p in ports if p["name"] == "grpc")
        assert grpc["port"] == port
        args = parse(the_container(objects, role), objects, monkeypatch)
        assert args.port == port  # headless: the client dials the pod's own port
    assert not gateway.no_prefill
    http = next(p for p in services["gateway"]["spec"]["ports"] if p["name"] == "http")
    assert http["port"] == gateway.port and http["targetPort"] == "http"


def adapter_names() -> dict[str, str]:
    """Prometheus metric name -> the name prometheus-adapter serves it under (from the rules)."""
    from services.common.metrics import TandemMetrics

    exported = {f.name for f in TandemMetrics().registry.collect() if f.type == "gauge"}
    config = yaml.safe_load(load_docs(ADAPTER_RULES)[0]["data"]["config.yaml"])
    names: dict[str, str] = {}
    for rule in config["rules"]:
        series = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"])
        assert series, rule["seriesQuery"]
        assert 'namespace!=""' in rule["seriesQuery"] and 'pod!=""' in rule["seriesQuery"]
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                                  "pod": {"resource": "pod"}}  # fmt: skip
        template = re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"])  # Go's ${1}
        matched = [n for n in exported if re.fullmatch(series.group(1), n)]
        assert matched, f"{series.group(1)} matches no gauge in services/common/metrics.py"
        for metric in matched:
            names[metric] = re.sub(rule["name"]["matches"], template, metric)
    return names


@pytest.mark.parametrize("name", RENDERINGS)
def test_hpas_scale_each_pool_on_its_own_metrics(rendered: dict[str, list[Obj]], name: str) -> None:
    objects = rendered[name]
    served = adapter_names()
    assert served["tandem:num_requests_waiting"] == "tandem_num_requests_waiting"
    hpas = by_kind(objects, "HorizontalPodAutoscaler")
    assert set(hpas) == set(WORKERS)
    for role, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"], target["name"]) == (
            "apps/v1", "Deployment", role
        )
        assert "replicas" not in one(objects, "Deployment", role)["spec"]  # the HPA owns it
        assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
        metrics = hpa["spec"]["metrics"]
        assert all(m["type"] == "Pods" for m in metrics)  # averaged over this pool's own pods
        names = [m["pods"]["metric"]["name"] for m in metrics]
        assert "tandem_num_requests_waiting" in names, role  # the pool's own queue
        assert set(names) <= set(served.values()), f"{role}: {names} not served by the adapter"
        pdb = one(objects, "PodDisruptionBudget", role)
        assert pdb["spec"]["selector"]["matchLabels"] == (
            one(objects, "Deployment", role)["spec"]["selector"]["matchLabels"]
        )
    assert one(objects, "Deployment", "gateway")["spec"]["replicas"] >= 1
    # no single point: two tokenizer replicas, spread over nodes, one kept through disruptions
    tokenizer = one(objects, "Deployment", "tokenizer")["spec"]
    assert tokenizer["replicas"] >= 2
    assert tokenizer["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    spread = pod_spec(one(objects, "Deployment", "tokenizer"))["affinity"]["podAntiAffinity"]
    (term,) = spread["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"] == tokenizer["selector"]
    pdb = one(objects, "PodDisruptionBudget", "tokenizer")["spec"]
    assert pdb["selector"] == tokenizer["selector"]
    assert 1 <= pdb["minAvailable"] < tokenizer["replicas"]


@pytest.mark.parametrize("name", RENDERINGS)
def test_images_and_gpus(rendered: dict[str, list[Obj]], name: str) -> None:
    objects = rendered[name]
    for role in ROLES:
        container = the_container(objects, role)
        assert container["image"] == IMAGES[name]
        assert container["imagePullPolicy"] == "IfNotPresent"  # a local build tagged :latest
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        spec = pod_spec(one(objects, "Deployment", role))
        if name in GPUS and role in WORKERS:
            assert int(gpus) == GPUS[name] == WIDTHS.get(name, 1)  # one GPU a rank
            assert spec["nodeSelector"] and any(
                t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]
            )
        else:
            assert gpus is None, (name, role)
            assert "nodeSelector" not in spec and "tolerations" not in spec


# --- network policies ------------------------------------------------------------------------
