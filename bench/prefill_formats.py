"""Prefill speed per weight format, the formats alternating in one process.

The engine benchmark runs each configuration once, one after another, so a few-percent gap
between two rows is within this kind of VM's drift. This script loads every format at once and
times one prompt through each in turn, several rounds, so all of them meet the same machine
state; it prints best and median tokens/s per format:

    python bench/prefill_formats.py [--length 512] [--rounds 6]
        [--formats float32 no-kernels bfloat16 q4]

``no-kernels`` is float32 on the paths ``TANDEM_CPU_KERNELS=0`` gives (as in the engine
benchmark). Force an instruction set with ``TANDEM_CPU_ISA`` (and ``MKL_ENABLE_INSTRUCTIONS`` /
``ONEDNN_MAX_CPU_ISA`` for PyTorch's BLAS) as for ``engine_throughput.py``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.engine_throughput import _without_native_kernels, random_prompts  # noqa: E402
from services.common.model_source import resolve_model  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from services.engine.core.loaders import load_model  # noqa: E402

NO_KERNELS = "no-kernels"
logger = logging.getLogger("bench.prefill_formats")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--formats", nargs="+", default=["float32", NO_KERNELS, "bfloat16", "q4"])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    source = resolve_model(args.model)
    engines: dict[str, LLMEngine] = {}
    for name in args.formats:
        loaded = _without_native_kernels(source) if name == NO_KERNELS else load_model(source, name)
        config = EngineConfig(num_blocks=2048, max_num_batched_tokens=args.length,
                              enable_prefix_caching=False)  # fmt: skip
        engines[name] = LLMEngine(loaded, config)
    prompt = random_prompts(1, args.length)[0]
    params = SamplingParams(temperature=0, max_tokens=1)
    times: dict[str, list[float]] = {name: [] for name in engines}
    with torch.inference_mode():
        for engine in engines.values():  # warm-up
            engine.generate([prompt], params)
        for _ in range(args.rounds):
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.generate([prompt], params)
                times[name].append(time.perf_counter() - start)
    lines = [f"prefill of {args.length} tokens, {args.rounds} rounds, formats alternating",
             "", "| format | best tok/s | median tok/s |", "|---|---|---|"]  # fmt: skip
    for name, taken in times.items():
        best, median = args.length / min(taken), args.length / statistics.median(taken)
        lines.append(f"| {name} | {best:.1f} | {median:.1f} |")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
