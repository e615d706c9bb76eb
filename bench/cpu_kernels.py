"""CPU kernel benchmark: Tandem's native kernels vs the PyTorch paths they replace, SmolLM2 shapes.

Prints two markdown tables, measured in one run.

Matmuls: for each float32 projection of SmolLM2-135M and a few row counts (1 = batch-1 decode,
8/32 = batched decode, 512 = prefill), the time, weight read rate and arithmetic rate of

  * ``F.linear``  the PyTorch reference (what transformers runs);
  * ``split bmm`` the weight split in one slice per thread and one ``bmm`` (Tandem's fallback);
  * ``kernel``    ``services/engine/core/kernels/cpu_gemv.c`` over its tiled weight.

Weights rotate through enough copies (>= 256 MiB) that every call reads them from memory, not
cache, as decode does.

Decode attention: one layer of SmolLM2 (9 query heads, 3 KV heads, head_dim 64, 16-token blocks)
over a 30-layer paged pool, for a few batch sizes and context lengths: the torch reference
(gather + ``scaled_dot_product_attention``) vs ``cpu_paged_attention.c``.

    python bench/cpu_kernels.py [--rows 1 8 32 512]
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

from services.engine.core.attention import AttentionMetadata, TorchPagedAttention  # noqa: E402
from services.engine.core.kernels.cpu_gemv import load_cpu_gemv  # noqa: E402
from services.engine.core.kernels.cpu_paged_attention import (  # noqa: E402
    cpu_paged_decode_attention,
    load_cpu_attention,
)

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


def attention_table(cases: list[tuple[int, int]]) -> list[str]:
    """Torch reference vs the C kernel for (batch, context length) cases, SmolLM2's head shape."""
    heads, kv_heads, head_dim, block, layers = 9, 3, 64, 16, 30
    lines = [
        "| batch | context | torch µs | kernel µs | kernel vs torch | max abs diff |",
        "|---|---|---|---|---|---|",
    ]
    for batch, length in cases:
        per_seq = -(-length // block)
        pool = torch.randn(batch * per_seq + 1, layers, 2, block, kv_heads, head_dim)
        k_cache, v_cache = pool[:, layers // 2, 0], pool[:, layers // 2, 1]
        tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
        meta = AttentionMetadata.build(
            is_prefill=False, query_lens=[1] * batch, context_lens=[length] * batch,
            block_tables=tables, block_size=block,
        )
        q = torch.randn(batch, heads, head_dim)
        lens = meta.decode_context_lens()
        reference = TorchPagedAttention()

        def ref(_: int) -> torch.Tensor:
            return reference.decode(q, k_cache, v_cache, meta, head_dim**-0.5)

        def ours(_: int) -> torch.Tensor:
            return cpu_paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, lens, head_dim**-0.5
            )

        torch_us, kernel_us = best_us(ref, 1, 100), best_us(ours, 1, 100)
        diff = (ref(0) - ours(0)).abs().max().item()
        lines.append(
            f"| {batch} | {length} | {torch_us:.1f} | {kernel_us:.1f} | "
            f"{torch_us / kernel_us:.2f}x | {diff:.1e} |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    kernel = load_cpu_gemv()
    if kernel is None or load_cpu_attention() is None:
        logging.getLogger("bench").error("the native kernels can't be built here (see the warning above)")
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
    lines.append("")
    lines.extend(attention_table([(1, 100), (1, 1000), (8, 300), (32, 100), (32, 500)]))
    lines.append(f"\nthreads: {threads}, torch {torch.__version__}, matmul kernel tile {kernel.tile}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
