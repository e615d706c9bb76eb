"""``tandem up``'s CPU plan (services/cpu_plan.py) and the CPU list syntax it writes."""

from __future__ import annotations

import sys

import pytest

from services.common.cpu_list import format_cpus, parse_cpus
from services.common.errors import InvalidArgumentError
from services.cpu_plan import plan_cpus
from services.launch_plan import LaunchConfig, plan


def test_cpu_lists_round_trip() -> None:
    assert parse_cpus("0-2,5") == (0, 1, 2, 5)
    assert parse_cpus("3,1,2") == (1, 2, 3)
    assert format_cpus((5, 0, 1, 2)) == "0-2,5"
    assert format_cpus((7,)) == "7"
    for bad in ("", "a", "3-1", "1-", "-2"):
        with pytest.raises(InvalidArgumentError):
            parse_cpus(bad)


def test_two_cores_are_shared_and_prefill_sleeps_when_idle() -> None:
    placed = plan_cpus(1, 1, (0, 1))
    assert placed["decode-0"].threads == 2 and placed["decode-0"].cpus is None
    assert placed["decode-0"].env == {}  # decode keeps spinning between its short regions
    assert placed["prefill-0"].threads == 2 and placed["prefill-0"].cpus is None
    assert placed["prefill-0"].env == {"OMP_WAIT_POLICY": "PASSIVE"}
    two_decoders = plan_cpus(0, 2, (0, 1))
    assert [p.threads for p in two_decoders.values()] == [1, 1]
    assert all(p.env == {} for p in two_decoders.values())  # no prefill worker at all


def test_enough_cores_are_split_and_pinned_apart() -> None:
    placed = plan_cpus(1, 2, tuple(range(7)))  # 7 cores, 3 workers: 2 each, 1 left for decode-0
    assert placed["prefill-0"].cpus == (0, 1) and placed["prefill-0"].threads == 2
    assert placed["decode-0"].cpus == (2, 3, 4) and placed["decode-0"].threads == 3
    assert placed["decode-1"].cpus == (5, 6) and placed["decode-1"].threads == 2
    cores = [c for p in placed.values() for c in p.cpus or ()]
    assert sorted(cores) == list(range(7))  # disjoint and complete
    assert all(p.env == {} for p in placed.values())


def test_threads_override_and_bad_overrides() -> None:
    placed = plan_cpus(1, 1, (0, 1), {"decode": 1})
    assert placed["decode-0"].threads == 1 and placed["prefill-0"].threads == 2
    with pytest.raises(InvalidArgumentError, match="role"):
        plan_cpus(1, 1, (0, 1), {"gateway": 1})
    with pytest.raises(InvalidArgumentError):
        plan_cpus(1, 1, (0, 1), {"decode": 0})


@pytest.mark.skipif(sys.platform != "linux", reason="the worker flags are planned on Linux")
def test_plan_passes_threads_cpus_and_the_mode_on() -> None:
    specs = {s.name: s for s in plan(LaunchConfig(num_prefill=1, num_decode=1, cpus=(0, 1, 2, 3),
                                                  worker_args=("--threads", "3")))}  # fmt: skip
    decode = list(specs["decode-0"].argv)
    assert decode[decode.index("--threads") + 1] == "2"
    assert decode[decode.index("--cpus") + 1] == "2-3"
    assert decode[-2:] == ["--threads", "3"]  # --worker-args come last and win
    assert "--no-prefill" not in specs["gateway"].argv
    colocated = {s.name: s for s in plan(LaunchConfig(mode="colocated", num_prefill=0,
                                                      num_decode=1, cpus=(0, 1)))}  # fmt: skip
    assert list(colocated) == ["tokenizer", "decode-0", "gateway"]
    assert "--no-prefill" in colocated["gateway"].argv
    assert "--prefill" not in colocated["gateway"].argv
    with pytest.raises(InvalidArgumentError, match="colocated"):
        plan(LaunchConfig(mode="colocated", num_prefill=1))
    with pytest.raises(InvalidArgumentError, match="mode"):
        plan(LaunchConfig(mode="both"))
