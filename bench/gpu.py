"""GPU benchmark: Tandem's CUDA path against the device's own ceilings, measured in the same run.

    python bench/gpu.py [--shape llama-3-8b] [--quick]

Without a CUDA device it says so and exits 0. Prints, for the device it runs on:

1. **Ceilings**: device-to-device copy bandwidth (bytes read + written over time, a 4 GiB copy)
   and the bfloat16 matrix-product rate (8192³ through PyTorch), each the median of many runs.
2. **Decode step** of a dummy model of a real shape (random weights, default Llama-3-8B) in
   bfloat16 at batch 1 and 64: the engine's whole step (CUDA-graph replay, LM head, sampling)
   and the same step eager, next to the HBM roofline: the bytes a step must read (every matrix
   but the embedding table, plus the batch's KV) over the measured copy bandwidth. Also the
   matrices alone (each layer's four products and the head, captured in one graph): what
   cuBLAS makes of the weight stream.
3. **Triton decode attention** on long contexts: K/V bytes read over time, next to the copy
   bandwidth, and PyTorch's SDPA over gathered blocks on the same inputs.
4. **Prefill** of one prompt (4,096 tokens): tokens/s and achieved TFLOP/s (2 × parameters ×
   tokens + attention) next to the measured bf16 matrix rate.

5. ``--profile``: where one batch-1 decode step's device time goes, kernel by kernel (PyTorch's
   profiler over ten graph replays), for a family whose step is far over its roofline.
The KV hand-off between workers (CUDA IPC and gRPC) is ``bench/kv_handoff_gpu.py``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import torch

logger = logging.getLogger("bench.gpu")


def median_ms(fn: Callable[[], object], *, warmup: int = 5, repeat: int = 30) -> float:
    """Median wall time of ``fn`` in ms, timed with CUDA events after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _copy_gbs(numel: int) -> float:
    src = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), repeat=20)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def ceilings() -> tuple[float, float]:
    """(copy GB/s counting read + write, bf16 matmul TFLOP/s)."""
    copy = _copy_gbs(1 << 31)  # 4 GiB of bf16
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, warmup=10, repeat=50)
    return copy, 2 * 8192**3 / ms / 1e9


