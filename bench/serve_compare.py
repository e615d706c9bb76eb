"""Served performance, side by side: Tandem (default disaggregated mode), Tandem colocated, Tandem
with every prompt prefilled remotely, and llama-cpp-python's server on the same GGUF, under one
``tandem bench serve --compare`` sweep, next to the engine's offline throughput on the same
prompts.

1. Start ``tandem up`` (default mode), ``tandem up --mode colocated``, ``tandem up`` with
   ``--remote-prefill-min-tokens 0`` (every prompt crosses the KV hand-off) and
   ``python -m llama_cpp.server`` (its default threads: half the cores for decoding, all for
   prompts, which served faster than every core for both on a 2-core machine;
   ``--interrupt_requests False``: it serves one request at a time and would otherwise cut a
   running stream for a new one), each on ports of its own, and wait until all four answer.
2. Run ``tandem bench serve --endpoint completions --compare ...`` over them (the completions
   endpoint: llama-cpp-python's chat template wants string content), writing the table, JSON and
   PNG plots to ``--output-dir``. The servers run one after another; the idle ones only wait.
3. Stop them, then run the engine in this process (same weights, ``--dtype auto``) on the
   concurrency-16 level's prompts (the same texts, tokenized as the server tokenizes a text
   completion): every prompt queued at once with at most 16 running, output tokens/s over the
   whole run; and one prompt of the concurrency-1 level alone for the batch-1 decode step time.
   The served/offline ratios are printed under the table.

    python bench/serve_compare.py [--concurrency 1 4 16 32] [--num-prompts 32]
        [--input-tokens 256] [--output-tokens 128] [--output-dir bench-serve]
        [--llama-cpp-path DIR]   # where 'llama-cpp-python[server]'s extra packages live

Needs an idle machine: nothing else may run meanwhile.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.common.model_source import resolve_model  # noqa: E402

logger = logging.getLogger("serve_compare")

STACKS = {  # name -> tandem up flags (ports apart from the defaults and from each other)
    "tandem": ["--gateway-port", "8100", "--tokenizer-port", "50151",
               "--tokenizer-metrics-port", "9201", "--prefill-port", "50161",
               "--prefill-metrics-port", "9211", "--decode-port", "50171",
               "--decode-metrics-port", "9221"],
    "tandem-colocated": ["--mode", "colocated", "--gateway-port", "8200",
                         "--tokenizer-port", "50251", "--tokenizer-metrics-port", "9301",
                         "--decode-port", "50271", "--decode-metrics-port", "9321"],
    # every prompt through a prefill worker and the KV hand-off (no conditional disaggregation)
    "tandem-remote-prefill": ["--gateway-args", "--remote-prefill-min-tokens 0",
                              "--gateway-port", "8400", "--tokenizer-port", "50451",
                              "--tokenizer-metrics-port", "9501", "--prefill-port", "50461",
                              "--prefill-metrics-port", "9511", "--decode-port", "50471",
                              "--decode-metrics-port", "9521"],
}  # fmt: skip
LLAMA_PORT = 8300


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:g}s")


@contextmanager
def _process(argv: list[str], ready_url: str, log: Path, env: dict[str, str]) -> Iterator[None]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    try:
        _wait_http(ready_url, 600, proc)
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def serve_and_sweep(args: argparse.Namespace, gguf: Path) -> None:
    tandem = Path(sys.executable).with_name("tandem")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    llama_env = dict(env)
    if args.llama_cpp_path:
        llama_env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.llama_cpp_path,
                                                                env.get("PYTHONPATH")]))
    with ExitStack() as stack:
        for name, flags in STACKS.items():
            port = flags[flags.index("--gateway-port") + 1]
            stack.enter_context(_process([str(tandem), "up", *flags],
                                         f"http://127.0.0.1:{port}/ready",
                                         args.output_dir / f"{name}.log", env))  # fmt: skip
            logger.info("%s is up", name)
        stack.enter_context(_process(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port",
             str(LLAMA_PORT), "--n_ctx", "4096", "--interrupt_requests", "False"],
            f"http://127.0.0.1:{LLAMA_PORT}/v1/models", args.output_dir / "llama-cpp.log",
            llama_env))  # fmt: skip
        logger.info("llama-cpp-python is up")
        sweep = [str(tandem), "bench", "serve", "--endpoint", "completions",
                 "--input-tokens", str(args.input_tokens), "--output-tokens",
                 str(args.output_tokens), "--num-prompts", str(args.num_prompts),
                 "--concurrency", *map(str, args.concurrency), "--output-dir",
                 str(args.output_dir), "--compare", "tandem=http://127.0.0.1:8100",
                 "tandem-colocated=http://127.0.0.1:8200",
                 "tandem-remote-prefill=http://127.0.0.1:8400",
                 f"llama-cpp-python=http://127.0.0.1:{LLAMA_PORT}"]  # fmt: skip
        subprocess.run(sweep, check=True)


def offline(args: argparse.Namespace) -> None:
    """The engine alone on the concurrency-16 level's prompts, and one batch-1 decode."""
    import torch

    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model
    from services.loadgen.workload import Workload, WorkloadConfig
    from services.tokenizer.tokenizer import Tokenizer

    source = resolve_model("default")
    tokenizer = Tokenizer.load(source)
    workload = Workload(WorkloadConfig(num_prompts=args.num_prompts,
                                       input_tokens=args.input_tokens,
                                       output_tokens=args.output_tokens), tokenizer)  # fmt: skip
    levels = {c: workload.level(i) for i, c in enumerate(args.concurrency)}
    loaded = load_model(source, "auto")
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)

    def encode(text: str | None) -> list[int]:
        return tokenizer.encode(text or "")

    with torch.inference_mode():
        one = LLMEngine(loaded, EngineConfig(max_num_seqs=1, num_blocks=1024))
        for attempt in range(2):  # the first warms up
            one.add_request(f"b1-{attempt}", encode(levels[min(levels)][0].prompt), params)
            one.step()  # prefill and the first token
            start, steps = time.perf_counter(), 0
            while one.has_unfinished():
                one.step()
                steps += 1
        step_ms = 1000 * (time.perf_counter() - start) / steps
        seats = 16 if 16 in levels else max(levels)
        engine = LLMEngine(loaded, EngineConfig(max_num_seqs=seats, num_blocks=4096))
        for i, spec in enumerate(levels[seats]):
            engine.add_request(f"c{i}", encode(spec.prompt), params)
        start, produced = time.perf_counter(), 0
        while engine.has_unfinished():
            produced += sum(len(out.new_token_ids) for out in engine.step())
        rate = produced / (time.perf_counter() - start)
    print(f"\nengine offline (same weights, --dtype auto, {torch.get_num_threads()} threads): "
          f"batch-1 decode step {step_ms:.2f} ms; the concurrency-{seats} level's "
          f"{len(levels[seats])} prompts with {seats} seats: {rate:.1f} output tok/s "
          "(prefill included)", flush=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-serve"))
    parser.add_argument("--llama-cpp-path", default=None,
                        help="extra import path for llama-cpp-python's server dependencies")
    parser.add_argument("--skip-serve", action="store_true", help="only the offline figures")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    source = resolve_model("default")
    gguf = Path(source.path)
    if not args.skip_serve:
        serve_and_sweep(args, gguf)
    offline(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
