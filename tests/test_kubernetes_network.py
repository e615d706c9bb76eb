"""deploy/kubernetes' NetworkPolicies (docs/kubernetes.md), on every rendering: only the gateway
(and prefill, for KV) reaches the internal services, Prometheus their metrics (the gateway's on a
port of its own), kubelet their health; and each pod may connect only to its peers and DNS.
Evaluated offline over the rendered objects (tests/kubernetes_render.py), no cluster needed.
"""

from __future__ import annotations

import pytest

from tests.kubernetes_render import (  # noqa: F401 - rendered is a fixture
    POOLS,
    RENDERINGS,
    ROLES,
    Obj,
    by_kind,
    container_port,
    one,
    rendered,
    the_container,
)


NAMESPACE = {"kubernetes.io/metadata.name": "tandem"}  # every namespace carries this label
OUTSIDE = "outside any pod (a node's kubelet, a client)"
# Where a connection may come from: (the namespace's labels, the pod's labels), None for an
# address that is no pod's; the Tandem roles are added from the rendering.
OTHER_PEERS: dict[str, tuple[dict[str, str], dict[str, str]] | None] = {
    "another pod of the namespace": (NAMESPACE, {"app": "other"}),
    "prometheus": ({"kubernetes.io/metadata.name": "monitoring"},
                   {"app.kubernetes.io/name": "prometheus"}),
    "a pod of another namespace": ({"kubernetes.io/metadata.name": "default"}, {}),
    OUTSIDE: None,
}


