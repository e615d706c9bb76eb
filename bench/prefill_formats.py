"""Prefill speed per weight format, the formats alternating in one process.

The engine benchmark runs each configuration once, one after another, so a few-percent gap
between two rows is within this kind of VM's drift. This script loads every format at once and
times one prompt through each in turn, several rounds, so all of them meet the same machine
state; it prints best and median tokens/s per format:

    python bench/prefill_formats.py [--length 512] [--rounds 6]
        [--formats float32 no-kernels bfloat16 q4 transformers]

``no-kernels`` is float32 on the paths ``TANDEM_CPU_KERNELS=0`` gives (as in the engine
benchmark); ``transformers`` is Hugging Face's float32 model on the same GGUF, its prompt
forward as ``generate`` runs it (the last position's logits only), the engine benchmark's
baseline. The last lines give each format's median against ``transformers`` and ``no-kernels``
(when measured). Force an instruction set with ``TANDEM_CPU_ISA`` (and ``MKL_ENABLE_INSTRUCTIONS`` /
``ONEDNN_MAX_CPU_ISA`` for PyTorch's BLAS) as for ``engine_throughput.py``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.engine_throughput import hf_prefill_forward, random_prompts  # noqa: E402
from bench.kernel_settings import native_kernels_off, without_native_kernels  # noqa: E402
from services.common.model_source import resolve_model  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from services.engine.core.loaders import load_model  # noqa: E402

NO_KERNELS = "no-kernels"
TRANSFORMERS = "transformers"
logger = logging.getLogger("bench.prefill_formats")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--formats", nargs="+",
                        default=["float32", NO_KERNELS, "bfloat16", "q4", TRANSFORMERS])  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    source = resolve_model(args.model)
    prompt = random_prompts(1, args.length)[0]
    params = SamplingParams(temperature=0, max_tokens=1)
    runs: dict[str, Callable[[], object]] = {}
    for name in args.formats:
        if name == TRANSFORMERS:
            runs[name] = hf_prefill_forward(source, prompt)
            continue
        config = EngineConfig(num_blocks=-(-args.length // 16) + 8, max_num_batched_tokens=args.length,
                              enable_prefix_caching=False)  # fmt: skip
        if name == NO_KERNELS:
            with native_kernels_off():
                engine = LLMEngine(without_native_kernels(source), config)
        else:
            engine = LLMEngine(load_model(source, name), config)
        runs[name] = functools.partial(engine.generate, [prompt], params)
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for run in runs.values():  # warm-up
            run()
        for _ in range(args.rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    lines = [f"prefill of {args.length} tokens, {args.rounds} rounds, formats alternating",
             "", "| format | best tok/s | median tok/s |", "|---|---|---|"]  # fmt: skip
    for name, taken in times.items():
        best, median = args.length / min(taken), args.length / statistics.median(taken)
        lines.append(f"| {name} | {best:.1f} | {median:.1f} |")
    medians = {name: statistics.median(taken) for name, taken in times.items()}
    for base in (TRANSFORMERS, NO_KERNELS):
        if base in medians:
            ratios = ", ".join(f"{name} {medians[base] / t:.2f}x" for name, t in medians.items()
                               if name != base)  # fmt: skip
            lines.append(f"median against {base}: {ratios}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
