"""Tensor-parallel widths in the deployments (issue 48): ``tandem up`` gives prefill and decode
workers their widths (one for both, or one each), compose.yaml takes a width per role from the
environment (one container holds a worker's ranks), and ``docker-compose config`` renders it.
The Kubernetes overlays' widths are checked with the other manifests (tests/test_kubernetes.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from services.cli import build_parser
from services.common.errors import InvalidArgumentError
from services.launch_plan import LaunchConfig, plan

REPO = Path(__file__).resolve().parents[1]


def _widths(config: LaunchConfig) -> dict[str, int | None]:
    """Each worker's ``--tensor-parallel-size`` (None: the flag is absent, width 1)."""
    out: dict[str, int | None] = {}
    for spec in plan(config):
        if spec.service in ("prefill", "decode"):
            argv = list(spec.argv)
            flag = "--tensor-parallel-size"
            out[spec.name] = int(argv[argv.index(flag) + 1]) if flag in argv else None
    return out


def test_disaggregated_workers_take_one_width_or_one_each() -> None:
    both = LaunchConfig(num_prefill=1, num_decode=2, gateway=False, tensor_parallel_size=2)
    assert _widths(both) == {"prefill-0": 2, "decode-0": 2, "decode-1": 2}
    wide_prefill = LaunchConfig(num_prefill=1, num_decode=1, gateway=False,
                                prefill_tensor_parallel_size=2)  # fmt: skip
    assert _widths(wide_prefill) == {"prefill-0": 2, "decode-0": None}
    override = LaunchConfig(num_prefill=1, num_decode=1, gateway=False, tensor_parallel_size=4,
                            decode_tensor_parallel_size=1)  # fmt: skip
    assert _widths(override) == {"prefill-0": 4, "decode-0": None}
    plain = LaunchConfig(num_prefill=1, num_decode=1, gateway=False)
    assert _widths(plain) == {"prefill-0": None, "decode-0": None}
    for bad in ({"tensor_parallel_size": 0}, {"decode_tensor_parallel_size": 0},
                {"prefill_tensor_parallel_size": -1}):  # fmt: skip
        with pytest.raises(InvalidArgumentError, match="tensor-parallel-size must be >= 1"):
            plan(LaunchConfig(num_prefill=1, num_decode=1, gateway=False, **bad))


def test_tandem_up_parses_the_per_role_widths() -> None:
    argv = ["up", "--tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1"]
    args = build_parser(argv).parse_args(argv)
    assert (args.tensor_parallel_size, args.prefill_tensor_parallel_size,
            args.decode_tensor_parallel_size) == (2, None, 1)  # fmt: skip


def test_compose_takes_each_worker_s_width_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """compose.yaml sets the workers' TANDEM_TENSOR_PARALLEL_SIZE (their flag's default) from
    TANDEM_PREFILL_/TANDEM_DECODE_TENSOR_PARALLEL_SIZE, 1 unless set; the worker's parser
    reads it."""
    from tests.test_compose import COMPOSE, command_of, interpolate, load

    services = load(COMPOSE)["services"]
    for role in ("prefill", "decode"):
        value = services[role]["environment"]["TANDEM_TENSOR_PARALLEL_SIZE"]
        assert value == f"${{TANDEM_{role.upper()}_TENSOR_PARALLEL_SIZE:-1}}"
        assert interpolate(value) == "1"
        argv = command_of(services[role])[1:]
        monkeypatch.setenv("TANDEM_TENSOR_PARALLEL_SIZE", "2")
        assert build_parser(argv).parse_args(argv).tensor_parallel_size == 2
    for role in ("tokenizer", "gateway"):
        assert "TANDEM_TENSOR_PARALLEL_SIZE" not in services[role].get("environment", {})


def test_docker_compose_config_renders_the_widths() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        if os.environ.get("TANDEM_REQUIRE_COMPOSE"):
            pytest.fail("docker-compose is required on CI (apt-get install -y docker-compose)")
        pytest.skip("docker-compose is not installed")
    yaml = pytest.importorskip("yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "COMPOSE_"))}
    env["TANDEM_DECODE_TENSOR_PARALLEL_SIZE"] = "2"
    out = subprocess.run([binary, "-f", str(REPO / "compose.yaml"), "config"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    assert str(services["decode"]["environment"]["TANDEM_TENSOR_PARALLEL_SIZE"]) == "2"
    assert str(services["prefill"]["environment"]["TANDEM_TENSOR_PARALLEL_SIZE"]) == "1"
