"""Batch-1 decode and prefill of two checkouts side by side, on one GGUF, runs taking turns.

    python bench/compare_trees.py --base /tmp/base-checkout [--new .] --model GGUF
        [--dtype auto] [--pairs 3] [--prompt 512] [--steps 64]

A change to a kernel or the engine is judged against the tree before it on the same machine in
the same run: each pair runs the base tree, then the new one, each in a fresh process (its own
imports, its own kernel builds and autotune cache entries), and the table gives each figure's
best and median over the pairs with new / base. Per process: the prompt (random token ids,
prefix caching off) prefilled ``--repeats`` times, the best kept as tokens/s; then three rounds of
``--steps`` greedy decode steps after a 32-token prompt, the best round's mean step time (the
engine's whole step: scheduling, forward, sampling). Make the base checkout with ``git worktree
add /tmp/base <commit>``; run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger("compare_trees")


def measure(model: str, dtype: str, prompt_len: int, steps: int, repeats: int) -> dict[str, float]:
    """One tree's figures (this process imports the tree ``sys.path[0]`` points at)."""
    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model

    loaded = load_model(model, dtype)
    engine = LLMEngine(loaded, EngineConfig(block_size=16, num_blocks=512, kv_cache_dtype="auto",
                                            enable_prefix_caching=False))  # fmt: skip
    rng = random.Random(1)
    prompt = [rng.randrange(100, min(loaded.config.vocab_size, 40000)) for _ in range(prompt_len)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    best = min(_timed(lambda: engine.generate([prompt], one)) for _ in range(repeats))
    decode = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    rounds = []
    for round_ in range(3):
        engine.add_request(f"d{round_}", prompt[:32], decode)
        engine.step()  # the prompt and the first token
        start, n = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            n += 1
        rounds.append((time.perf_counter() - start) / n * 1000)
    return {"prefill_tok_s": prompt_len / best, "decode_step_ms": min(rounds)}


def _timed(run) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the checkout before the change")
    parser.add_argument("--new", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--inner", help=argparse.SUPPRESS)  # one tree's run, in a child process
    args = parser.parse_args()
    if args.inner:
        sys.path.insert(0, args.inner)
        print(json.dumps(measure(args.model, args.dtype, args.prompt, args.steps, args.repeats)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for pair in range(args.pairs):
        for name, tree in (("base", args.base), ("new", args.new)):
            command = [sys.executable, __file__, "--inner", str(Path(tree).resolve()),
                       "--base", args.base, "--model", args.model, "--dtype", args.dtype,
                       "--prompt", str(args.prompt), "--steps", str(args.steps),
                       "--repeats", str(args.repeats)]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
            out = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            logger.info("pair %d %s: %s (load average %.2f)", pair, name, results[name][-1],
                        os.getloadavg()[0])  # fmt: skip
    print(f"\n{Path(args.model).name}, --dtype {args.dtype}, {args.pairs} pairs")
    print("| figure | base best | new best | new/base (best) | base median | new median | new/base (median) |")
    print("|---|---|---|---|---|---|---|")
    for key, label in (("prefill_tok_s", f"prefill {args.prompt} tokens, tok/s"),
                       ("decode_step_ms", "batch-1 decode step, ms")):  # fmt: skip
        pick = max if key == "prefill_tok_s" else min
        base = [r[key] for r in results["base"]]
        new = [r[key] for r in results["new"]]
        b, n = pick(base), pick(new)
        bm, nm = statistics.median(base), statistics.median(new)
        print(f"| {label} | {b:.2f} | {n:.2f} | {n / b:.3f} | {bm:.2f} | {nm:.2f} | {nm / bm:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
