"""CPU matmul benchmark: Tandem's native tiled kernel vs PyTorch paths, on SmolLM2's shapes.

Prints one markdown table, measured in one run: for each float32 projection of SmolLM2-135M and a
few row counts (1 = batch-1 decode, 8/32 = batched decode, 512 = prefill), the time, weight
read rate and arithmetic rate of

  * ``F.linear``  the PyTorch reference (what transformers runs);
  * ``split bmm`` the weight split in one slice per thread and one ``bmm`` (Tandem's fallback);
  * ``kernel``    ``services/engine/kernels/cpu_gemv.c`` over its tiled weight.

Weights rotate through enough copies (>= 256 MiB) that every call reads them from memory, not
cache, as decode does.

    python bench/cpu_gemv.py [--rows 1 8 32 512]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.kernels.cpu_gemv import load_cpu_gemv  # noqa: E402

SHAPES = {  # name: (out_features, in_features), SmolLM2-135M
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def best_us(fn: Callable[[int], object], copies: int, calls: int = 200) -> float:
    for i in range(20):
        fn(i % copies)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for i in range(calls):
            fn(i % copies)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    kernel = load_cpu_gemv()
    if kernel is None:
        logging.getLogger("bench").error("the native kernel can't be built here (see the warning above)")
        return 1
    threads = torch.get_num_threads()
    lines = [
        (
            "| shape (out×in) | rows | F.linear µs | split bmm µs | kernel µs "
            "| kernel weight GB/s | kernel GFLOP/s | kernel vs F.linear |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, (out_f, in_f) in SHAPES.items():
        nbytes = out_f * in_f * 4
        copies = max(2, -(-(256 << 20) // nbytes))
        weights = [torch.randn(out_f, in_f) for _ in range(copies)]
        width = -(-out_f // threads)
        splits = [
            torch.cat([w, w.new_zeros(width * threads - out_f, in_f)])
            .view(threads, width, in_f).transpose(1, 2).contiguous()
            for w in weights
        ]  # fmt: skip
        tiles = [kernel.tile_weight(w) for w in weights]
        for rows in args.rows:
            x = torch.randn(rows, in_f)
            calls = max(5, 200 // rows)
            ref = best_us(lambda i, x=x, w=weights: F.linear(x, w[i]), copies, calls)
            bmm = best_us(lambda i, x=x, s=splits: torch.matmul(x, s[i]), copies, calls)
            ours = best_us(
                lambda i, x=x, t=tiles, n=out_f: kernel(x, t[i], None, n), copies, calls
            )
            lines.append(
                f"| {name} {out_f}×{in_f} | {rows} | {ref:.1f} | {bmm:.1f} | {ours:.1f} | "
                f"{nbytes / ours / 1e3:.1f} | {2 * rows * out_f * in_f / ours / 1e3:.1f} | "
                f"{ref / ours:.2f}x |"
            )
    lines.append(f"\nthreads: {threads}, torch {torch.__version__}, kernel tile {kernel.tile}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
