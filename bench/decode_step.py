"""Batch-1 decode step time of the engine's default configuration, per GGUF, in milliseconds.

    python bench/decode_step.py GGUF [GGUF ...] [--steps 48] [--rounds 3] [--per-op]
                                [--dtypes auto q4_a8_decode ...] [--batch 1 4 16] [--prompt 32]
                                [--kv-cache-dtype auto] [--huge-pages on|off|both]
                                [--q4k-prefetch BYTES [BYTES ...]]

Each file is loaded as ``tandem up`` serves it (``--dtype auto``, or each of ``--dtypes``; the KV
pool ``--kv-cache-dtype auto``, or the given one, ``none`` for the model's own dtype), a
``--prompt``-token prompt (32) is prefilled, then ``--steps`` tokens are decoded greedily one
engine step at a time; a round's figure is the mean step time (sampling and scheduling
included), and each file keeps its best of ``--rounds`` rounds. ``--batch`` sizes above 1 add a
column each: that many requests decoded together, as output tokens per second over the batch
(the batched decode a served concurrency level runs; after the short default prompt the weights
dominate, after ``--prompt 512`` attention over a served level's context is most of a step).
``--per-op`` also times the same loaded model with the one-call C decode layers turned off
(every op its own call from Python), the rounds of the two taking turns. ``--huge-pages both``
loads each file twice, its weight tiles and KV pool in huge pages (as served) and in PyTorch's
4 KiB pages (``TANDEM_HUGE_PAGES=0``), a column each, rounds taking turns. ``--q4k-prefetch``
times the same loaded model with q4_k rows prefetching each of those distances ahead (0: none),
set in every loaded kernel library before each of its rounds, a column each, rounds taking turns.

It is the short check behind a decode-path change: to compare two trees, run it from each
checkout in turn (``PYTHONPATH=<checkout> python <checkout>/bench/decode_step.py ...``), on an
idle machine. ``family_speed.py`` is the full table next to llama.cpp.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from services.engine.core.kernels.autotune import KernelRegimes  # noqa: E402
from services.engine.core.kernels.cpu_decode_layers import load_cpu_decode_layers  # noqa: E402
from services.engine.core.kernels.cpu_q4a8_gemm import load_cpu_q4a8_gemm  # noqa: E402
from services.engine.core.kernels.cpu_qgemv import load_cpu_qgemv  # noqa: E402
from services.engine.core.kernels.tile_formats import FORMAT_CODES  # noqa: E402
from services.engine.core.loaders import LoadedModel, load_model  # noqa: E402

logger = logging.getLogger("bench.decode_step")


def step_ms(
    engine: LLMEngine, steps: int, round_: int, batch: int = 1, prompt_len: int = 32
) -> float:
    """Mean milliseconds per output token of ``steps`` decode steps of ``batch`` requests after
    ``prompt_len``-token prompts (at batch 1: the step time)."""
    gen = torch.Generator().manual_seed(round_)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(100, 1000, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"r{round_}-{batch}-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # the prefill steps (long prompts: several, decoding the first)
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    start, done = time.perf_counter(), 0
    while engine.has_unfinished():
        done += sum(len(out.new_token_ids) for out in engine.step())
    return (time.perf_counter() - start) * 1000 / done


def set_q4k_prefetch(ahead: int) -> None:
    """q4_k rows' prefetch distance in every loaded kernel library that reads the tiles."""
    for kernel in (load_cpu_decode_layers(), load_cpu_q4a8_gemm(), load_cpu_qgemv()):
        if kernel is not None:
            kernel.library.tandem_set_prefetch_ahead(FORMAT_CODES["q4_k"], ctypes.c_int64(ahead))


