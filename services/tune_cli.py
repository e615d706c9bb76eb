"""``tandem tune``: measure this machine's native CPU kernels against PyTorch, once, for the
workers that start later.

Why a command of its own: timing every kernel path on a model's layers took a 2-core machine
~50 s per worker start, on the way to ``ready``, and two workers starting together timed each
other's load. Workers now take the decision cached here, or the fixed table where there is none
(``services.engine.core.kernels.autotune``); the choices they make differ only in speed (the
int8 GEMM against the int8 decode kernel, all layers in one C call or op by op), except a float32
model's layers (kernel or PyTorch), which every worker on the machine then takes alike.

First, where the CPU has VNNI (or, on Arm, the dot product: ``neondot``), it times those kernels
against the base set's (``services.engine.core.kernels.isa_tuning``: the same bits, so a speed
choice only; the set every worker then loads). Then, per thread count, it times the quantized
decode rows' prefetch distance per format (``services.engine.core.kernels.prefetch_tuning``: a
speed choice only, the bits are the same).
Then it builds the engine as a worker with the same options would (the model, its dtype, the KV pool
and batch limits: the decisions are keyed by the layer shapes and the thread count) once per
thread count a worker will run with, by default the counts ``tandem up`` gives its default
prefill and decode workers on this machine. Run it on a quiet machine: a measurement disturbed
by other processes is not cached (it says so), and the fixed table stays in use.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from services.common.model_source import resolve_model
from services.cpu_plan import plan_cpus, usable_cpus
from services.engine.runtime.worker_options import DTYPE_CHOICES, WorkerOptions

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="default | PATH to a .gguf file or Hugging Face folder (env TANDEM_MODEL)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="the workers' --dtype (default auto)")
    parser.add_argument("--threads", type=int, action="append", default=None,
                        help="a worker's thread count (repeatable); default: what `tandem up` "
                             "gives its prefill and decode workers here")  # fmt: skip
    parser.add_argument("--max-num-seqs", type=int, default=WorkerOptions.max_num_seqs,
                        help="the decode workers' batch limit (the one-call decode is timed up to it)")


def default_thread_counts() -> list[int]:
    """The thread counts of ``tandem up``'s default workers (one prefill, one decode) here."""
    placements = plan_cpus(1, 1, usable_cpus())
    return sorted({placement.threads for placement in placements.values()})


def run(args: argparse.Namespace) -> int:
    import torch

    from services.engine.core.kernels import isa_tuning, prefetch_tuning
    from services.engine.core.kernels.loaded import forget_loaded_kernels
    from services.engine.core.kernels.cpu_q4a8_gemm import load_cpu_q4a8_gemm
    from services.engine.core.kernels.native_build import cache_dir
    from services.engine.runtime.worker_runtime import build_engine

    source = resolve_model(args.model or os.environ.get("TANDEM_MODEL", "default"))
    counts = args.threads or default_thread_counts()
    os.environ["TANDEM_AUTOTUNE"] = "remeasure"  # this process's own engines only
    started = time.time()
    torch.set_num_threads(max(counts))  # the decode worker's count: VNNI matters most there
    logger.info("timing the VNNI (or sdot) kernels against the base set's with %d threads",
                max(counts))  # fmt: skip
    isa_tuning.tune()
    forget_loaded_kernels()  # what follows loads the set just chosen
    for threads in counts:
        torch.set_num_threads(threads)
        int8_rows = load_cpu_q4a8_gemm()
        if int8_rows is not None:
            logger.info("timing the decode rows' prefetch distances with %d thread%s", threads,
                        "" if threads == 1 else "s")  # fmt: skip
            prefetch_tuning.tune(int8_rows)
        logger.info("timing %s (--dtype %s) with %d thread%s", source, args.dtype, threads,
                    "" if threads == 1 else "s")  # fmt: skip
        options = WorkerOptions(model=source, dtype=args.dtype, threads=threads,
                                max_num_seqs=args.max_num_seqs)  # fmt: skip
        with torch.inference_mode():
            engine, _ = build_engine(options, load_tokenizer_too=False)
        del engine
    written = [p for p in cache_dir().glob("*.json") if p.stat().st_mtime >= started]
    logger.info("%d decisions cached in %s; workers that start from now on take them",
                len(written), cache_dir())  # fmt: skip
    return 0
