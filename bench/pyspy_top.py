"""Summarize a ``py-spy record --format raw`` profile (collapsed stacks) as two short tables.

    python bench/pyspy_top.py PROFILE.txt [--top 20]

The raw format has one line per distinct stack, ``frame;frame;...;frame COUNT``, root first.
Printed: the frames where samples were taken (self time) and the frames on the most stacks
(inclusive time, each frame counted once per stack; the project's own frames only), as shares of all samples. Used by
``bench/gpu_served.py --profile`` so a served run on a lent GPU comes back with where its
processes spend their time in a few lines instead of a flame graph file.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path


def summarize(text: str, top: int) -> str:
    """The two tables for one profile's collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            if "services/" in frame:  # the project's own frames: the runtime's are on every stack
                inclusive[frame] += n
    if total == 0:
        return "no samples\n"
    lines = [f"{total} samples", "", "self:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame[:150]}" for frame, n in own.most_common(top)]
    lines += ["", "inclusive (services/ frames):"]
    lines += [f"  {100 * n / total:5.1f}%  {frame[:150]}" for frame, n in inclusive.most_common(top)]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", type=Path, nargs="+")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    for path in args.profiles:
        sys.stdout.write(f"== {path.name}\n")
        sys.stdout.write(summarize(path.read_text(errors="replace"), args.top) if path.exists()
                         else "missing\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