def one_call_off(loaded: LoadedModel) -> KernelRegimes:
    """Turn the one-call decode layers off (the per-op path runs); returns the regimes to
    restore."""
    model = loaded.model
    saved = model.decode_layers_regimes
    off = (False,) * len(saved.rows)
    model.decode_layers_regimes = KernelRegimes(rows=saved.rows, use_kernel=off)
    return saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-op", action="store_true")
    parser.add_argument("--dtypes", nargs="+", default=["auto"],
                        help="--dtype values to time side by side (rounds taking turns)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1],
                        help="batch sizes; above 1: output tok/s of that many requests together")
    parser.add_argument("--prompt", type=int, default=32,
                        help="prompt tokens before the decode steps")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="the KV pool's dtype (auto, as tandem up serves; none: the model's own)")
    parser.add_argument("--huge-pages", choices=["on", "off", "both"], default="on",
                        help="weights and KV in huge pages (on: as served), 4 KiB pages, or both")
    parser.add_argument("--q4k-prefetch", type=int, nargs="+", default=[],
                        help="q4_k prefetch distances in bytes to time side by side (0: none)")
    args = parser.parse_args()
    pages = {"on": ["1"], "off": ["0"], "both": ["1", "0"]}[args.huge_pages]
    loads = [f"{dtype}{'' if hp == '1' else ' 4K-pages'}" for dtype in args.dtypes for hp in pages]
    aheads: list[int | None] = list(args.q4k_prefetch) or [None]
    # a variant is a load and, with --q4k-prefetch, the distance its rounds run at
    variants = [load if ahead is None else f"{load} q4_k ahead {ahead}" for load in loads
                for ahead in aheads]  # fmt: skip
    kv_cache_dtype = None if args.kv_cache_dtype == "none" else args.kv_cache_dtype
    batches = [b for b in args.batch if b > 1]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(os.cpu_count() or 1)
    columns = [f"{v} ms/step" for v in variants] + (["per-op ms/step"] if args.per_op else [])
    columns += [f"{v} batch-{b} tok/s" for b in batches for v in variants]
    logger.info("| file | layers take | %s |", " | ".join(columns))
    logger.info("|---|---|%s", "---|" * len(columns))
    seats = max([1, *batches])
    per_request = (args.prompt + args.steps + 1) // 16 + 2  # blocks of 16 slots, with room

    def timed(engine: LLMEngine, round_: int, batch: int = 1, steps: int = args.steps) -> float:
        return step_ms(engine, steps, round_, batch, args.prompt)

    def prefetch_for(variant: str) -> None:
        if " q4_k ahead " in variant:
            set_q4k_prefetch(int(variant.rsplit(" ", 1)[1]))

    for path in args.models:
        engines, by_load = {}, {}
        for variant in variants:
            load = variant.split(" q4_k ahead ")[0]
            if load not in by_load:
                dtype, huge = load.split(" ")[0], not load.endswith(" 4K-pages")
                os.environ["TANDEM_HUGE_PAGES"] = "1" if huge else "0"  # read as it loads
                loaded = load_model(path, dtype)
                config = EngineConfig(max_num_seqs=seats, num_blocks=max(256, per_request * seats),
                                      kv_cache_dtype=kv_cache_dtype)
                by_load[load] = (loaded, LLMEngine(loaded, config))
                for batch in [1, *batches]:
                    timed(by_load[load][1], -1, batch, 4)  # warm-up (and the kernels' tuning)
            engines[variant] = by_load[load]
        first = engines[variants[0]][0]
        path_taken = "one call" if first.model.decode_layers_regimes.kernel_for(1) and \
            first.model.decode_layers is not None else "per op"  # fmt: skip
        best = dict.fromkeys(columns, float("inf"))
        with torch.inference_mode():
            for round_ in range(args.rounds):
                for variant, (loaded, engine) in engines.items():
                    column = f"{variant} ms/step"
                    prefetch_for(variant)
                    best[column] = min(best[column], timed(engine, round_))
                for batch in batches:
                    for variant, (loaded, engine) in engines.items():
                        column = f"{variant} batch-{batch} tok/s"
                        prefetch_for(variant)
                        best[column] = min(best[column], timed(engine, round_, batch))
                if args.per_op:
                    loaded, engine = engines[variants[0]]
                    saved = one_call_off(loaded)
                    best["per-op ms/step"] = min(best["per-op ms/step"], timed(engine, round_))
                    loaded.model.decode_layers_regimes = saved
        cells = [f"{1000 / best[c]:.1f}" if c.endswith("tok/s") else f"{best[c]:.2f}"
                 for c in columns]  # tok/s columns hold ms per token
        logger.info("| %s | %s | %s |", Path(path).name, path_taken, " | ".join(cells))
        del engines
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
