"""Decode attention over a float32, bfloat16 and float16 KV cache, the dtypes alternating in one
process: the CPU kernel's time per decode step (one layer) and the bytes it reads.

    python bench/kv_cache_dtype.py [--shapes 9,3,64 32,8,64 16,8,128] [--batches 1 8]
        [--contexts 1024 4096] [--rounds 7] [--threads N]
    python bench/kv_cache_dtype.py --accuracy [--model default] [--dtype float32]

A shape is ``heads,kv_heads,head_dim`` (SmolLM2-135M, Llama-3.2-1B, Qwen3-1.7B by default);
every sequence of a batch is ``context`` tokens long, in blocks of 16 scattered over the pool
as a serving engine's are. Each row prints the best time per dtype and the 16-bit caches' speed
against float32's (above 1: faster). Force an instruction set with ``TANDEM_CPU_ISA``.

``--accuracy`` measures what a 16-bit cache costs a model instead (the default model's weights as
``--dtype``, the 8 chats of tests/test_quantized_model.py, 64 greedy tokens each): greedy
tokens equal to a float32 cache's at the same position, and, teacher-forced on the float32
cache's tokens (the chat and its continuation as one prefill, whose attention reads the rounded
cache as decode does), the largest logit difference and how many argmaxes agree.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.engine.core.attention import AttentionMetadata  # noqa: E402
from services.engine.core.kernels.cpu_paged_attention import (  # noqa: E402
    cpu_paged_decode_attention,
    load_cpu_attention,
)
from services.engine.core.kernels.native_build import selected_isa  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 16


def bench_case(heads: int, kv_heads: int, dim: int, batch: int, context: int, rounds: int) -> dict:
    """Best seconds per dtype for one decode step's attention (one layer) at this shape."""
    per_seq = -(-context // BLOCK)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(per_seq * batch, generator=gen) + 1  # scattered blocks
    tables = order.view(batch, per_seq).tolist()
    meta = AttentionMetadata.build(is_prefill=False, query_lens=[1] * batch,
                                   context_lens=[context] * batch, block_tables=tables,
                                   block_size=BLOCK)  # fmt: skip
    base = torch.randn(per_seq * batch + 1, 2, BLOCK, kv_heads, dim, generator=gen)
    pools = {dtype: base.to(dtype) for dtype in DTYPES}
    q = torch.randn(batch, heads, dim, generator=gen)
    lens = meta.decode_context_lens()
    best = dict.fromkeys(DTYPES, float("inf"))
    for dtype in DTYPES:  # warm-up
        cpu_paged_decode_attention(q, pools[dtype][:, 0], pools[dtype][:, 1], meta.block_tables,
                                   lens, dim**-0.5)  # fmt: skip
    reps = max(1, int(2e8 // (batch * context * kv_heads * dim * 8)))  # ~0.2 GB read per timing
    for _ in range(rounds):
        for dtype in DTYPES:
            pool = pools[dtype]
            start = time.perf_counter()
            for _ in range(reps):
                cpu_paged_decode_attention(q, pool[:, 0], pool[:, 1], meta.block_tables, lens,
                                           dim**-0.5)  # fmt: skip
            best[dtype] = min(best[dtype], (time.perf_counter() - start) / reps)
    return best


def accuracy(model: str, dtype: str) -> None:
    """Greedy and teacher-forced agreement of 16-bit caches with a float32 one (see above)."""
    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.kv_cache import KVLayout, KVPool
    from services.engine.core.loaders import load_model
    from tests.test_quantized_model import CHATS, NEW_TOKENS, agreement

    loaded = load_model(model, dtype)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = {}
    for kv in ("float32", "bfloat16", "float16"):
        engine = LLMEngine(loaded, EngineConfig(num_blocks=256, kv_cache_dtype=kv))
        tokens[kv] = [out.new_token_ids for out in engine.generate(CHATS, greedy)]
    c = loaded.config

    @torch.inference_mode()
    def logits(ids: list[int], kv: str) -> torch.Tensor:
        blocks = -(-len(ids) // BLOCK)
        pool = KVPool(blocks + 1, KVLayout(c.num_layers, BLOCK, c.num_kv_heads, c.head_dim, kv))
        meta = AttentionMetadata.build(is_prefill=True, query_lens=[len(ids)], context_lens=[len(ids)],
                                       block_tables=[list(range(1, blocks + 1))], block_size=BLOCK)  # fmt: skip
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)), pool, meta))

    total = len(CHATS) * NEW_TOKENS
    print(f"{model} weights as {dtype}, {len(CHATS)} chats x {NEW_TOKENS} greedy tokens")
    for kv in ("bfloat16", "float16"):
        same, prefixes = agreement(tokens[kv], tokens["float32"])
        worst, argmax = 0.0, 0
        for chat, continuation in zip(CHATS, tokens["float32"], strict=True):
            ids = chat + continuation[:-1]
            ref, got = logits(ids, "float32")[len(chat) - 1 :], logits(ids, kv)[len(chat) - 1 :]
            worst = max(worst, (got - ref).abs().max().item())
            argmax += int((got.argmax(-1) == ref.argmax(-1)).sum())
        print(f"{kv:>9}: greedy {same} / {total} equal (common prefixes {prefixes}); "
              f"teacher-forced argmax {argmax} / {total}, logits max abs diff {worst:.3g}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["9,3,64", "32,8,64", "16,8,128"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="default: PyTorch's")
    parser.add_argument("--accuracy", action="store_true", help="a model's tokens, not speed")
    parser.add_argument("--model", default="default", help="--accuracy: the model")
    parser.add_argument("--dtype", default="float32", help="--accuracy: its weights' dtype")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.accuracy:
        accuracy(args.model, args.dtype)
        return
    if load_cpu_attention() is None:
        sys.exit("the CPU attention kernel can't be built here")
    print(f"ISA {selected_isa()}, {torch.get_num_threads()} threads; time per step and layer")
    print(f"{'H,KVH,D':>10} {'batch':>5} {'context':>7} {'float32':>10} {'bfloat16':>10} "
          f"{'float16':>10} {'bf16 x':>7} {'f16 x':>7} {'f32 GB/s':>8}")  # fmt: skip
    for shape in args.shapes:
        heads, kv_heads, dim = (int(x) for x in shape.split(","))
        for batch in args.batches:
            for context in args.contexts:
                best = bench_case(heads, kv_heads, dim, batch, context, args.rounds)
                f32, bf16, f16 = (best[d] for d in DTYPES)
                gbs = batch * context * kv_heads * dim * 2 * 4 / f32 / 1e9
                print(f"{shape:>10} {batch:>5} {context:>7} {f32 * 1e6:>8.0f}us {bf16 * 1e6:>8.0f}us "
                      f"{f16 * 1e6:>8.0f}us {f32 / bf16:>6.2f}x {f32 / f16:>6.2f}x {gbs:>8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
