"""Engine throughput benchmark: Tandem's paged engine vs transformers and llama.cpp, same weights.

Everything is measured in one run on this machine, on the same GGUF (transformers dequantizes it).

Prints a header (CPU model, the instruction sets it supports and the one selected, what
``--dtype auto`` resolves to, threads, torch version), then one markdown table of

  * decode tokens/s (aggregate over the batch) at each ``--batches`` size (default 1, 8, 32);
  * prefill tokens/s for a ``--prefill-length`` prompt (default 512);

with one row per configuration, in this order:

1. ``Tandem auto (<dtype>, <isa>)`` — the default configuration (``--dtype auto``), once per
   instruction set variant (native CPU kernels built for that set);
2. ``Tandem float32 (<isa>)`` — once per instruction set variant;
3. ``Tandem q8_0 (<isa>)`` — the GGUF re-quantized to Q8_0, for the selected set only;
   ``Tandem q4 (<isa>)`` / ``Tandem q4_a8 (<isa>)`` — the GGUF's 4-bit weights with float32
   activations throughout / with prompt tokens' matmul rows over int8 activations, for the selected set
   only, when the GGUF has 4-bit weights (the one ``auto`` already is is not measured twice);
4. ``Tandem float32, no native kernels`` — PyTorch matmuls and attention only, the paths
   ``TANDEM_CPU_KERNELS=0`` gives;
5. ``Tandem bfloat16 (<isa>)`` — 16-bit weights, float32 activations (CPU's weight-only
   bfloat16), for the selected set only;
6. ``transformers float32`` — the same GGUF, dequantized;
7. ``llama.cpp (<quant type>, <n> threads)`` — the GGUF as stored, through llama-cpp-python
   (``llama_cpp_baseline.py``, in a fresh process), when it is installed: batch-1 decode and
   prefill only.

With ``--rounds N`` every row is measured N times, the rows taking turns (round 1 of every row,
then round 2 of every row, ...), and each cell keeps its best round: on a shared VM a burst of
load then slows one round of every row instead of all of one row's cells, so the ratios compare
rows measured minutes apart on equal terms.

Then ratio rows (default vs transformers per column, default vs llama.cpp), a check that no
Tandem configuration is slower than the no-native-kernels one, and the memory-bandwidth bound for
batch-1 decode: bytes of weights read per decoded token / measured read bandwidth.

Instruction set variants: every set the CPU supports (best first) unless ``--isa`` names some;
when ``TANDEM_CPU_ISA`` is set, only that one. The first variant is "the selected set": it runs
the q8_0, no-kernel and bfloat16 rows and is the default configuration the ratios use. Every
row uses the same random token prompts, greedy decoding, and ``os.cpu_count()`` threads.

    python bench/engine_throughput.py [--model default] [--decode-tokens 64] [--batches 1 8 32]
        [--prefill-length 512] [--isa avx512 avx2 generic] [--skip-transformers] [--skip-llama-cpp]
        [--rounds 1]

An AVX2 machine, emulated on an AVX-512 one (PyTorch's MKL and oneDNN limited too):

    TANDEM_CPU_ISA=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python bench/engine_throughput.py
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_settings import (  # noqa: E402
    environment,
    isa_variants,
    kernel_isa,
    native_kernels_off,
    without_native_kernels,
)
from bench.llama_cpp_baseline import (  # noqa: E402
    llama_cpp_available,
    llama_cpp_decode,
    llama_cpp_prefill,
    llama_cpp_quant_type,
    random_prompts,
)
from services.common.errors import ModelLoadError  # noqa: E402
from services.common.model_source import ModelSource, resolve_model  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from services.engine.core.kernels.native_build import (  # noqa: E402
    ISAS,
    selected_isa,
    supported_isas,
)
from services.engine.core.kernels.huge_pages import huge_page_arena  # noqa: E402
from services.engine.core.linear import Linear  # noqa: E402
from services.engine.core.loaders import LoadedModel, load_model, resolve_dtype  # noqa: E402

logger = logging.getLogger("bench")

Row = dict[str, float | None]  # column name → tokens/s (None: not measured)
NO_KERNELS = "Tandem float32, no native kernels"
TRANSFORMERS = "transformers float32"


# --- measurements ---------------------------------------------------------------------------


def memory_bandwidth_gbs() -> tuple[float, float]:
    """(read, copy) bandwidth in GB/s over a 512 MiB tensor, best of 5.

    Read (a streaming ``sum``) is the bound for decode, which only reads weights; copy counts the
    bytes read plus the bytes written. The tensors lie in huge pages where Tandem's weights do
    (``huge_page_arena``): through 4 KiB pages the same read is a third slower on some machines,
    which would understate what memory gives.
    """
    arena = huge_page_arena()
    shape = (128 * 1024 * 1024,)
    src, dst = (torch.empty(shape) if arena is None else arena.empty(shape, torch.float32)
                for _ in range(2))  # fmt: skip
    src.fill_(1.0)
    nbytes = src.numel() * 4
    read = nbytes / _best(src.sum, repeats=5)
    copy = 2 * nbytes / _best(lambda: dst.copy_(src), repeats=5)
    return read / 1e9, copy / 1e9


def tandem_decode(
    loaded: LoadedModel, batch: int, new_tokens: int, kv_cache_dtype: str = "auto"
) -> float:
    """Aggregate decode tokens/s: time of the steps after every sequence has its first token."""
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=max(batch, 1), num_blocks=2048,
                                            kv_cache_dtype=kv_cache_dtype))
    params = SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True)
    for attempt in range(2):  # the first round warms up allocators and caches
        for i, prompt in enumerate(random_prompts(batch, 32)):
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


def tandem_prefill(loaded: LoadedModel, length: int, kv_cache_dtype: str = "auto") -> float:
    engine = LLMEngine(loaded, EngineConfig(num_blocks=2048, max_num_batched_tokens=length,
                                            enable_prefix_caching=False,
                                            kv_cache_dtype=kv_cache_dtype))
    params = SamplingParams(temperature=0, max_tokens=1)
    prompt = random_prompts(1, length)[0]
    return length / _best(lambda: engine.generate([prompt], params), repeats=3)


def tandem_row(loaded: LoadedModel, args: argparse.Namespace) -> Row:
    row: Row = {f"decode b={b}": tandem_decode(loaded, b, args.decode_tokens, args.kv_cache_dtype)
                for b in args.batches}
    row["prefill"] = tandem_prefill(loaded, args.prefill_length, args.kv_cache_dtype)
    return row


def hf_decode(model: torch.nn.Module, batch: int, new_tokens: int) -> float:
    prompts = torch.tensor(random_prompts(batch, 32))
    mask = torch.ones_like(prompts)

    def run(n: int) -> None:
        model.generate(prompts, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)

    run(2)
    full = _best(lambda: run(new_tokens + 1), repeats=2)
    first = _best(lambda: run(1), repeats=2)
    return batch * new_tokens / (full - first)


def hf_prefill(model: torch.nn.Module, length: int) -> float:
    """The prompt's forward as ``generate`` runs it: logits for the last position only
    (``logits_to_keep=1``; a plain ``model(ids)`` also projects all ``length`` positions onto the
    vocabulary, work that neither ``generate`` nor Tandem does)."""
    ids = torch.tensor(random_prompts(1, length))
    return length / _best(lambda: model(ids, logits_to_keep=1), repeats=3)


def load_transformers(source: ModelSource) -> torch.nn.Module:
    """Hugging Face's float32 model on the same GGUF (the benchmarks' baseline)."""
    from transformers import AutoModelForCausalLM

    path = Path(source.path)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def hf_prefill_forward(source: ModelSource, prompt: list[int]) -> Callable[[], object]:
    """One call of :func:`hf_prefill`'s forward over ``prompt``, for timing loops of its own."""
    model, ids = load_transformers(source), torch.tensor([prompt])
    return lambda: model(ids, logits_to_keep=1)


