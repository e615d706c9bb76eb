"""Speculative decoding on the GPU: prompt lookup with ``--device cuda`` (drafts verified as
decode rows, replayed from CUDA graphs), greedy output against no speculation, and batch-1 time.

    python bench/gpu_speculative.py [--shape llama-3-8b] [--tokens 128]

Without a CUDA device it says so and exits 0. Two parts:

1. Exactness: a random 4-layer Llama (weights made on the CPU) in float32 and bfloat16, six
   repetitive prompts, greedy with and without ``--speculative ngram``: prompts whose tokens
   differ, and the acceptance rate.
2. Speed: ``dummy:<shape>`` in bfloat16 at batch 1, one repetitive prompt (a random model's
   greedy text repeats, so lookup is accepted often, as on a copy-heavy workload), ``--tokens``
   greedy tokens: seconds and tokens per engine step with and without speculation.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

logger = logging.getLogger("bench.gpu_speculative")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.info("no CUDA device: nothing to measure")
        return 0
    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model
    from services.engine.core.speculative import SpeculativeConfig
    from tests.tiny_stack import write_tiny_model

    spec = SpeculativeConfig()
    lines = [f"device: {torch.cuda.get_device_name()}", "",
             "| model | dtype | prompts with other tokens | acceptance |", "|---|---|---|---|"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_model(Path(tmp) / "m", 8192, context=2048, hidden=512, layers=4, heads=8)
        rng = random.Random(0)
        prompts = []
        for _ in range(6):
            phrase = [rng.randrange(3, 8000) for _ in range(6)]
            prompts.append(phrase * 4 + phrase[:3])
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        for dtype in ("float32", "bfloat16"):
            loaded = load_model(str(folder), dtype, "cuda")
            plain = LLMEngine(loaded, EngineConfig(num_blocks=512)).generate(prompts, params)
            engine = LLMEngine(loaded, EngineConfig(num_blocks=512, speculative=spec))
            fast = [engine.generate([p], params)[0] for p in prompts]  # batch 1 each
            differ = sum(a.new_token_ids != b.new_token_ids for a, b in zip(plain, fast))
            lines.append(f"| random Llama 4x512 | {dtype} | {differ}/6 | "
                         f"{engine.spec_stats.acceptance_rate:.0%} |")  # fmt: skip
    loaded = load_model(f"dummy:{args.shape}", "bfloat16", "cuda")
    prompt = [(7 * i) % 1000 + 3 for i in range(16)] * 4
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    lines += ["", f"| dummy:{args.shape} bf16, batch 1, {args.tokens} tokens | seconds | engine steps "
              "| tokens / step | acceptance |", "|---|---|---|---|---|"]  # fmt: skip
    results = {}
    for name, config in (("off", None), ("ngram", spec)):
        engine = LLMEngine(loaded, EngineConfig(num_blocks=256, speculative=config))
        engine.generate([prompt], params)  # warm-up: graphs, Triton compiles
        steps = engine.phases.steps
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate([prompt], params)[0]
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        steps = engine.phases.steps - steps
        results[name] = out.new_token_ids
        lines.append(f"| {name} | {seconds:.3f} | {steps} | {len(out.new_token_ids) / steps:.2f} | "
                     f"{engine.spec_stats.acceptance_rate:.0%} |")  # fmt: skip
    lines.append(f"\nsame greedy tokens with and without: {results['off'] == results['ngram']}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
