"""The int8-activation decode kernel (``tandem_a8_gemv``) built with different ``-D`` settings,
over one decode step's weights of the default model (SmolLM2-135M: 30 layers of Q4_1 and a Q8_0
head, random blocks), a few rows at a time: how a verify step's extra rows cost.

Each variant is compiled here from ``cpu_q4a8_gemm.c`` with its own defines, then all take turns
in one process; every variant's outputs are checked bit-equal to the first's. One thread, timed by
the thread's CPU time (best of ``--repeats``), so another process on the machine moves the
figures less than wall time would.

    python bench/a8_row_blocks.py groups=-DA8_REGISTER_MAX_ROWS=1 registers= \\
        "panel=-DA8_PANEL_MIN_ROWS=2"
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.int8_decode_kernels import random_blocks  # noqa: E402
from services.engine.core.kernels.cpu_q4a8_gemm import SOURCE, CpuQ4A8Gemm  # noqa: E402
from services.engine.core.kernels.cpu_qgemv import load_cpu_qgemv  # noqa: E402
from services.engine.core.kernels.native_build import (  # noqa: E402
    CFLAGS, find_compiler, isa_flags, selected_isa)
from services.engine.core.quant.quantized_weight import from_gguf_blocks  # noqa: E402

LAYER = [(T.Q4_1, 1536, 576), (T.Q4_1, 1536, 576), (T.Q4_1, 576, 1536), (T.Q4_1, 576, 576),
         (T.Q4_1, 576, 576), (T.Q4_1, 192, 576), (T.Q4_1, 192, 576)]  # fmt: skip
HEAD = (T.Q8_0, 49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="NAME=DEFINES (space-separated -D flags)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 9])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="a8-"))
    kernels: dict[str, CpuQ4A8Gemm] = {}
    for spec in args.variants:
        name, _, defines = spec.partition("=")
        library = folder / f"{name}.so"
        subprocess.run([find_compiler(), *CFLAGS, *isa_flags(selected_isa()), *defines.split(), "-shared",
                        "-o", str(library), str(SOURCE), "-lm"], check=True)  # fmt: skip
        kernels[name] = CpuQ4A8Gemm(ctypes.CDLL(str(library)))
    qgemv = load_cpu_qgemv()
    assert qgemv is not None, "the kernels do not build here"
    weights = []
    for seed, (ggml_type, out, n_in) in enumerate(LAYER * 30 + [HEAD]):
        weight = from_gguf_blocks(random_blocks(ggml_type, out, n_in, seed), ggml_type, (out, n_in))
        assert weight is not None
        weights.append((qgemv.tile_weight(weight), qgemv.tile_format(weight), out, n_in))
    calls = {name: [k.bind_decode(p, None, out, fmt) for p, fmt, out, _ in weights]
             for name, k in kernels.items()}  # fmt: skip
    print(f"isa {selected_isa()}, 1 thread, load {os.getloadavg()[0]:.2f}")
    print("| rows | " + " | ".join(f"{name} (ms)" for name in kernels) + " |")
    print("|---" * (len(kernels) + 1) + "|")
    for rows in args.rows:
        x = {n: torch.randn(rows, n) for n in (576, 1536)}
        best = dict.fromkeys(kernels, float("inf"))
        with torch.inference_mode():
            for _ in range(args.repeats):
                first = None
                for name, step in calls.items():
                    start = time.thread_time()
                    ys = [call(x[w[3]]) for call, w in zip(step, weights, strict=True)]
                    best[name] = min(best[name], time.thread_time() - start)
                    if first is None:
                        first = ys
                    assert all(torch.equal(a, b) for a, b in zip(first, ys, strict=True)), name
        print(f"| {rows} | " + " | ".join(f"{best[n] * 1e3:.1f}" for n in kernels) + " |", flush=True)
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
