"""Cores shared step by step between co-located workers (services/common/core_share.py): what each
publishes, the team a step takes beside a busy peer, ``tandem up``'s plan turning it on, and an
engine loop stepping inside it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from services.common import core_share
from services.common.core_share import ENV, CoreShare
from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingParams
from services.cpu_plan import plan_cpus
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import load_model
from services.engine.runtime.engine_loop import EngineLoop
from services.engine.runtime.worker_runtime import team_scope


def test_a_step_takes_the_cores_its_peers_leave(tmp_path: Path) -> None:
    path = str(tmp_path / "cores")
    prefill, decode = CoreShare(path, 0, 2, 2), CoreShare(path, 1, 2, 2)
    assert decode.others() == 0 and decode.team_for_step(2) == 2  # alone: its whole team
    prefill.publish(2)
    assert decode.others() == 2 and decode.team_for_step(2) == 1  # beside a busy peer: one
    prefill.publish(1)
    assert decode.team_for_step(2) == 1 and decode.team_for_step(4) == 1
    seen: list[int] = []
    with decode.stepping(2, seen.append) as team:
        assert team == 1 and prefill.others() == 1  # published while it steps
    assert seen == [1] and prefill.others() == 0  # and 0 after
    prefill.publish(0)
    with decode.stepping(2, seen.append):
        assert prefill.others() == 2
    assert seen == [1, 2]
    again = CoreShare(path, 0, 2, 2)  # a restarted worker clears its own slot
    assert decode.others() == 0
    again.close()
    prefill.close()
    decode.close()


def test_a_patient_worker_waits_for_the_step_under_way_rather_than_join_a_full_team(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "cores")
    decode, prefill = CoreShare(path, 1, 2, 2), CoreShare(path, 0, 2, 2, patient=True)
    decode.publish(2)  # a decode step under way with both cores
    entered: list[tuple[int, float]] = []

    def prefill_step() -> None:
        with prefill.stepping(2, lambda team: None) as team:
            entered.append((team, time.monotonic()))

    thread = threading.Thread(target=prefill_step)
    thread.start()
    deadline = time.monotonic() + 5
    while decode.others() != 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert decode.others() == 1 and not entered  # it asks for a core and waits
    assert decode.team_for_step(2) == 1  # the decode worker's next step leaves it one
    released = time.monotonic()
    decode.publish(1)
    thread.join(5)
    assert entered and entered[0][0] == 1 and entered[0][1] >= released
    assert decode.others() == 0  # 0 again after its step

    impatient = CoreShare(path, 1, 2, 2)  # a decode worker (its slot) beside a full prefill
    prefill.publish(2)
    start = time.monotonic()
    with impatient.stepping(2, lambda team: None) as team:
        assert team == 1
    assert time.monotonic() - start < core_share.PATIENCE
    prefill.publish(0)
    decode.publish(2)
    start = time.monotonic()  # a peer that never lets go: the wait is bounded
    with prefill.stepping(2, lambda team: None) as team:
        assert team == 1 and time.monotonic() - start >= core_share.PATIENCE
    for share in (decode, prefill, impatient):
        share.close()


def test_the_environment_names_it_or_fails_clearly(tmp_path: Path) -> None:
    assert CoreShare.from_env({}) is None
    share = CoreShare.from_env({ENV: f"{tmp_path / 'a,b'},1,3,4"})  # a comma in the path
    assert share is not None and (share.slot, share.slots, share.cores) == (1, 3, 4)
    assert not share.patient
    share.close()
    share = CoreShare.from_env({ENV: f"{tmp_path / 'a,b'},0,3,4,patient"})
    assert share is not None and (share.slot, share.slots, share.cores, share.patient) == (0, 3, 4, True)
    share.close()
    for bad in ("x", f"{tmp_path / 'c'},1,2", f"{tmp_path / 'c'},2,2,2", f"{tmp_path / 'c'},0,2,0",
                f"{tmp_path / 'c'},a,2,2", f"{tmp_path / 'c'},0,2,2,eager"):
        with pytest.raises(InvalidArgumentError):
            CoreShare.from_env({ENV: bad})


def test_tandem_ups_plan_shares_cores_only_where_workers_share_them() -> None:
    shared = plan_cpus(1, 1, (0, 1), core_share="/run/cores")
    assert shared["prefill-0"].env[ENV] == "/run/cores,0,2,2,patient"  # waits for a core
    assert shared["decode-0"].env == {ENV: "/run/cores,1,2,2"}
    assert "shared step by step" in shared["decode-0"].describe()
    pinned = plan_cpus(1, 1, (0, 1, 2, 3), core_share="/run/cores")  # 2 cores each: apart
    assert all(ENV not in p.env for p in pinned.values())
    alone = plan_cpus(0, 1, (0, 1), core_share="/run/cores")
    assert ENV not in alone["decode-0"].env
    assert all(ENV not in p.env for p in plan_cpus(1, 1, (0, 1)).values())  # not asked for


async def test_every_engine_step_runs_in_the_team_the_share_gives(tmp_path: Path) -> None:
    path = str(tmp_path / "cores")
    peer, share = CoreShare(path, 0, 2, 2), CoreShare(path, 1, 2, 2)
    scope, entered = team_scope(share), 0

    def counting_scope():  # noqa: ANN202 - the scope's own type
        nonlocal entered
        entered += 1
        return scope()

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    loop = EngineLoop(LLMEngine(load_model("dummy:tiny"), EngineConfig(num_blocks=32)),
                      step_scope=counting_scope)  # fmt: skip
    loop.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        peer.publish(2)  # a busy prefill beside it
        outs = [out async for out in loop.generate("a", [5, 6, 7], params)]
        assert sum(len(out.new_token_ids) for out in outs) == 4
        threads_busy = await loop.call(lambda engine: torch.get_num_threads())
        peer.publish(0)
        outs = [out async for out in loop.generate("b", [5, 6, 7], params)]
        threads_alone = await loop.call(lambda engine: torch.get_num_threads())
        published_after = peer.others()  # the loop's slot, between steps
    finally:
        await loop.stop()
        torch.set_num_threads(before)
        peer.close()
        share.close()
    assert threads_busy == 1 and threads_alone == 2
    assert entered >= 8 and published_after == 0  # a step each token; 0 when idle
