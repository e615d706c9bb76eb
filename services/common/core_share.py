"""Cores shared by co-located workers: each says how many threads it is running, and sizes its
next engine step's team to the cores the others leave.

Why: when ``tandem up`` has fewer cores than two per worker, its prefill and decode workers share
every core (``cpu_plan.py``). A decode step opens ~100 short OpenMP parallel regions, each ending
in a barrier that needs every thread of its team running; while a long prompt's prefill keeps
both cores busy, each of those barriers waits for a descheduled team thread, and a step of
milliseconds takes up to seconds (docs/benchmarks.md has the measurements). A one-thread team
has no barrier to wait at. So each worker publishes the size of the team it is stepping with
(0 when idle) in a small shared file, and before a step takes ``max(1, cores - others)`` threads
(at most its own ``--threads``): alone it runs its full team; beside a busy peer, a core each.

A peer can start stepping while a worker's step is under way with every core: the decode worker
began a step with both threads while the prefill worker was idle, the prefill worker then began
its step with one thread beside them, and that decode step waited at its barriers for 1.2 s
instead of 10 ms. So a *patient* worker (``tandem up`` makes prefill workers patient beside decode
workers: their steps are long and nobody streams from them) that finds no core free says it wants
one (publishes 1) and waits, at most :data:`PATIENCE` seconds, until the others' published teams
leave it one: a decode worker's next step sees the 1 and takes a core less, so the wait is about
one decode step. An impatient worker never waits: a decode step beside a prefill that holds every
core runs one thread (it has no barriers then; the prefill's step is seconds long).

The file holds one little-endian int32 per worker (its slot), mapped by every worker; a slot is
written only by its owner, and a torn read is impossible for an aligned 4-byte word.
``TANDEM_CORE_SHARE=PATH,SLOT,SLOTS,CORES[,patient]`` (set by ``tandem up``'s plan) turns it on.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator, Mapping

from services.common.errors import InvalidArgumentError

ENV = "TANDEM_CORE_SHARE"
PATIENT = "patient"
PATIENCE = 0.25
"""The longest a patient worker waits for a core before stepping beside a full team anyway."""
_POLL = 0.0005
_WORD = struct.Struct("<i")


class CoreShare:
    """This worker's view of the shared file: its ``slot`` of ``slots``, ``cores`` in all;
    ``patient``: wait for a core before a step rather than step beside a full team."""

    def __init__(self, path: str, slot: int, slots: int, cores: int, *,
                 patient: bool = False) -> None:  # fmt: skip
        if not (0 <= slot < slots) or cores < 1:
            raise InvalidArgumentError(f"bad core share: slot {slot} of {slots}, {cores} cores",
                                       param=ENV)  # fmt: skip
        self.slot, self.slots, self.cores, self.patient = slot, slots, cores, patient
        size = _WORD.size * slots
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # zero-filled; every worker asks for the same size
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.publish(0)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CoreShare | None:
        """The share ``TANDEM_CORE_SHARE`` names, or None when it is unset."""
        value = (os.environ if environ is None else environ).get(ENV, "")
        if not value:
            return None
        patient = value.endswith("," + PATIENT)
        parts = value.removesuffix("," + PATIENT).rsplit(",", 3)
        if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
            raise InvalidArgumentError(
                f"{ENV} wants PATH,SLOT,SLOTS,CORES[,{PATIENT}], got {value!r}", param=ENV)
        return cls(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), patient=patient)

    def publish(self, threads: int) -> None:
        """Say this worker is running ``threads`` threads now (0: idle)."""
        _WORD.pack_into(self._map, self.slot * _WORD.size, threads)

    def others(self) -> int:
        """Threads the other workers say they are running now."""
        return sum(_WORD.unpack_from(self._map, i * _WORD.size)[0]
                   for i in range(self.slots) if i != self.slot)  # fmt: skip

    def team_for_step(self, wanted: int) -> int:
        """The team a step of this worker takes: what the others leave of the cores, at least
        one thread, at most ``wanted``."""
        return max(1, min(wanted, self.cores - self.others()))

    @contextlib.contextmanager
    def stepping(self, wanted: int, set_threads: Callable[[int], None]) -> Iterator[int]:
        """Around one engine step: wait for a core if patient and none is free, size the team
        (``set_threads``), publish it, and publish 0 after."""
        if self.patient and self.others() >= self.cores:
            self.publish(1)  # wanting a core: the others' next steps leave one
            deadline = time.monotonic() + PATIENCE
            while self.others() >= self.cores and time.monotonic() < deadline:
                time.sleep(_POLL)
        team = self.team_for_step(wanted)
        set_threads(team)
        self.publish(team)
        try:
            yield team
        finally:
            self.publish(0)

    def close(self) -> None:
        with contextlib.suppress(ValueError, BufferError):
            self.publish(0)
            self._map.close()
