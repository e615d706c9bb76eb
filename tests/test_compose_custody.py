"""compose.yaml's key custody and closed default (issue 47), statically and by running its
scripts here (no Docker): which volumes each service mounts (the CA's: the one-shot certs job
only; each role's: that job and that role), the certs job's own command run with its volumes as
directories (each volume holds exactly its role's three files, one trust domain), and the
gateway's entrypoint script run with sh (an API key made once, printed once, kept, reused).
The real-Docker counterpart is scripts/compose_test.py (CI): the only key file the gateway
container can find is its own.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from services.cli import build_parser
from services.cli import main as tandem_main
from tests.test_compose import COMPOSE, REPO, SERVICES, command_of, load

pytest.importorskip("yaml")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(COMPOSE)


def _volume_sources(service: dict[str, Any]) -> dict[str, str]:
    """``{mount point: named volume}`` of a service's volumes (bind mounts excluded)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if not source.startswith((".", "/")):
            out[target] = source
    return out


def test_key_custody_each_service_mounts_only_its_own_key(compose: dict[str, Any]) -> None:
    """The CA key lives only in the one-shot certs job's volume; each service mounts its own
    role's volume (read-only) and no other: the gateway cannot read the CA key or decode's."""
    services = compose["services"]
    certs = services["certs"]
    argv = command_of(certs)
    args = build_parser(argv[1:]).parse_args(argv[1:])
    assert args.module == "services.certs_cli" and args.if_missing  # every `up` keeps the CA
    assert args.directory == "/ca" and certs["restart"] == "no"
    role_dirs = dict(value.split("=", 1) for value in args.role_dir)
    assert role_dirs == {name: f"/certs-{name}" for name in SERVICES}
    assert _volume_sources(certs) == {"/ca": "tandem-ca",
                                      **{f"/certs-{n}": f"tandem-certs-{n}" for n in SERVICES}}
    assert args.trust_domain == ""  # TANDEM_TRUST_DOMAIN unset: a new one per deployment
    for volume in ("tandem-ca", *(f"tandem-certs-{n}" for n in SERVICES)):
        assert volume in compose["volumes"]
    mounted_by: dict[str, set[str]] = {}
    for name, service in services.items():
        for source in _volume_sources(service).values():
            mounted_by.setdefault(source, set()).add(name)
    assert mounted_by["tandem-ca"] == {"certs"}  # the CA key: the one-shot job only
    for name in SERVICES:
        assert mounted_by[f"tandem-certs-{name}"] == {"certs", name}, name
        service = services[name]
        own = [v for v in service["volumes"] if v.startswith("tandem-certs")]
        assert own == [f"tandem-certs-{name}:/certs:ro"], name
        env = service["environment"]
        assert env["TANDEM_TLS_CERT"] == f"/certs/{name}.pem", name
        assert env["TANDEM_TLS_KEY"] == f"/certs/{name}-key.pem", name
        assert env["TANDEM_TLS_CA"] == "/certs/ca.pem", name
        assert service["depends_on"]["certs"]["condition"] == "service_completed_successfully"
        assert "--insecure-internal" not in command_of(service)
    gateway = _volume_sources(services["gateway"])
    assert gateway == {"/certs": "tandem-certs-gateway", "/var/lib/tandem": "tandem-api-key"}
    assert mounted_by["tandem-api-key"] == {"gateway"}
    dockerfile = (REPO / "Dockerfile").read_text()  # each mount point exists, tandem-owned
    for point in ("/certs", "/ca", "/var/lib/tandem", *(f"/certs-{n}" for n in SERVICES)):
        assert point in dockerfile, point


def test_the_certs_job_writes_what_each_service_reads(compose: dict[str, Any],
                                                      tmp_path: Path) -> None:  # fmt: skip
    """The certs job's own command, run here with its volumes as directories: every service's
    volume holds exactly its ca.pem, certificate and key, in one generated trust domain."""
    from services.common.spiffe_id import trust_domain_of

    argv = command_of(compose["services"]["certs"])
    mounts = _volume_sources(compose["services"]["certs"])  # mount point -> volume

    def moved(word: str) -> str:  # a mount point (alone, or after ROLE=) -> its volume's dir
        prefix, sep, path = word.rpartition("=")
        if path in mounts:
            return f"{prefix}{sep}{tmp_path / mounts[path]}"
        return word

    assert tandem_main([moved(word) for word in argv[1:]]) == 0
    domains = set()
    for name in SERVICES:
        files = sorted(p.name for p in (tmp_path / f"tandem-certs-{name}").iterdir())
        assert files == sorted(["ca.pem", f"{name}.pem", f"{name}-key.pem"]), name
        cert = tmp_path / f"tandem-certs-{name}" / f"{name}.pem"
        domains.add(trust_domain_of(cert.read_bytes()))
    assert len(domains) == 1 and domains.pop().startswith("tandem-")
    assert (tmp_path / "tandem-ca" / "ca-key.pem").exists()


def test_gateway_makes_an_api_key_once_and_keeps_it(compose: dict[str, Any],
                                                    tmp_path: Path) -> None:  # fmt: skip
    """Closed by default: no TANDEM_ALLOW_NO_AUTH anywhere; the gateway's entrypoint script
    (run here with sh; the command becomes a program that prints its arguments) makes a key at
    the first start, prints it once, keeps it 0600 in its volume, reuses it, and steps aside
    when TANDEM_API_KEYS is set."""
    gateway = compose["services"]["gateway"]
    assert "TANDEM_ALLOW_NO_AUTH" not in gateway["environment"]
    assert "TANDEM_ALLOW_NO_AUTH" not in COMPOSE.read_text()
    assert gateway["entrypoint"][:2] == ["sh", "-c"]
    script = gateway["entrypoint"][2].replace("$$", "$")  # Compose's escape for a literal $
    assert script.count("/var/lib/tandem") == 1

    def start(keys: str, volume: Path) -> tuple[str, str]:
        volume.mkdir(exist_ok=True)
        body = script.replace("/var/lib/tandem", str(volume))
        env = {"PATH": os.environ["PATH"], "TANDEM_API_KEYS": keys}
        done = subprocess.run(["sh", "-c", body, "gateway", "echo", "tandem", "serve", "gateway"],
                              env=env, capture_output=True, text=True, timeout=30, check=True)
        *printed, argv = done.stdout.strip().splitlines()
        return "\n".join(printed), argv

    volume = tmp_path / "tandem-api-key"
    printed, argv = start("", volume)
    key = (volume / "api-keys").read_text().strip()
    assert key.startswith("sk-tandem-") and len(key) == len("sk-tandem-") + 48
    assert key in printed  # shown once, at the first start
    assert argv == f"tandem serve gateway --api-keys-file {volume}/api-keys"
    assert (volume / "api-keys").stat().st_mode & 0o777 == 0o600
    printed, argv = start("", volume)
    assert key not in printed and argv.endswith(f"--api-keys-file {volume}/api-keys")
    assert (volume / "api-keys").read_text().strip() == key  # kept across restarts
    assert start("", tmp_path / "another")[0] != ""  # another deployment: another key
    assert (tmp_path / "another" / "api-keys").read_text().strip() != key
    printed, argv = start("sk-from-env", tmp_path / "unused")
    assert argv == "tandem serve gateway" and not (tmp_path / "unused" / "api-keys").exists()