def decode_steps(shape: str, batches: list[int], copy_gbs: float, context: int) -> list[str]:
    """Rows of the decode table (engine steps, graph and eager; matrices alone)."""
    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model

    loaded = load_model(f"dummy:{shape}", "bfloat16", "cuda")
    cfg = loaded.config
    model = loaded.model
    matrix_bytes = sum(lin.weight.numel() * lin.weight.element_size() for lin in _linears(model))
    kv_token_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    rows = []
    for graphs in (True, False):
        engine = LLMEngine(loaded, EngineConfig(num_blocks=max(batches) * (context // 16 + 8),
                                                max_num_seqs=max(batches),
                                                max_num_batched_tokens=8192,
                                                cuda_graphs=graphs))  # fmt: skip
        for batch in batches:
            params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
            for i in range(batch):
                engine.add_request(f"b{batch}-{i}", [1 + (i * 13 + j) % 1000 for j in range(context)],
                                   params)  # fmt: skip
            while engine.scheduler.waiting or any(s.num_computed_tokens < context
                                                  for s in engine.scheduler.running):  # fmt: skip
                engine.step()
            for _ in range(5):
                engine.step()
            times = []
            for _ in range(40):
                torch.cuda.synchronize()
                started = time.perf_counter()
                engine.step()  # sampling reads the tokens back: the step has finished
                times.append((time.perf_counter() - started) * 1e3)
            step = statistics.median(times)
            floor = (matrix_bytes + batch * (context + 25) * kv_token_bytes) / copy_gbs / 1e6
            rows.append(f"| decode step, batch {batch}, {'CUDA graphs' if graphs else 'eager'} | "
                        f"{step:.2f} ms | {floor:.2f} ms | {step / floor:.2f}x |")
            for i in range(batch):
                engine.abort(f"b{batch}-{i}")
            engine.step()
        del engine
        torch.cuda.empty_cache()
    rows.append(matrices_alone(model, matrix_bytes, copy_gbs))
    del loaded, model
    torch.cuda.empty_cache()
    return rows


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """Every matrix a decode step reads: each layer's four products and the LM head (the
    embedding table gives one row per token)."""
    linears = []
    for layer in model.layers:  # type: ignore[attr-defined]
        attn, mlp = layer.self_attn, layer.mlp
        linears += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return linears + [model.lm_head]  # type: ignore[attr-defined]


def matrices_alone(model: torch.nn.Module, matrix_bytes: int, copy_gbs: float) -> str:
    """One batch-1 step's matrix products only (every layer's four and the head) in a graph."""
    linears = _linears(model)
    inputs = [torch.randn(1, lin.in_features, device="cuda", dtype=lin.weight.dtype)
              for lin in linears]  # fmt: skip

    def run() -> None:
        for lin, x in zip(linears, inputs):
            torch.nn.functional.linear(x, lin.weight)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ms = median_ms(graph.replay, repeat=50)
    floor = matrix_bytes / copy_gbs / 1e6
    return f"| matrices alone (cuBLAS), batch 1, one graph | {ms:.2f} ms | {floor:.2f} ms | {ms / floor:.2f}x |"


def attention_rows(copy_gbs: float, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Triton decode attention on long contexts vs the copy bandwidth and the torch reference."""
    from services.engine.core.attention import AttentionMetadata, TorchPagedAttention
    from services.engine.core.kernels.paged_decode_attention import paged_decode_attention

    heads, kv_heads, dim, bs = 32, 8, 128, 16
    rows = []
    for batch, context in ((1, 32768), (8, 8192), (32, 4096), (64, 4096), (64, 8192)):
        blocks = batch * context // bs
        pool = torch.randn(blocks + 1, 2, bs, kv_heads, dim, device="cuda", dtype=dtype)
        kc, vc = pool[:, 0], pool[:, 1]
        order = (torch.randperm(blocks, device="cuda") + 1).view(batch, -1)
        lens = torch.full((batch,), context, device="cuda")
        q = torch.randn(batch, heads, dim, device="cuda", dtype=dtype)
        tables32 = order.to(torch.int32)
        lens32 = lens.to(torch.int32)
        ms = median_ms(lambda: paged_decode_attention(q, kc, vc, tables32, lens32, dim**-0.5),
                       repeat=50)  # fmt: skip
        nbytes = batch * context * kv_heads * dim * 2 * pool.element_size()
        torch_ms = float("nan")
        if batch * context <= 64 * 4096:
            meta = AttentionMetadata.build(is_prefill=False, query_lens=[1] * batch,
                                           context_lens=[context] * batch,
                                           block_tables=order.tolist(), block_size=bs,
                                           device="cuda")  # fmt: skip
            ref = TorchPagedAttention()
            torch_ms = median_ms(lambda: ref.decode(q, kc, vc, meta, dim**-0.5), repeat=10)
        gbs = nbytes / ms / 1e6
        rows.append(f"| batch {batch} × {context} tokens | {ms * 1e3:.0f} µs | {gbs:.0f} GB/s | "
                    f"{gbs / copy_gbs:.0%} | {torch_ms * 1e3:.0f} µs |")
    return rows


def prefill_row(shape: str, gemm_tflops: float, tokens: int = 4096) -> str:
    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model

    loaded = load_model(f"dummy:{shape}", "bfloat16", "cuda")
    cfg = loaded.config
    engine = LLMEngine(loaded, EngineConfig(num_blocks=tokens // 16 + 64, max_num_seqs=4,
                                            max_num_batched_tokens=tokens))  # fmt: skip
    params = SamplingParams(max_tokens=1, temperature=0.0)
    times = []
    for i in range(4):
        prompt = [1 + (i * 7 + j) % 30000 for j in range(tokens)]  # no prefix-cache hits
        engine.add_request(f"p{i}", prompt, params)
        torch.cuda.synchronize()
        started = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times[1:])
    matrices = sum(p.numel() for name, p in loaded.model.named_parameters()
                   if "embed_tokens" not in name)  # fmt: skip
    attention = 2 * cfg.num_layers * tokens * tokens * cfg.num_heads * cfg.head_dim  # causal half
    flops = 2 * matrices * tokens + attention
    achieved = flops / seconds / 1e12
    return (f"| prefill {tokens} tokens | {seconds * 1e3:.0f} ms | {tokens / seconds:,.0f} tok/s | "
            f"{achieved:.0f} TFLOP/s | {achieved / gemm_tflops:.0%} of {gemm_tflops:.0f} |")


def profile_step(shape: str, context: int, steps: int = 10, top: int = 18) -> str:
    """The kernels of ``steps`` batch-1 decode steps (CUDA graphs), by total device time."""
    from torch.profiler import ProfilerActivity, profile

    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model

    loaded = load_model(f"dummy:{shape}", "bfloat16", "cuda")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=context // 16 + 8, max_num_seqs=1,
                                            cuda_graphs=True))  # fmt: skip
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    engine.add_request("p", [1 + j % 1000 for j in range(context)], params)
    for _ in range(-(-context // 2048) + 5):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60)
    engine.abort("p")
    del engine, loaded
    torch.cuda.empty_cache()
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3-8b", help="dummy model shape")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per decode row")
    parser.add_argument("--quick", action="store_true", help="skip the prefill row")
    parser.add_argument("--profile", action="store_true",
                        help="only the kernels of ten batch-1 decode steps, by device time")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here; nothing to measure")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.profile:
        print(f"{args.shape}, batch 1, {args.context}-token context, ten steps:")
        print(profile_step(args.shape, args.context))
        return 0
    name = torch.cuda.get_device_name()
    copy_gbs, gemm_tflops = ceilings()
    print(f"device: {name}; torch {torch.__version__}")
    print(f"ceilings: copy {copy_gbs:,.0f} GB/s (read + write), bf16 matmul {gemm_tflops:,.0f} TFLOP/s")
    print(f"\n| {args.shape} bf16, {args.context}-token contexts | measured | HBM roofline | ratio |")
    print("|---|---|---|---|")
    for row in decode_steps(args.shape, [1, 64], copy_gbs, args.context):
        print(row, flush=True)
    print("\n| Triton decode attention (32 heads, 8 KV heads, dim 128, bf16) | time | K/V read | "
          "of copy bandwidth | torch SDPA |")
    print("|---|---|---|---|---|")
    for row in attention_rows(copy_gbs):
        print(row, flush=True)
    if not args.quick:
        print("\n| prefill | time | tokens/s | achieved | of bf16 matmul |")
        print("|---|---|---|---|---|")
        print(prefill_row(args.shape, gemm_tflops), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