def transformers_row(source: ModelSource, args: argparse.Namespace) -> Row:
    hf = load_transformers(source)
    row: Row = {f"decode b={b}": hf_decode(hf, b, args.decode_tokens) for b in args.batches}
    row["prefill"] = hf_prefill(hf, args.prefill_length)
    return row


def llama_cpp_row(source: ModelSource, args: argparse.Namespace, threads: int) -> Row:
    """Batch-1 decode and prefill; llama-cpp-python runs one sequence, so other batches are None.

    Measured in a fresh (spawned) process: after this process has run PyTorch's OpenMP thread
    pool, llama.cpp's batch-1 decode in the same process ran ~80x slower (0.3 vs 24 tok/s).
    """
    row: Row = {f"decode b={b}": None for b in args.batches}
    path = source.path
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        if 1 in args.batches:
            row["decode b=1"] = pool.submit(llama_cpp_decode, path, args.decode_tokens, threads).result()
        row["prefill"] = pool.submit(llama_cpp_prefill, path, args.prefill_length, threads).result()
    return row


def best_of(rounds: list[dict[str, Row]]) -> dict[str, Row]:
    """Per row and column, the highest tokens/s over the rounds (None where none measured it)."""
    merged: dict[str, Row] = {}
    for measured in rounds:
        for name, row in measured.items():
            into = merged.setdefault(name, {})
            for column, value in row.items():
                if value is not None and (into.get(column) is None or value > into[column]):
                    into[column] = value
                else:
                    into.setdefault(column, None)
    return merged


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    return best


