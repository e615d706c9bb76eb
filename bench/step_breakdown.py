"""Where a batch-1 CPU decode step's time goes, next to the memory bandwidth read either side of it.

    python bench/step_breakdown.py GGUF [--rounds 8] [--steps 32] [--prompt 32]

One model is loaded as ``tandem up`` serves it (``--dtype auto``) and, round by round, this prints
the memory read bandwidth just before and after (``engine_throughput.memory_bandwidth_gbs``: a
2-thread sum over huge pages), then the median of ``--steps`` greedy decode steps split into

* the step (``LLMEngine.step``, scheduling and sampling included) and its weight read rate as a
  share of the better bandwidth;
* the one-call decode layers (every decoder layer, attention and the final norm: one C call);
* the LM head (``compute_logits``);
* the rest (embedding lookup, the step's metadata, sampling, Python);
* the layers' projections alone, back to back with nothing between them (the same kernel library
  and tiles, one input row; the fastest of a few chains): what the weight stream of the layers
  gives with no attention, norm or Python between the matmuls.

Why: on a VM whose memory bandwidth moves between minutes, a share is only meaningful next to a
bandwidth read in the same seconds, and the breakdown tells which part of a step falls short of
it (the matmuls' own stream, what runs between them, or the step around the layers). Run it on an
idle machine; the decode layers must be the path the model takes (the default on CPU).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_throughput import (  # noqa: E402
    cpu_model_name,
    decode_weight_bytes,
    memory_bandwidth_gbs,
)
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from services.engine.core.kernels import cpu_decode_layers  # noqa: E402
from services.engine.core.kernels.cpu_decode_layers import (  # noqa: E402
    LinearTiles,
    load_cpu_decode_layers,
)
from services.engine.core.kernels.cpu_qgemv import FORMAT_CODES  # noqa: E402
from services.engine.core.kernels.native_build import selected_isa  # noqa: E402
from services.engine.core.loaders import load_model  # noqa: E402

logger = logging.getLogger("bench.step_breakdown")


class Timings:
    """Per-call durations of a few wrapped callables, by name."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}

    def wrap(self, name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls.setdefault(name, []).append(time.perf_counter() - start)

        return timed

    def median_ms(self, name: str) -> float:
        return statistics.median(self.calls[name]) * 1000


def projection_chain(
    tiles: list[LinearTiles], library: ctypes.CDLL
) -> tuple[Callable[[], float], int]:
    """A function running every projection once, back to back (one input row), returning its
    seconds, and the bytes of weights it reads."""
    fn = library.tandem_a8_gemv
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]  # fmt: skip
    qgemv = library.tandem_qgemv
    qgemv.restype = ctypes.c_int
    qgemv.argtypes = fn.argtypes
    widest_in = max(t.in_features for t in tiles)
    widest_out = max(t.out_features for t in tiles) + 64
    x, y = torch.randn(widest_in), torch.empty(widest_out)
    threads = torch.get_num_threads()
    calls = [(fn if t.int8_activations else qgemv, FORMAT_CODES[t.format], t.packed.data_ptr(),
              t.in_features, t.out_features) for t in tiles]  # fmt: skip

    def run() -> float:
        start = time.perf_counter()
        for kernel, code, weight, n_in, n_out in calls:
            kernel(code, x.data_ptr(), n_in, weight, None, y.data_ptr(), 1, n_in, n_out, threads)
        return time.perf_counter() - start

    return run, sum(t.packed.numel() * t.packed.element_size() for t in tiles)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("services", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    torch.set_num_threads(os.cpu_count() or 1)
    loaded = load_model(args.model, "auto")
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=1, num_blocks=64 + args.prompt // 8))
    model, kernel = loaded.model, load_cpu_decode_layers()
    call = model.decode_layers
    if kernel is None or call is None or not model.decode_layers_regimes.kernel_for(1):
        logger.error("the one-call decode layers are not this model's batch-1 path here")
        return 1
    timings = Timings()
    engine.step = timings.wrap("step", engine.step)  # type: ignore[method-assign]
    model.compute_logits = timings.wrap("head", model.compute_logits)  # type: ignore[method-assign]
    layers_call = cpu_decode_layers.DecodeLayersCall.__call__
    cpu_decode_layers.DecodeLayersCall.__call__ = timings.wrap("layers", layers_call)  # type: ignore[method-assign]
    chain, chain_bytes = projection_chain(call.tiles(), kernel.library)
    weights = decode_weight_bytes(loaded)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)

    def decode(round_: int) -> None:
        prompt = torch.randint(100, 1000, (args.prompt,), generator=gen).tolist()
        engine.add_request(f"r{round_}", prompt, params)
        engine.step()  # the prefill
        timings.calls.clear()
        while engine.has_unfinished():
            engine.step()

    logger.info("CPU: %s; kernels: %s (%s); threads: %d; weights read a step: %.1f MB, the "
                "layers' projections %.1f MB", cpu_model_name(), selected_isa(), call.build,
                torch.get_num_threads(), weights / 1e6, chain_bytes / 1e6)  # fmt: skip
    logger.info("| round | bandwidth before / after GB/s | step ms | weights GB/s | share | "
                "layers ms | head ms | rest ms | projections alone GB/s (share) |")
    logger.info("|---|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        decode(-1)  # warm-up
        for round_ in range(args.rounds):
            before = memory_bandwidth_gbs()[0]
            decode(round_)
            alone = chain_bytes / min(chain() for _ in range(6)) / 1e9
            after = memory_bandwidth_gbs()[0]
            bandwidth = max(before, after)
            step, layers, head = (timings.median_ms(n) for n in ("step", "layers", "head"))
            rate = weights / step / 1e6
            logger.info("| %d | %.1f / %.1f | %.2f | %.1f | %.0f%% | %.2f | %.2f | %.2f | %.1f (%.0f%%) |",
                        round_ + 1, before, after, step, rate, 100 * rate / bandwidth, layers,
                        head, step - layers - head, alone, 100 * alone / bandwidth)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
