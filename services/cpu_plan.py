"""How ``tandem up`` places its workers on the machine's cores: intra-op threads per worker, the
cores each may run on, and how idle OpenMP threads wait.

Why: every prefill and decode worker is a PyTorch process whose OpenMP team defaults to one
thread per core. Left alone, two workers on a 2-core machine run four busy threads on two cores,
and each keeps spinning on cores the other needs after its own work ends. The plan, for ``C``
usable cores (the launcher's CPU affinity) and ``W`` workers:

1. ``W > 1`` and ``C >= 2 W`` (room for every worker to have at least two cores): each gets a disjoint
   slice of ``C // W`` cores (the remainder goes to decode workers, first to last), is pinned to
   it (``--cpus``), and runs that many threads (``--threads``).
2. Otherwise the workers share every core (no pinning). A decode worker runs ``C // D`` threads
   (``D`` decode workers, at least 1), a prefill worker ``C // P``. Prefill workers then get
   ``OMP_WAIT_POLICY=PASSIVE``: a finished prefill's threads sleep at once instead of spinning
   on the cores a decode step is using. Decode workers keep OpenMP's spinning: a decode step
   opens hundreds of short parallel regions, and waking sleeping threads for each costs more
   than the step itself (measured: a step ~3x slower).
   With ``core_share`` (a file path; ``tandem up`` makes one per run), these workers also
   share how many threads each is running (``services/common/core_share.py``): each engine step
   takes the cores the others leave, so a decode step beside a busy prefill runs one thread on
   its own core instead of two that wait for each other at every barrier; and a prefill worker
   that finds every core taken waits (a fraction of a second at most) for the decode step under
   way to end, rather than start beside its full team.

``--threads ROLE=N`` overrides a role's thread count (placement is unchanged). The tokenizer
and the gateway are light (no torch work) and are not placed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.common.core_share import ENV as CORE_SHARE_ENV
from services.common.core_share import PATIENT as CORE_SHARE_PATIENT
from services.common.cpu_list import format_cpus
from services.common.errors import InvalidArgumentError

ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class Placement:
    """One worker's share of the machine.

    Attributes:
        threads: intra-op threads (PyTorch and the native kernels).
        cpus: the cores it is pinned to, or None to run anywhere.
        env: environment variables its process starts with (OpenMP's wait policy).
    """

    threads: int
    cpus: tuple[int, ...] | None = None
    env: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        where = "cpus " + format_cpus(self.cpus) if self.cpus is not None else "shared cores"
        wait = ", idle threads sleep" if self.env.get("OMP_WAIT_POLICY") == "PASSIVE" else ""
        share = ", cores shared step by step" if CORE_SHARE_ENV in self.env else ""
        return f"{self.threads} threads, {where}{wait}{share}"


def usable_cpus() -> tuple[int, ...]:
    """The cores this process may run on (its affinity), in order."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


def plan_cpus(
    num_prefill: int,
    num_decode: int,
    cpus: Sequence[int],
    threads: Mapping[str, int] | None = None,
    core_share: str | None = None,
) -> dict[str, Placement]:
    """A placement per worker name (``prefill-0``, ``decode-1``, ...); see the module rules."""
    threads = dict(threads or {})
    for role, count in threads.items():
        if role not in ROLES:
            raise InvalidArgumentError(f"--threads names a role {role!r}; use prefill or decode",
                                       param="threads")  # fmt: skip
        if count < 1:
            raise InvalidArgumentError("--threads must be >= 1", param="threads")
    names = [f"prefill-{i}" for i in range(num_prefill)] + [f"decode-{i}" for i in range(num_decode)]
    if not names:
        return {}
    cores = list(cpus)
    if not cores:
        raise InvalidArgumentError("no usable CPU cores", param="threads")
    plan: dict[str, Placement] = {}
    if len(names) > 1 and len(cores) >= 2 * len(names):
        share, extra = divmod(len(cores), len(names))
        sizes = {name: share for name in names}
        decodes = [n for n in names if n.startswith("decode")] or names
        for i in range(extra):
            sizes[decodes[i % len(decodes)]] += 1
        start = 0
        for name in names:
            mine = tuple(cores[start : start + sizes[name]])
            start += sizes[name]
            plan[name] = Placement(threads.get(_role(name), len(mine)), mine)
        return plan
    share = core_share is not None and len(names) > 1
    for slot, name in enumerate(names):
        role = _role(name)
        count = num_prefill if role == "prefill" else num_decode
        default = max(1, len(cores) // count)
        beside_decode = role == "prefill" and num_decode > 0
        env = {"OMP_WAIT_POLICY": "PASSIVE"} if beside_decode else {}
        if share:  # a prefill worker waits for a core rather than stall a decode step's team
            patient = f",{CORE_SHARE_PATIENT}" if beside_decode else ""
            env[CORE_SHARE_ENV] = f"{core_share},{slot},{len(names)},{len(cores)}{patient}"
        plan[name] = Placement(threads.get(role, default), None, env)
    return plan


def parse_threads(values: Sequence[str]) -> dict[str, int]:
    """``["prefill=1", "decode=2"]`` (or comma-separated) as a role -> threads mapping."""
    out: dict[str, int] = {}
    for value in values:
        for item in filter(None, (part.strip() for part in value.split(","))):
            role, sep, count = item.partition("=")
            if not sep or not count.strip().isdigit():
                raise InvalidArgumentError(f"--threads wants ROLE=N, got {item!r}",
                                           param="threads")  # fmt: skip
            out[role.strip()] = int(count)
    return out


def _role(name: str) -> str:
    return name.split("-", 1)[0]
