"""Decode rows over int8 activations against float32 activations, kernel by kernel, on real shapes.

For each (format, out, in): the weight-only kernel (``cpu_qgemv.c``, float32 activations: what
decode rows ran before) and the int8-activation decode kernel (``tandem_a8_gemv`` in
``cpu_q4a8_gemm.c``) over the same tiles, taking turns in one process (interference hits both),
best of ``--repeats``; enough copies of each weight that a round reads ``--bytes`` of them, so the
weights come from memory as in a decode step, not from the cache.

    python bench/int8_decode_kernels.py [--rows 1 4] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from services.engine.core.kernels.cpu_q4a8_gemm import load_cpu_q4a8_gemm
from services.engine.core.kernels.cpu_qgemv import load_cpu_qgemv
from services.engine.core.quant.quantized_weight import from_gguf_blocks

# the shapes of Llama-3.2-1B (hidden 2048, MLP 8192, QKV 3072), Qwen3-1.7B (MLP 6144, QKV 4096)
# and Gemma-3-1B (hidden 1152, MLP 6912, QKV 1536) as their Q4_K_M files store them
SHAPES = [
    (T.Q4_K, 2048, 2048), (T.Q4_K, 16384, 2048), (T.Q4_K, 2048, 8192), (T.Q6_K, 2048, 8192),
    (T.Q8_0, 3072, 2048), (T.Q6_K, 49152, 2048), (T.Q4_K, 12288, 2048), (T.Q4_K, 2048, 6144),
    (T.Q5_0, 13824, 1152), (T.Q5_0, 1536, 1152), (T.Q4_K, 1152, 6912), (T.Q8_0, 49152, 1152),
    (T.Q4_0, 2048, 2048),
]  # fmt: skip


def random_blocks(ggml_type: T, out: int, n_in: int, seed: int) -> np.ndarray:
    """Random valid blocks (random bytes, float16 scales set small and finite)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n = out * n_in // block_size
    blocks = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
    offsets = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,), T.Q4_0: (0,),
               T.Q5_0: (0,), T.Q4_1: (0, 2)}[ggml_type]  # fmt: skip
    for offset in offsets:
        d = (rng.random(n) * 2e-3 - 1e-3).astype(np.float16)
        blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(n, 2)
    return blocks.reshape(out, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--bytes", type=int, default=96 << 20, help="weight bytes read per round")
    args = parser.parse_args()
    qgemv, a8 = load_cpu_qgemv(), load_cpu_q4a8_gemm()
    assert qgemv is not None and a8 is not None, "the kernels do not build here"
    print(f"isa {a8.isa}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    print("| format | out x in | rows | float32 act. (us) | int8 act. (us) | speedup | int8 GB/s |")
    print("|---|---|---|---|---|---|---|")
    for ggml_type, out, n_in in SHAPES:
        weight = from_gguf_blocks(random_blocks(ggml_type, out, n_in, 0), ggml_type, (out, n_in))
        assert weight is not None
        packed, fmt = qgemv.tile_weight(weight), qgemv.tile_format(weight)
        size = packed.numel()
        copies = [packed] + [packed.clone() for _ in range(max(0, args.bytes // size - 1))]
        floats = [qgemv.bind(p, fmt, None, out) for p in copies]
        ints = [a8.bind_decode(p, None, out, fmt) for p in copies]
        for rows in args.rows:
            x = torch.randn(rows, n_in)
            best = {"f": float("inf"), "i": float("inf")}
            with torch.inference_mode():
                for _ in range(args.repeats):
                    for key, calls in (("f", floats), ("i", ints)):
                        start = time.perf_counter()
                        for call in calls:
                            call(x)
                        best[key] = min(best[key], (time.perf_counter() - start) / len(calls))
            print(f"| {fmt} | {out}x{n_in} | {rows} | {best['f'] * 1e6:.0f} | "
                  f"{best['i'] * 1e6:.0f} | {best['f'] / best['i']:.2f}x | "
                  f"{size / best['i'] / 1e9:.1f} |", flush=True)  # fmt: skip
        del copies, floats, ints
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
