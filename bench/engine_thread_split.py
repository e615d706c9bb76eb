"""Why a worker builds its engine on the engine thread: batch-1 decode step time with the model
loaded and stepped on one thread, against loaded on the main thread and stepped on another (the
served workers' layout before ``EngineLoop.build_and_start``), in one run.

Each layout runs in a fresh process (GNU OpenMP keeps one worker team per thread that opened a
parallel region, for the life of the process), decodes 128 tokens after a 32-token prompt
twice, and reports the second round's mean step.

    python bench/engine_thread_split.py
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _decode_ms(engine: object) -> float:
    from services.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=129, ignore_eos=True)
    result = 0.0
    for attempt in range(2):  # the first round warms up
        engine.add_request(f"r{attempt}", list(range(100, 132)), params)  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished():  # type: ignore[attr-defined]
            engine.step()  # type: ignore[attr-defined]
            steps += 1
        result = 1000 * (time.perf_counter() - start) / steps
    return result


def _build() -> object:
    from services.common.model_source import resolve_model
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model

    return LLMEngine(load_model(resolve_model("default"), "auto"),
                     EngineConfig(max_num_seqs=1, num_blocks=256))  # fmt: skip


def _measure(layout: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    box: list[float] = []
    if layout == "one thread":
        def work() -> None:
            box.append(_decode_ms(_build()))
    else:
        engine = _build()  # loaded (and autotuned) on the main thread

        def work() -> None:
            box.append(_decode_ms(engine))
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    out.put(box[0])


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    ctx = multiprocessing.get_context("spawn")
    from bench.engine_throughput import cpu_model_name
    from services.engine.core.kernels.native_build import selected_isa

    print(f"CPU: {cpu_model_name()}, kernels built for {selected_isa()}; default model, "
          "--dtype auto\n")
    print("| layout | batch-1 decode step ms |")
    print("|---|---|")
    for layout in ("one thread", "loaded on main, stepped on another"):
        queue = ctx.Queue()
        proc = ctx.Process(target=_measure, args=(layout, queue))
        proc.start()
        ms = queue.get()
        proc.join()
        print(f"| {layout} | {ms:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
