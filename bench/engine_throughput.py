"""Engine throughput benchmark: Tandem's paged engine vs Hugging Face transformers, same weights.

Prints one markdown table, measured in one run on this machine:
  * decode tokens/s (aggregate over the batch) at batch 1, 8 and 32;
  * prefill tokens/s for a 512-token prompt;
for Tandem float32, Tandem float32 without its native CPU kernels (PyTorch matmuls and
attention only, as with ``TANDEM_CPU_KERNELS=0``), Tandem bfloat16 and transformers float32
(same GGUF, dequantized), next to the memory-bandwidth bound for batch-1 decode (bytes of
weights read per token / measured read bandwidth).

    python bench/engine_throughput.py [--model default] [--decode-tokens 64] [--batches 1 8 32]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.model_source import ModelSource, resolve_model  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from services.engine.kernels.cpu_gemv import load_cpu_gemv  # noqa: E402
from services.engine.loaders import LoadedModel, load_model  # noqa: E402

logger = logging.getLogger("bench")


def memory_bandwidth_gbs() -> tuple[float, float]:
    """(read, copy) bandwidth in GB/s over a 512 MiB tensor, best of 5.

    Read (a streaming ``sum``) is the bound for decode, which only reads weights; copy counts the
    bytes read plus the bytes written.
    """
    src = torch.empty(128 * 1024 * 1024, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    read = nbytes / _best(src.sum, repeats=5)
    copy = 2 * nbytes / _best(lambda: dst.copy_(src), repeats=5)
    return read / 1e9, copy / 1e9


def _prompts(batch: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(100, 40000, (batch, length), generator=gen).tolist()


def tandem_decode(loaded: LoadedModel, batch: int, new_tokens: int) -> float:
    """Aggregate decode tokens/s: time of the steps after every sequence has its first token."""
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=max(batch, 1), num_blocks=2048))
    params = SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True)
    for attempt in range(2):  # the first round warms up allocators and caches
        for i, prompt in enumerate(_prompts(batch, 32)):
            engine.add_request(f"{attempt}-{i}", prompt, params)
        first = 0
        while first < batch:
            first += sum(1 for out in engine.step() if out.new_token_ids)
        start = time.perf_counter()
        produced = 0
        while engine.has_unfinished():
            produced += sum(len(out.new_token_ids) for out in engine.step())
        elapsed = time.perf_counter() - start
    return produced / elapsed


def tandem_prefill(loaded: LoadedModel, length: int) -> float:
    engine = LLMEngine(loaded, EngineConfig(num_blocks=2048, max_num_batched_tokens=length,
                                            enable_prefix_caching=False))
    params = SamplingParams(temperature=0, max_tokens=1)
    prompt = _prompts(1, length)[0]
    return length / _best(lambda: engine.generate([prompt], params), repeats=3)


def hf_decode(model: torch.nn.Module, batch: int, new_tokens: int) -> float:
    prompts = torch.tensor(_prompts(batch, 32))
    mask = torch.ones_like(prompts)

    def run(n: int) -> None:
        model.generate(prompts, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)

    run(2)
    full = _best(lambda: run(new_tokens + 1), repeats=2)
    first = _best(lambda: run(1), repeats=2)
    return batch * new_tokens / (full - first)


def hf_prefill(model: torch.nn.Module, length: int) -> float:
    ids = torch.tensor(_prompts(1, length))
    return length / _best(lambda: model(ids), repeats=3)


def _without_native_kernels(source: ModelSource) -> LoadedModel:
    """The float32 model on the paths ``TANDEM_CPU_KERNELS=0`` gives: torch attention, and weights
    packed for the split ``bmm``."""
    loaded = load_model(source, torch.float32, attention="torch")
    os.environ["TANDEM_CPU_KERNELS"] = "0"
    load_cpu_gemv.cache_clear()
    try:
        LLMEngine(loaded, EngineConfig(num_blocks=8))  # packs the weights with the plan of now
    finally:
        del os.environ["TANDEM_CPU_KERNELS"]
        load_cpu_gemv.cache_clear()
    return loaded


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prefill-length", type=int, default=512)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(os.cpu_count() or 1)
    source = resolve_model(args.model)

    rows: dict[str, dict[str, float]] = {}
    f32 = load_model(source, torch.float32)
    weight_bytes = sum(p.numel() * p.element_size() for p in f32.model.parameters())
    variants: list[tuple[str, Callable[[], LoadedModel]]] = [
        ("Tandem float32", lambda: f32),
        ("Tandem float32, no native kernels", lambda: _without_native_kernels(source)),
        ("Tandem bfloat16", lambda: load_model(source, torch.bfloat16)),
    ]
    for name, make in variants:
        loaded = make()
        rows[name] = {f"decode b={b}": tandem_decode(loaded, b, args.decode_tokens) for b in args.batches}
        rows[name]["prefill"] = tandem_prefill(loaded, args.prefill_length)
        print(f"measured {name}", file=sys.stderr, flush=True)
        del loaded
    if not args.skip_transformers and source.kind == "gguf":
        from transformers import AutoModelForCausalLM

        path = Path(source.path)
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        rows["transformers float32"] = {f"decode b={b}": hf_decode(hf, b, args.decode_tokens) for b in args.batches}
        rows["transformers float32"]["prefill"] = hf_prefill(hf, args.prefill_length)
    read_bw, copy_bw = memory_bandwidth_gbs()

    columns = [f"decode b={b}" for b in args.batches] + ["prefill"]
    header = "| engine | " + " | ".join(
        [f"decode tok/s b={b}" for b in args.batches] + [f"prefill tok/s ({args.prefill_length})"]
    ) + " |"
    lines = [header, "|" + "---|" * (len(columns) + 1)]
    for name, values in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{values[c]:.1f}" for c in columns) + " |")
    base = rows.get("transformers float32")
    if base:
        ours = rows["Tandem float32"]
        lines.append("| speed-up f32 vs transformers | " + " | ".join(
            f"{ours[c] / base[c]:.2f}x" for c in columns) + " |")
        b1 = base.get("decode b=1")
        if b1 and "decode b=32" in ours:
            lines.append(f"\nTandem f32 batch-32 aggregate / transformers batch-1: {ours['decode b=32'] / b1:.1f}x")
    lines.append(
        f"\nMemory bandwidth: read {read_bw:.1f} GB/s, copy {copy_bw:.1f} GB/s; float32 weights "
        f"{weight_bytes / 1e6:.0f} MB → batch-1 decode bound ≈ {read_bw * 1e9 / weight_bytes:.0f} tok/s"
    )
    lines.append(f"threads: {torch.get_num_threads()}, torch {torch.__version__}, model {source.name}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
