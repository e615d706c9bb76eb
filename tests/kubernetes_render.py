"""Rendering deploy/kubernetes as ``kustomize build`` would (the subset of kustomize the overlays
use: ``resources``, ``images``, strategic-merge ``patches`` found by kind and name), and the
lookups the Kubernetes tests share (tests/test_kubernetes.py, tests/test_kubernetes_network.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy" / "kubernetes"
ADAPTER_RULES = DEPLOY / "prometheus-adapter-rules.yaml"
RENDERINGS = ("base", "overlays/cpu", "overlays/gpu", "overlays/cpu-tensor-parallel",
              "overlays/gpu-tensor-parallel")  # fmt: skip
IMAGES = {"base": "tandem:latest", "overlays/cpu": "tandem:cpu", "overlays/gpu": "tandem:latest",
          "overlays/cpu-tensor-parallel": "tandem:cpu",
          "overlays/gpu-tensor-parallel": "tandem:latest"}  # fmt: skip
DEVICES = {"base": "auto", "overlays/cpu": "cpu", "overlays/gpu": "cuda",
           "overlays/cpu-tensor-parallel": "cpu", "overlays/gpu-tensor-parallel": "cuda"}
# each worker's tensor-parallel ranks (docs/tensor-parallel.md), and its GPUs
WIDTHS = {"overlays/cpu-tensor-parallel": 2, "overlays/gpu-tensor-parallel": 2}
GPUS = {"overlays/gpu": 1, "overlays/gpu-tensor-parallel": 2}
ROLES = ("tokenizer", "prefill", "decode", "gateway")
WORKERS = ("prefill", "decode")
POOLS = ("tokenizer", *WORKERS)  # behind the gateway: replicas it finds by a headless Service
# The oldest Kubernetes the manifests are meant for (gRPC probes are GA there) and the newest
# the installed kubernetes-validate ships schemas for.
OLDEST_K8S = "1.27.0"
POD_NAME = "decode-5d8f7c9b6-x2k4q"
POD_IP = "10.244.1.7"
Obj = dict[str, Any]

# Strategic merge: lists of these fields merge item by item on the key (Kubernetes' patchMergeKey);
# every other list is replaced whole (e.g. args, tolerations).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}  # fmt: skip
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "images", "patches"}


def load_docs_text(text: str) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def load_docs(path: Path) -> list[Obj]:
    return load_docs_text(path.read_text())


def kustomization(directory: Path) -> Obj:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def merge(base: Any, patch: Any, field: str = "") -> Any:
    """A strategic merge patch (the subset the overlays use)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            assert not key.startswith("$"), f"patch directive {key} is not implemented here"
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        originals = {item[key]: item for item in base}
        patched = [merge(originals[i[key]], i) if i[key] in originals else copy.deepcopy(i)
                   for i in patch]  # fmt: skip
        named = {item[key] for item in patch}
        return patched + [item for item in base if item[key] not in named]  # kustomize's order
    return copy.deepcopy(patch)


def split_image(image: str) -> tuple[str, str]:
    name, sep, tag = image.rpartition(":")
    return (name, tag) if sep and "/" not in tag else (image, "")


def pod_spec(obj: Obj) -> Obj:
    return obj["spec"]["template"]["spec"]


def render(directory: Path) -> list[Obj]:
    """The objects ``kustomize build directory`` makes (the subset the overlays use)."""
    spec = kustomization(directory)
    unknown = set(spec) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}: {sorted(unknown)} not implemented by this renderer"
    objects: list[Obj] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        objects += render(path) if path.is_dir() else load_docs(path)
    for entry in spec.get("patches", []):
        assert set(entry) == {"path"}, f"{directory}: only file patches found by kind and name"
        for patch in load_docs(directory / entry["path"]):
            key = (patch["kind"], patch["metadata"]["name"])
            hits = [i for i, o in enumerate(objects) if (o["kind"], o["metadata"]["name"]) == key]
            assert len(hits) == 1, f"{entry['path']}: {key} matches {len(hits)} objects"
            objects[hits[0]] = merge(objects[hits[0]], patch)
    for entry in spec.get("images", []):
        for obj in objects:
            if obj["kind"] != "Deployment":
                continue
            for container in pod_spec(obj)["containers"]:
                name, tag = split_image(container["image"])
                if name == entry["name"]:
                    tag = entry.get("newTag", tag)
                    container["image"] = entry.get("newName", name) + (f":{tag}" if tag else "")
    return objects


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {name: render(DEPLOY / name) for name in RENDERINGS}


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def by_kind(objects: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def the_container(objects: list[Obj], role: str) -> Obj:
    containers = pod_spec(one(objects, "Deployment", role))["containers"]
    assert [c["name"] for c in containers] == [role]
    return containers[0]


def container_port(container: Obj, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)
