"""Tensor parallelism (issue 48): prefill and decode tokens per second of one model at width 1
and at width N (default 2), on this machine.

Width 1 runs in this process twice: on every core the process may use (what a split competes with), then on the first run of cores :func:`rank_cores` gives rank 0 at width
N, so both widths' rank 0 see the same core(s); width N starts a real group (rank 0 here, its
followers spawned and pinned to the other runs, Gloo on CPU or NCCL with ``--device cuda``). Each
width: one prefill of ``--batch`` prompts of ``--prompt`` tokens, then ``--decode`` greedy steps
of the batch, timed by wall clock (best of ``--repeats``).

On a machine of 2 cores, width 2 is expected to be *slower* than width 1 for small models: every
layer adds two all-reduces over loopback TCP and each step pickles its plan to the follower, while
the matmul work saved per rank is small; it pays where weights streaming dominates (large models,
separate NUMA nodes or GPUs).

    python bench/tensor_parallel.py --model dummy:smollm2-135m --decode 32
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from services.engine.core.loaders import LoadedModel, load_model  # noqa: E402
from services.engine.core.tp_follower import (  # noqa: E402
    ShardSource,
    pin,
    rank_cores,
    start_tensor_parallel,
)

logger = logging.getLogger("bench.tensor_parallel")


def measure(loaded: LoadedModel, args: argparse.Namespace) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s), best of ``args.repeats``."""
    prompts = [[(7 * i + 13 * b) % (loaded.config.vocab_size - 3) + 3 for i in range(args.prompt)]
               for b in range(args.batch)]  # fmt: skip
    best_prefill = best_decode = 0.0
    for _ in range(args.repeats):
        engine = LLMEngine(loaded, EngineConfig(block_size=16, num_blocks=args.blocks,
                                                max_num_batched_tokens=args.batch * args.prompt,
                                                enable_prefix_caching=False))  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=args.decode + 1, ignore_eos=True)
        for b, prompt in enumerate(prompts):
            engine.add_request(f"r{b}", prompt, params)
        start = time.perf_counter()
        engine.step()  # the whole batch's prefill (and its first tokens)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        decode_s = time.perf_counter() - start
        best_prefill = max(best_prefill, args.batch * args.prompt / prefill_s)
        best_decode = max(best_decode, args.batch * steps / decode_s if steps else 0.0)
    return best_prefill, best_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    runs = rank_cores(args.width)
    all_cores = sorted(os.sched_getaffinity(0))
    rows: list[tuple[str, float, float]] = []
    single = load_model(args.model, args.dtype, args.device)
    torch.set_num_threads(len(all_cores))  # width 1 with the whole machine: what TP competes with
    rows.append((f"1 ({len(all_cores)} cores)", *measure(single, args)))
    pin(runs[0])  # width 1 on rank 0's share alone: what each rank works with
    rows.append((f"1 ({len(runs[0])} core{'s' if len(runs[0]) > 1 else ''})", *measure(single, args)))
    del single
    loaded = start_tensor_parallel(ShardSource(args.model, args.dtype, args.device), args.width)
    try:
        rows.append((f"{args.width} ({sum(len(r) for r in runs)} cores)", *measure(loaded, args)))
    finally:
        assert loaded.sharding is not None
        loaded.sharding.group.close()
    print(f"{args.model} {args.dtype} on {args.device}, batch {args.batch}, prompt {args.prompt}, "
          f"{args.decode} decode steps; rank 0 on cores {runs[0]}")
    print(f"{'width':>12} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for width, prefill, decode in rows:
        print(f"{width:>12} {prefill:>14.1f} {decode:>13.1f}")
    for base in rows[:2]:
        print(f"width {args.width} / width {base[0]}: prefill {rows[-1][1] / base[1]:.2f}x, "
              f"decode {rows[-1][2] / base[2]:.2f}x")


if __name__ == "__main__":
    main()
