"""An ``fp8`` KV cache on CUDA against a bfloat16 one (issue 44): what it saves and what it costs.

    python bench/kv_cache_fp8_gpu.py [--context 4096] [--new-tokens 32] [--families ...]
                                     [--shape llama-3-8b] [--batches 1 64] [--steps 16] [--rounds 2]

Without a CUDA device it says so and exits 0. Two tables, models in bfloat16 on the GPU:

1. **Agreement** (``bench/kv_cache_q8.py``'s ``agreement``): per family, a ``--context``-token
   prompt with a bfloat16 and an ``fp8`` cache: greedy tokens equal to the bfloat16 cache's (out
   of ``--new-tokens``), and teacher-forced (the prompt and bfloat16's continuation as one
   prefill, attention reading each cache as decode does) the argmaxes that agree and the largest
   absolute logit difference. Families: a random Llama (hidden 512, 4 layers, head 64) and the
   random-weight Qwen3, Qwen3-MoE, Gemma 2, Gemma 3 and Phi-3 checkpoints of
   tests/test_model_families.py at their real head sizes (no trained checkpoint reaches a
   device machine).
2. **Speed**: ``dummy:<shape>`` (random weights of a real shape), ``--batches`` sequences, each
   holding ``--context`` tokens as a decode worker does after a hand-off (``add_prefilled``; the
   pool's values are zeros: a step's time does not depend on them), then ``--steps`` greedy
   engine steps (CUDA graphs); bfloat16 and ``fp8`` alternate over ``--rounds``, each keeps its
   best mean step. Also the KV bytes per token and the pool each batch needs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kv_cache_q8 import agreement, random_family  # noqa: E402 - the CPU script's measures
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from services.engine.core.loaders import LoadedModel, load_model  # noqa: E402

logger = logging.getLogger("bench.kv_cache_fp8_gpu")
BLOCK = 16
KV = ("bfloat16", "fp8")
FAMILIES = ("llama", "qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3")


def accuracy(context: int, new_tokens: int, families: list[str]) -> None:
    import tempfile

    from tests.tiny_stack import write_tiny_model

    print(f"\n{torch.cuda.get_device_name()}: context {context} tokens, {new_tokens} greedy tokens, "
          "bfloat16 models, fp8 KV against bfloat16 KV")  # fmt: skip
    print("| family (checkpoint) | weights | KV heads x head dim | greedy tokens equal to bfloat16 KV's "
          "| teacher-forced argmax equal | max abs logit diff | max abs logit |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    positions = context + new_tokens + 16
    for name in families:
        if name == "llama":
            folder = str(write_tiny_model(Path(tempfile.mkdtemp(prefix="kv-llama-")) / "model", 8192,
                                          context=positions, hidden=512, layers=4, heads=8))  # fmt: skip
        else:
            folder = random_family(name, positions)
        loaded = load_model(folder, "bfloat16", "cuda")
        row = agreement(f"{name} (random weights, small)", loaded, context, new_tokens,
                        base="bfloat16", quantized="fp8")  # fmt: skip
        print(row, flush=True)
        del loaded
        torch.cuda.empty_cache()


def _step_ms(loaded: LoadedModel, kv: str, batch: int, context: int, steps: int) -> tuple[float, int]:
    """Mean ms of ``steps`` decode steps of ``batch`` sequences of ``context`` tokens, and the
    engine's KV bytes per token."""
    per_seq = -(-(context + steps + 2) // BLOCK)
    engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK, num_blocks=batch * per_seq + 2,
                                            kv_cache_dtype=kv, enable_prefix_caching=False,
                                            max_model_len=context + steps + 4,
                                            max_num_seqs=max(batch, 1)))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        ids = engine.block_manager.allocate(-(-context // BLOCK))
        prompt = [(7 * j + i) % (loaded.config.vocab_size - 100) + 50 for j in range(context)]
        engine.add_prefilled(f"r{i}", prompt, params, block_ids=ids, first_token_id=prompt[-1])
    engine.step()
    engine.step()  # warm-up: the first steps build and capture
    torch.cuda.synchronize()
    start, done = time.perf_counter(), 0
    for _ in range(steps):
        engine.step()
        done += 1
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1000 / done
    per_token = engine.layout.bytes_per_token
    del engine
    torch.cuda.empty_cache()
    return ms, per_token


def speed(shape: str, batches: list[int], context: int, steps: int, rounds: int) -> None:
    loaded = load_model(f"dummy:{shape}", "bfloat16", "cuda")
    c = loaded.config
    print(f"\n{torch.cuda.get_device_name()}: dummy:{shape} bfloat16 ({c.num_layers} layers, "
          f"{c.num_kv_heads} KV heads x {c.head_dim}), context {context}, {steps} steps a round, "
          f"best of {rounds}, CUDA graphs")  # fmt: skip
    print("| batch | KV cache | bytes per token | KV of the batch | step ms, best | rounds | fp8 vs bf16 |")
    print("|---|---|---|---|---|---|---|")
    for batch in batches:
        best = dict.fromkeys(KV, float("inf"))
        seen: dict[str, list[float]] = {kv: [] for kv in KV}
        per_token: dict[str, int] = {}
        for round_ in range(rounds):
            for kv in KV if round_ % 2 == 0 else KV[::-1]:
                ms, per_token[kv] = _step_ms(loaded, kv, batch, context, steps)
                seen[kv].append(ms)
                best[kv] = min(best[kv], ms)
        for kv in KV:
            gib = per_token[kv] * batch * context / 2**30
            ratio = f"{best['bfloat16'] / best[kv]:.2f}x" if kv == "fp8" else ""
            rounds_ms = " / ".join(f"{ms:.2f}" for ms in seen[kv])
            print(f"| {batch} | {kv} | {per_token[kv]:,} | {gib:.1f} GiB | {best[kv]:.2f} | "
                  f"{rounds_ms} | {ratio} |", flush=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        logger.warning("no CUDA device: nothing to measure")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.families:
        accuracy(args.context, args.new_tokens, args.families)
    if args.batches:
        speed(args.shape, args.batches, args.context, args.steps, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
