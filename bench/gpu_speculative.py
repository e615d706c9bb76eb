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
3. The verification's cost, apart from any proposer: the same request with drafts read from its
   own greedy text (an oracle: every draft accepted, the most speculation can give at this
   draft length) and with every draft one token id off (nothing accepted: what a wrong guess
   costs, the back-off included). Random weights never copy their prompt, so prompt lookup
   alone says nothing about speed there; these two runs bound it from both sides.

``--device cpu --shape tiny`` runs the same on the CPU (a check of the script, not a figure).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.engine.core.speculative import PromptLookup, SpeculativeConfig  # noqa: E402

logger = logging.getLogger("bench.gpu_speculative")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        logger.info("no CUDA device: nothing to measure")
        return 0
    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model
    from tests.tiny_stack import write_tiny_model

    spec = SpeculativeConfig()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines = [f"device: {name}", "",
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
            loaded = load_model(str(folder), dtype, device)
            plain = LLMEngine(loaded, EngineConfig(num_blocks=512)).generate(prompts, params)
            engine = LLMEngine(loaded, EngineConfig(num_blocks=512, speculative=spec))
            fast = [engine.generate([p], params)[0] for p in prompts]  # batch 1 each
            differ = sum(a.new_token_ids != b.new_token_ids for a, b in zip(plain, fast))
            lines.append(f"| random Llama 4x512 | {dtype} | {differ}/6 | "
                         f"{engine.spec_stats.acceptance_rate:.0%} |")  # fmt: skip
    loaded = load_model(f"dummy:{args.shape}", "bfloat16", device)
    prompt = [(7 * i) % 1000 + 3 for i in range(16)] * 4
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    lines += ["", f"| dummy:{args.shape} bf16, batch 1, {args.tokens} tokens | seconds | engine steps "
              "| tokens / step | accepted of drafted |", "|---|---|---|---|---|"]  # fmt: skip
    results = {}
    reference: list[int] = []
    for name, config in (("off", None), ("ngram", spec), ("oracle drafts", spec),
                         ("wrong drafts", spec), ("off, again", None)):  # fmt: skip
        engine = LLMEngine(loaded, EngineConfig(num_blocks=256, speculative=config))
        with _drafts_from(name, prompt + reference, loaded.config.vocab_size):
            engine.generate([prompt], params)  # warm-up: graphs, Triton compiles
            steps, proposed = engine.phases.steps, engine.spec_stats.num_draft_tokens
            _sync(device)
            start = time.perf_counter()
            out = engine.generate([prompt], params)[0]
            _sync(device)
        seconds = time.perf_counter() - start
        steps = engine.phases.steps - steps
        results[name] = out.new_token_ids
        if name == "off":
            reference = list(out.new_token_ids)
        lines.append(f"| {name} | {seconds:.3f} | {steps} | {len(out.new_token_ids) / steps:.2f} | "
                     f"{engine.spec_stats.acceptance_rate:.0%} of "
                     f"{engine.spec_stats.num_draft_tokens - proposed} |")  # fmt: skip
    same = all(tokens == results["off"] for tokens in results.values())
    lines.append(f"\nsame greedy tokens on every run: {same}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def _drafts_from(name: str, text: list[int], vocab: int) -> Iterator[None]:
    """For the oracle runs, prompt lookup replaced by drafts read from ``text`` (the request's
    own greedy text: all accepted), or each one token id off (none accepted)."""
    if name not in ("oracle drafts", "wrong drafts"):
        yield
        return
    shift = 0 if name == "oracle drafts" else 1

    def propose(self: PromptLookup, tokens: list[int], k: int, *_: int) -> list[int]:
        return [(t + shift) % vocab for t in text[len(tokens) : len(tokens) + k]]

    original = PromptLookup.propose
    PromptLookup.propose = propose  # type: ignore[method-assign]
    try:
        yield
    finally:
        PromptLookup.propose = original  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.exit(main())
