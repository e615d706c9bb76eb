"""Builds of the one-call decode layers from several source trees, taking turns step by step in one
process: which is faster, on a machine whose memory changes speed from second to second.

    python bench/decode_layers_ab.py --model GGUF --variant /tmp/base --variant .
        [--variant .@q4_k=4096,q6_k=16384] [--requests 6] [--prompt 32] [--steps 64]

``compare_trees.py`` runs each tree in a process of its own, turn about; on a VM whose memory
reads ~35 GB/s for some seconds and ~60 GB/s for the next (the 2-vCPU Zen 4 of
docs/benchmarks.md), two processes a few seconds apart meet different machines, and a 1-3%
change is lost in that. Here one engine decodes and its one-call layers (``tandem_decode_layers``)
come from each variant's build in turn: decode step i of request r runs variant (i + r) mod V,
so every cycle of V steps sees one memory state, and the table gives each variant's median engine step and C-call time
and, per cycle, its time over the first variant's (the median, and the median over the faster
half of the cycles, by their mean step: the fast memory state's). A variant is a source tree (a
checkout: its ``services/engine/core/kernels``, copied and built here with the engine's own
flags) and, after ``@``, prefetch distances its build takes instead of the tuned ones
(``tandem tune``; format=bytes, 0: none). The head, embedding and sampling are this tree's for
every variant. Every variant must compute the same bits, or the comparison means nothing: each
request's greedy tokens must be the ones this tree's own layers give, or the script fails.

Make a base tree with ``git worktree add /tmp/base <commit>``; run on an idle machine.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from services.engine.core.kernels import prefetch_tuning  # noqa: E402
from services.engine.core.kernels.native_build import (  # noqa: E402
    CFLAGS,
    compile_library,
    isa_flags,
    library_isa,
    selected_isa,
)
from services.engine.core.kernels.tile_formats import FORMAT_CODES  # noqa: E402
from services.engine.core.loaders import load_model  # noqa: E402

KERNELS = Path("services/engine/core/kernels")
ENTRY = "cpu_decode_layers.c"


def build_variant(spec: str, index: int, into: Path) -> ctypes.CDLL:
    """The variant ``tree[@format=bytes,...]`` built into ``into`` as a library of its own (its
    own prefetch table), with its distances set."""
    tree, _, distances = spec.partition("@")
    sources = into / f"variant{index}"
    shutil.copytree(Path(tree) / KERNELS, sources, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    isa = library_isa(sources / ENTRY, selected_isa())
    target = sources / "layers.so"
    compile_library(sources / ENTRY, isa, [*CFLAGS, *isa_flags(isa)], target)
    library = prefetch_tuning.apply(ctypes.CDLL(str(target), mode=ctypes.RTLD_LOCAL))
    for item in filter(None, distances.split(",")):
        name, _, value = item.partition("=")
        if name not in FORMAT_CODES or not value.isdigit():
            raise SystemExit(f"{spec}: {item!r} is not format=bytes (formats: {sorted(FORMAT_CODES)})")
        if library.tandem_set_prefetch_ahead(FORMAT_CODES[name], ctypes.c_int64(int(value))) != 0:
            raise SystemExit(f"{spec}: {name}={value} is not a prefetch distance this build takes")
    return library


def timed(fn: ctypes._CFuncPtr, spent: list[float]) -> Callable[..., int]:  # type: ignore[name-defined]
    """``fn`` that adds each call's seconds to ``spent[-1]``."""

    def call(*args: object) -> int:
        start = time.perf_counter()
        status = fn(*args)
        spent[-1] += time.perf_counter() - start
        return int(status)

    return call


def decode(engine: LLMEngine, prompt: list[int], params: SamplingParams, request_id: str,
           turn: Callable[[int], int | None], steps: list[list[float]] | None = None) -> list[int]:
    """One request's greedy tokens, ``turn(i)`` choosing the layers before decode step i (and
    returning the variant whose ``steps`` list takes the step's seconds, or None)."""
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    for out in engine.step():  # the prompt and the first token: the prefill path
        tokens.extend(out.new_token_ids)
    i = 0
    while engine.has_unfinished():
        v = turn(i)
        start = time.perf_counter()
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        if v is not None and steps is not None:
            steps[v].append(time.perf_counter() - start)
        i += 1
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--variant", action="append", required=True,
                        help="a source tree, optionally @format=bytes,... prefetch distances")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if len(args.variant) < 2:
        parser.error("compare at least two variants")
    loaded = load_model(args.model, "auto")
    blocks = -(-(args.prompt + args.steps + 1) // 16) + 8
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=1, num_blocks=blocks, block_size=16,
                                            enable_prefix_caching=False))  # fmt: skip
    call = loaded.model.decode_layers
    if call is None:
        raise SystemExit("this model's decode steps do not take the one-call layers here")
    reference = call._fn
    n = len(args.variant)
    steps: list[list[float]] = [[] for _ in range(n)]
    layers: list[list[float]] = [[] for _ in range(n)]
    with tempfile.TemporaryDirectory() as scratch:
        fns = []
        for i, spec in enumerate(args.variant):
            fn = build_variant(spec, i, Path(scratch)).tandem_decode_layers
            fn.argtypes, fn.restype = reference.argtypes, reference.restype
            fns.append(timed(fn, layers[i]))
        params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
        prompt = list(range(100, 100 + args.prompt))
        expected = decode(engine, prompt, params, "reference", lambda i: None)
        for r in range(args.requests):
            # each request starts on another variant: none always meets the same positions
            def turn(i: int, r: int = r) -> int:
                v = (i + r) % n
                call._fn = fns[v]
                layers[v].append(0.0)
                return v

            got = decode(engine, prompt, params, f"r{r}", turn, steps)
            call._fn = reference
            if got != expected:
                raise SystemExit("the variants' greedy tokens differ from this tree's: they do "
                                 "not compute the same bits")
            cycles = min(map(len, steps))
            for kept in (*steps, *layers):
                del kept[cycles:]  # whole cycles only
        call._fn = reference
    report(args.variant, steps, layers)


def report(names: list[str], steps: list[list[float]], layers: list[list[float]]) -> None:
    """The table: per variant, medians and the per-cycle ratio to the first variant."""
    base = steps[0]
    # a cycle's state by its mean over the variants (not the first's alone, whose own fast
    # steps would make every other variant look slower there)
    means = [statistics.fmean(cycle) for cycle in zip(*steps, strict=True)]
    fast_cut = statistics.median(means)
    print(f"\n{len(base)} cycles of {len(names)} steps\n")
    print("| variant | step ms (median) | layers call ms (median) | step / first's, per cycle "
          "(median) | in the faster half of cycles |")
    print("|---|---|---|---|---|")
    for name, s, c in zip(names, steps, layers, strict=True):
        ratios = [b / a for a, b in zip(base, s, strict=True)]
        fast = [b / a for a, b, m in zip(base, s, means, strict=True) if m < fast_cut] or ratios
        print(f"| `{name}` | {statistics.median(s) * 1e3:.3f} | {statistics.median(c) * 1e3:.3f} | "
              f"{statistics.median(ratios):.4f} | {statistics.median(fast):.4f} |")


if __name__ == "__main__":
    main()