def _selects(selector: Obj, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are evaluated here"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _admits(entry: Obj, peer: tuple[dict[str, str], dict[str, str]] | None) -> bool:
    """Whether one ``from`` entry of a policy in the namespace admits ``peer``."""
    if "ipBlock" in entry:
        block = entry["ipBlock"]
        return block["cidr"] in ("0.0.0.0/0", "::/0") and not block.get("except")
    if peer is None:  # no pod: only an ipBlock can name it
        return False
    namespace, labels = peer
    assert set(entry) <= {"podSelector", "namespaceSelector"}, entry
    if "namespaceSelector" in entry:
        in_namespace = _selects(entry["namespaceSelector"], namespace)
    else:
        in_namespace = namespace == NAMESPACE  # a bare podSelector: the policy's own namespace
    return in_namespace and _selects(entry.get("podSelector", {}), labels)


def _pod_labels(objects: list[Obj], role: str) -> dict[str, str]:
    return dict(one(objects, "Deployment", role)["spec"]["template"]["metadata"]["labels"])


def reachable(objects: list[Obj], role: str, port: str) -> set[str]:
    """The peers that may open a connection to ``role``'s pods on their container port named
    ``port``, as Kubernetes evaluates ingress NetworkPolicies (the union of every rule of every
    policy that selects the pod; a pod no policy selects admits everyone)."""
    peers = {r: (NAMESPACE, _pod_labels(objects, r)) for r in ROLES} | OTHER_PEERS
    number = container_port(the_container(objects, role), port)
    policies = [p["spec"] for p in by_kind(objects, "NetworkPolicy").values()
                if "Ingress" in p["spec"]["policyTypes"]
                and _selects(p["spec"]["podSelector"], _pod_labels(objects, role))]  # fmt: skip
    if not policies:
        return set(peers)
    admitted: set[str] = set()
    for rule in (r for p in policies for r in p.get("ingress", [])):
        ports = rule.get("ports")
        assert all(p.get("protocol", "TCP") == "TCP" for p in ports or ())
        if ports is not None and not any(p["port"] in (port, number) for p in ports):
            continue
        entries = rule.get("from")
        admitted |= {name for name, peer in peers.items()
                     if entries is None or any(_admits(e, peer) for e in entries)}  # fmt: skip
    return admitted


@pytest.mark.parametrize("name", RENDERINGS)
def test_network_policies_let_only_the_gateway_in(
    rendered: dict[str, list[Obj]], name: str
) -> None:
    objects = rendered[name]
    everyone = {*ROLES, *OTHER_PEERS}
    expected = {
        ("tokenizer", "grpc"): {"gateway"},
        ("prefill", "grpc"): {"gateway"},
        # Generate and TransferKV share the port: mTLS roles keep them apart (peer_roles.py)
        ("decode", "grpc"): {"gateway", "prefill"},
        ("gateway", "http"): everyone,  # the edge
    }
    for role in POOLS:
        expected[(role, "health")] = everyone  # kubelet's probes: plaintext health only
    for role in ROLES:
        expected[(role, "metrics")] = {"prometheus"}  # the `monitoring` namespace, gateway too
    for role in ROLES:
        ports = {p["name"] for p in the_container(objects, role)["ports"]}
        assert ports == {port for r, port in expected if r == role}, role  # every port judged
        for port in sorted(ports):
            assert reachable(objects, role, port) == expected[(role, port)], (role, port)
    # every port a policy names is a port of some pod it selects (a typo would open nothing)
    for policy in by_kind(objects, "NetworkPolicy").values():
        selected = [r for r in ROLES if _selects(policy["spec"]["podSelector"],
                                                 _pod_labels(objects, r))]  # fmt: skip
        assert selected, policy["metadata"]["name"]
        named = {p["name"] for r in selected for p in the_container(objects, r)["ports"]}
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                assert port["port"] in named, (policy["metadata"]["name"], port)


# Where a pod may connect to, besides the Tandem roles' own ports: (name, peer, port, protocol).
DNS = ({"kubernetes.io/metadata.name": "kube-system"}, {"k8s-app": "kube-dns"})
OTHER_DESTINATIONS: list[tuple[str, tuple[dict[str, str], dict[str, str]] | None, int, str]] = [
    ("DNS over UDP", DNS, 53, "UDP"),
    ("DNS over TCP", DNS, 53, "TCP"),
    ("DNS's other ports", DNS, 9153, "TCP"),
    ("the internet", None, 443, "TCP"),
    ("the Kubernetes API", ({"kubernetes.io/metadata.name": "default"}, {}), 443, "TCP"),
    ("another pod of the namespace", (NAMESPACE, {"app": "other"}), 8080, "TCP"),
]


def may_connect(objects: list[Obj], role: str) -> set[str]:
    """Where ``role``'s pods may open connections, as Kubernetes evaluates egress
    NetworkPolicies (the union of the egress rules of every policy that selects the pod and
    lists Egress; a pod no such policy selects may go anywhere): ``<role>:<port name>`` for
    the Tandem pods' ports, and the names of :data:`OTHER_DESTINATIONS`."""
    destinations = [(f"{r}:{p['name']}", (NAMESPACE, _pod_labels(objects, r)), p["name"],
                     p["containerPort"], "TCP")
                    for r in ROLES for p in the_container(objects, r)["ports"]]  # fmt: skip
    destinations += [(name, peer, None, number, protocol)
                     for name, peer, number, protocol in OTHER_DESTINATIONS]  # fmt: skip
    policies = [p["spec"] for p in by_kind(objects, "NetworkPolicy").values()
                if "Egress" in p["spec"]["policyTypes"]
                and _selects(p["spec"]["podSelector"], _pod_labels(objects, role))]  # fmt: skip
    if not policies:
        return {d[0] for d in destinations}
    allowed: set[str] = set()
    for rule in (r for p in policies for r in p.get("egress", [])):
        for name, peer, port_name, number, protocol in destinations:
            ports = rule.get("ports")
            if ports is not None and not any(
                    p["port"] in (port_name, number) and p.get("protocol", "TCP") == protocol
                    for p in ports):  # fmt: skip
                continue
            entries = rule.get("to")
            if entries is None or any(_admits(e, peer) for e in entries):
                allowed.add(name)
    return allowed


@pytest.mark.parametrize("name", RENDERINGS)
def test_network_policies_restrict_egress_to_each_role_s_peers(
    rendered: dict[str, list[Obj]], name: str
) -> None:
    """The gateway reaches the tokenizer replicas' and the workers' gRPC ports and DNS; prefill
    reaches decode's gRPC port (KV) and DNS; the tokenizer and decode reach nothing (they only
    answer). Nobody reaches the internet, the Kubernetes API, or another pod's other ports."""
    objects = rendered[name]
    dns = {"DNS over UDP", "DNS over TCP"}
    expected = {
        "gateway": {"tokenizer:grpc", "prefill:grpc", "decode:grpc", *dns},
        "prefill": {"decode:grpc", *dns},
        "tokenizer": set(),
        "decode": set(),
    }
    for role in ROLES:
        assert may_connect(objects, role) == expected[role], role
    # every named port of an egress rule is a port of some pod it may go to (a typo opens nothing)
    ports = {p["name"] for r in ROLES for p in the_container(objects, r)["ports"]}
    for policy in by_kind(objects, "NetworkPolicy").values():
        for rule in policy["spec"].get("egress", []):
            for port in rule.get("ports", []):
                assert isinstance(port["port"], int) or port["port"] in ports, policy