def decode_weight_bytes(loaded: LoadedModel) -> int:
    """Bytes of Linear-layer weights (the LM head included) one batch-1 decode step reads, as
    packed for it: kernel tiles with their scales, the split layout, or the plain weight. The
    embedding table is left out: a step reads one row of it."""
    total = 0
    for module in loaded.model.modules():
        if not isinstance(module, Linear):
            continue
        kernel = module.packed is not None and module.regimes.kernel_for(1)
        if module.split is not None and not kernel:  # float32 where PyTorch won at batch 1
            tensors = [module.split]
        elif module.packed is not None:  # the kernel, or dequantizing its tiles
            tensors = [module.packed]
        elif module.quant is not None:
            total += module.quant.nbytes()
            continue
        else:
            tensors = [module.weight]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


# --- the run --------------------------------------------------------------------------------


def measure_tandem(
    source: ModelSource, args: argparse.Namespace, isas: list[str]
) -> tuple[dict[str, Row], dict[str, int]]:
    """Every Tandem row, and decode weight bytes per token for ``auto`` and ``float32``."""
    rows: dict[str, Row] = {}
    weight_bytes: dict[str, int] = {}

    def run(dtype: str, isa: str, label: Callable[[LoadedModel], str]) -> None:
        with environment("TANDEM_CPU_ISA", isa):
            loaded = load_model(source, dtype)
            row = tandem_row(loaded, args)
            name = label(loaded)
            rows[name] = row
            weight_bytes.setdefault(dtype, decode_weight_bytes(loaded))
        print(f"measured {name}", file=sys.stderr, flush=True)

    for isa in isas:
        run("auto", isa, lambda m: f"Tandem auto ({m.weight_format}, {kernel_isa(m)})")
    for isa in isas:
        run("float32", isa, lambda m: f"Tandem float32 ({kernel_isa(m)})")
    run("q8_0", isas[0], lambda m: f"Tandem q8_0 ({kernel_isa(m)})")
    if loads_as("q4", source):  # a GGUF with 4-bit weights
        with environment("TANDEM_CPU_ISA", isas[0]):
            auto = resolve_dtype("auto", source)
        for dtype in ("q4", "q4_a8"):
            if dtype != auto:
                run(dtype, isas[0], lambda m, d=dtype: f"Tandem {d} ({kernel_isa(m)})")
    run("bfloat16", isas[0], lambda m: f"Tandem bfloat16 ({kernel_isa(m)})")
    with environment("TANDEM_CPU_ISA", isas[0]):
        with native_kernels_off():
            rows[NO_KERNELS] = tandem_row(without_native_kernels(source), args)
        print(f"measured {NO_KERNELS}", file=sys.stderr, flush=True)
    return rows, weight_bytes


def loads_as(dtype: str, source: ModelSource) -> bool:
    """Whether ``source`` can load as ``dtype`` here (``q4`` / ``q4_a8`` need 4-bit weights)."""
    try:
        resolve_dtype(dtype, source)
    except ModelLoadError:
        return False
    return True


def header_lines(source: ModelSource, isas: list[str], auto_dtype: str, rounds: int = 1) -> list[str]:
    forced = os.environ.get("TANDEM_CPU_ISA", "").strip()
    isa = selected_isa() + (" (forced by TANDEM_CPU_ISA)" if forced else "")
    return [
        f"CPU: {cpu_model_name()}",
        f"instruction sets: supported {', '.join(supported_isas())}; selected {isa}; "
        f"measured {', '.join(isas)}",
        f"model: {source.name}; --dtype auto → {auto_dtype}",
        f"threads: {torch.get_num_threads()}, torch {torch.__version__}",
        *([f"rounds: best of {rounds}, rows taking turns"] if rounds > 1 else []),
        *_baseline_isa_limits(),
        f"load average at start: {_load_average()}",
        "",
    ]


def _baseline_isa_limits() -> list[str]:
    """PyTorch's own BLAS dispatch limits, when set: with ``TANDEM_CPU_ISA=avx2`` on an AVX-512 CPU,
    ``MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`` makes PyTorch (and so transformers and
    Tandem's PyTorch paths) run as on an AVX2 machine too."""
    names = ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
    limits = [f"{name}={os.environ[name]}" for name in names if os.environ.get(name)]
    return [f"PyTorch BLAS limited: {' '.join(limits)}"] if limits else []


def _load_average() -> str:
    """The 1-minute load average: other busy processes make every row here unreliable (threads
    that wait at a barrier for a core lose a scheduler time slice each time)."""
    return f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"


