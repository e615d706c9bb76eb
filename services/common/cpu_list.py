"""CPU lists in the syntax of ``taskset -c`` and the kernel (``0-3,6``), parsed and written.

Shared by ``tandem up``'s placement plan (``services/cpu_plan.py``), which writes a worker's
``--cpus``, and the worker, which parses it and pins itself (``os.sched_setaffinity``).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.errors import InvalidArgumentError


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"0-2,5"`` as ``(0, 1, 2, 5)``; InvalidArgumentError on anything else."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise InvalidArgumentError(f"--cpus wants a list like 0-3,6, got {text!r}",
                                       param="cpus")  # fmt: skip
        low, high = int(first), int(last) if sep else int(first)
        if high < low:
            raise InvalidArgumentError(f"--cpus range {part!r} runs backwards", param="cpus")
        cpus.update(range(low, high + 1))
    if not cpus:
        raise InvalidArgumentError("--cpus is empty", param="cpus")
    return tuple(sorted(cpus))


def format_cpus(cpus: Sequence[int]) -> str:
    """``(0, 1, 2, 5)`` as ``"0-2,5"``."""
    spans: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if spans and cpu == spans[-1][-1] + 1:
            spans[-1].append(cpu)
        else:
            spans.append([cpu])
    return ",".join(str(s[0]) if len(s) == 1 else f"{s[0]}-{s[-1]}" for s in spans)