def cpu_model_name() -> str:
    """``model name`` from /proc/cpuinfo, else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def table_lines(rows: dict[str, Row], columns: list[str], args: argparse.Namespace) -> list[str]:
    titles = [f"decode tok/s b={b}" for b in args.batches] + [f"prefill tok/s ({args.prefill_length})"]
    lines = [_table_row("engine", titles), "|" + "---|" * (len(columns) + 1)]
    for name, values in rows.items():
        lines.append(_table_row(name, [_cell(values.get(c), "{:.1f}") for c in columns]))
    return lines


def ratio_lines(rows: dict[str, Row], columns: list[str], default: str, llama: str | None) -> list[str]:
    """Table rows: the default configuration's speed over transformers' and llama.cpp's."""
    lines = []
    for label, name in (("transformers", TRANSFORMERS), ("llama.cpp", llama)):
        base = rows.get(name) if name else None
        if base:
            ratios = [_ratio(rows[default].get(c), base.get(c)) for c in columns]
            lines.append(_table_row(f"default (auto) vs {label}", [_cell(r, "{:.2f}x") for r in ratios]))
    return lines


def slower_than_no_kernels(rows: dict[str, Row], columns: list[str]) -> str:
    """One line: every Tandem configuration and column slower than the no-native-kernels row."""
    floor = rows[NO_KERNELS]
    slower = [
        f"{name} @ {c} ({values[c]:.1f} < {floor[c]:.1f})"
        for name, values in rows.items()
        if name.startswith("Tandem") and name != NO_KERNELS
        for c in columns
        if values.get(c) is not None and floor.get(c) is not None and values[c] < floor[c]
    ]
    verdict = "yes" if not slower else "NO — " + "; ".join(slower)
    return f"\nNo Tandem configuration slower than no native kernels: {verdict}"


def bandwidth_lines(weight_bytes: dict[str, int], auto_format: str) -> list[str]:
    read_bw, copy_bw = memory_bandwidth_gbs()
    lines = [f"\nMemory bandwidth: read {read_bw:.1f} GB/s, copy {copy_bw:.1f} GB/s"]
    lines.append("Weights read per decoded token (Linear layers incl. LM head as packed for "
                 "batch-1 decode, quantization scales included; embedding table excluded):")
    labels = (("float32", "float32"), ("bfloat16", "bfloat16"), ("auto", f"auto ({auto_format})"))
    for dtype, label in labels:
        if dtype in weight_bytes:
            nbytes = weight_bytes[dtype]
            lines.append(f"  {label}: {nbytes / 1e6:.1f} MB → batch-1 decode bound "
                         f"≈ {read_bw * 1e9 / nbytes:.0f} tok/s")
    return lines


def _table_row(name: str, cells: list[str]) -> str:
    return f"| {name} | " + " | ".join(cells) + " |"


def _ratio(ours: float | None, base: float | None) -> float | None:
    return ours / base if ours and base else None


def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prefill-length", type=int, default=512)
    parser.add_argument("--kv-cache-dtype", choices=("auto", "float32", "bfloat16", "float16"),
                        default="auto", help="the engine's KV cache dtype (default auto, as served)")
    parser.add_argument("--isa", choices=ISAS, nargs="+", action="extend",
                        help="instruction set variants to measure (default: all the CPU supports)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every row this many times, rows taking turns; keep each "
                        "cell's best (default 1)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(os.cpu_count() or 1)
    threads = torch.get_num_threads()
    source = resolve_model(args.model)
    isas = isa_variants(args.isa)
    auto_dtype = resolve_dtype("auto", source)
    sys.stdout.write("\n".join(header_lines(source, isas, auto_dtype, args.rounds)) + "\n")
    sys.stdout.flush()

    llama = None
    if not args.skip_llama_cpp and source.kind == "gguf" and llama_cpp_available():
        llama = f"llama.cpp ({llama_cpp_quant_type(source.path)}, {threads} threads)"
    rounds: list[dict[str, Row]] = []
    for number in range(1, args.rounds + 1):
        if args.rounds > 1:
            print(f"round {number} of {args.rounds}", file=sys.stderr, flush=True)
        measured, weight_bytes = measure_tandem(source, args, isas)
        if not args.skip_transformers and source.kind == "gguf":
            measured[TRANSFORMERS] = transformers_row(source, args)
            print(f"measured {TRANSFORMERS}", file=sys.stderr, flush=True)
        if llama is not None:
            measured[llama] = llama_cpp_row(source, args, threads)
            print(f"measured {llama}", file=sys.stderr, flush=True)
        rounds.append(measured)
    rows = best_of(rounds)
    default = next(iter(rows))  # "Tandem auto (...)" at the selected instruction set

    columns = [f"decode b={b}" for b in args.batches] + ["prefill"]
    lines = table_lines(rows, columns, args)
    lines += ratio_lines(rows, columns, default, llama)
    lines.append(slower_than_no_kernels(rows, columns))
    lines += bandwidth_lines(weight_bytes, auto_dtype)
    lines.append(f"load average at end: {_load_average()}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
