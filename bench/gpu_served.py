"""GPU served benchmark: ``tandem up --device cuda`` under load next to the engine's own steps.

    python bench/gpu_served.py --tokenizer-json tokenizer.json [--shape llama-3-8b]
        [--concurrency 1 16 64] [--input-tokens 256] [--output-tokens 128] [--work DIR]

Without a CUDA device it says so and exits 0. What it does, in one process tree on one GPU:

1. Writes a Hugging Face folder of a real shape (default Llama-3-8B: 32 layers, 4096 hidden,
   14,336 intermediate, 8 KV heads) with random bfloat16 weights and the given tokenizer; the
   vocabulary is the tokenizer's (no 128k-token tokenizer can reach a GPU box without a hub),
   so the LM head is smaller than the real model's.
2. **Offline**: the engine alone on that folder (CUDA graphs, bfloat16), per concurrency ``c``:
   ``c`` prompts of ``--input-tokens`` random ids admitted at once, ``--output-tokens`` each,
   greedy, ``ignore_eos``; output tokens/s over the whole run and the median decode step once
   every sequence has its first token.
3. **Served**: ``tandem up --device cuda`` (tokenizer, one prefill and one decode worker sharing
   the GPU, the gateway) on the same folder, and ``tandem bench serve`` at the same
   concurrencies: output tokens/s, TTFT and inter-token latency percentiles.
4. Prints one table: served against offline per concurrency, and ITL p50 at concurrency 1 over
   the offline batch-1 step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

logger = logging.getLogger("bench.gpu_served")
REPO = Path(__file__).resolve().parent.parent


def write_folder(folder: Path, shape: str, tokenizer_json: Path, device: str) -> int:
    """Write ``shape`` with random bf16 weights and the tokenizer's vocabulary; return its size."""
    from safetensors.torch import save_file

    from services.engine.core.loaders.dummy import dummy_config, iter_dummy_weights

    tok = json.loads(tokenizer_json.read_text())
    vocab = max(tok["model"]["vocab"].values()) + 1
    vocab = max([vocab] + [t["id"] + 1 for t in tok.get("added_tokens", [])])
    vocab = (vocab + 63) // 64 * 64
    base = dummy_config(shape)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": vocab, "hidden_size": base.hidden_size,
        "intermediate_size": base.intermediate_size, "num_hidden_layers": base.num_layers,
        "num_attention_heads": base.num_heads, "num_key_value_heads": base.num_kv_heads,
        "head_dim": base.head_dim, "max_position_embeddings": base.max_position_embeddings,
        "rms_norm_eps": base.rms_norm_eps, "rope_theta": base.rope_theta,
        "tie_word_embeddings": base.tie_word_embeddings, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(tokenizer_json, folder / "tokenizer.json")
    from services.common.model_config import ModelConfig

    shape_cfg = ModelConfig.from_hf_config(config)
    weights = {k: v.cpu().contiguous()
               for k, v in iter_dummy_weights(shape_cfg, torch.bfloat16, device, seed=0)}  # fmt: skip
    save_file(weights, str(folder / "model.safetensors"))
    return vocab


def offline(folder: Path, concurrencies: list[int], prompt_len: int, out_len: int,
            device: str) -> dict[int, dict[str, float]]:
    """Per concurrency: output tok/s over the run and the median full-batch decode step (ms)."""
    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model

    loaded = load_model(str(folder), "bfloat16", device)
    vocab = loaded.config.vocab_size
    blocks = max(concurrencies) * ((prompt_len + out_len) // 16 + 2) + 64
    engine = LLMEngine(loaded, EngineConfig(num_blocks=blocks, max_num_seqs=max(concurrencies),
                                            cuda_graphs=device.startswith("cuda")))  # fmt: skip
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    results: dict[int, dict[str, float]] = {}
    # each concurrency once to warm up (Triton compiles per shape on first use), then timed
    for rep, c in enumerate(concurrencies + concurrencies):
        for i in range(c):
            prompt = [3 + (rep * 7919 + i * 104729 + j * 31) % (vocab - 10) for j in range(prompt_len)]
            engine.add_request(f"r{rep}-{i}", prompt, params)
        steps: list[float] = []
        tokens = 0
        start = time.perf_counter()
        while engine.has_unfinished():
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            running = engine.scheduler.running
            if (len(running) == c and not engine.scheduler.waiting
                    and all(s.num_computed_tokens > prompt_len for s in running)):  # fmt: skip
                steps.append(dt * 1000)
            tokens += sum(len(o.new_token_ids) for o in outs) if outs else 0
        elapsed = time.perf_counter() - start
        if rep >= len(concurrencies):
            results[c] = {"tok_s": c * out_len / elapsed,
                          "step_ms": statistics.median(steps) if steps else float("nan")}  # fmt: skip
    del engine, loaded
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return results


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float, mode: str) -> None:
    """Until the gateway lists a decode worker (and, disaggregated, a prefill one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem up exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as response:
                ready = json.load(response)
            prefill = ready.get("prefill") or mode == "colocated"  # colocated: decode prefills
            if response.status == 200 and prefill and ready.get("decode"):
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(1)
    raise RuntimeError("tandem up did not become ready")


def _stop_group(up: subprocess.Popen[bytes]) -> None:
    """SIGINT to ``tandem up``'s process group, then SIGKILL to whatever of it is left."""
    try:
        os.killpg(up.pid, 2)
        up.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(up.pid, 9)  # workers still shutting down keep their ports
    except ProcessLookupError:
        pass


def served(folder: Path, concurrencies: list[int], prompt_len: int, out_len: int,
           prompts_per_level: int, out_dir: Path, kv_gib: float, device: str,
           mode: str, profile: float = 0.0, up_args: tuple[str, ...] = ()) -> dict[int, dict[str, float]]:
    """``tandem up --device cuda`` + one ``tandem bench serve`` per concurrency; its summaries.
    ``profile`` > 0: py-spy samples the decode, prefill and gateway processes for that many
    seconds from the start of the last level (``profile-<service>.txt`` in ``out_dir``)."""
    port = 18000
    with socket.socket() as probe:  # a leftover stack would answer for this one
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is already serving: stop the old tandem up first")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out_dir.mkdir(parents=True, exist_ok=True)
    log = open(out_dir / "tandem_up.log", "wb")  # noqa: SIM115 - closed below
    up = subprocess.Popen(
        [sys.executable, "-m", "services", "up", "--model", str(folder), "--device", device,
         "--kv-cache-gib", str(kv_gib), "--gateway-port", str(port), "--mode", mode,
         "--prefill", "0" if mode == "colocated" else "1", "--decode", "1", "--worker-args", "--max-num-seqs 128", *up_args],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_ready(f"http://127.0.0.1:{port}", up, timeout=600, mode=mode)
        for c in concurrencies:  # one sweep per level: at least 2 requests per slot
            cmd = [sys.executable, "-m", "services", "bench", "serve",
                   "--base-url", f"http://127.0.0.1:{port}/v1", "--tokenizer", str(folder),
                   "--endpoint", "completions", "--no-progress",
                   "--input-tokens", str(prompt_len), "--output-tokens", str(out_len),
                   "--num-prompts", str(max(prompts_per_level, 2 * c)), "--concurrency", str(c),
                   "--output-dir", str(out_dir / f"serve-c{c}")]  # fmt: skip
            spies = _profile(out_dir, profile) if profile and c == concurrencies[-1] else []
            subprocess.run(cmd, cwd=REPO, env=env, check=True)
            for spy in spies:
                spy.wait(timeout=profile + 30)
    finally:
        _stop_group(up)
        log.close()
    found: dict[int, dict[str, float]] = {}
    for c in concurrencies:
        doc = json.loads((out_dir / f"serve-c{c}" / "results.json").read_text())
        found[c] = doc["servers"][0]["levels"][0]["summary"]
    return found


def _profile(out_dir: Path, seconds: float) -> list[subprocess.Popen[bytes]]:
    """Start ``py-spy record`` (raw collapsed stacks, without pausing the target) on each
    worker process of the stack; [] when py-spy is not installed."""
    spy = shutil.which("py-spy")
    if spy is None:
        logger.info("py-spy not found: no profile")
        return []
    started = []
    for service in ("decode", "prefill", "gateway"):
        found = subprocess.run(["pgrep", "-f", f"serve {service} "], capture_output=True, text=True)
        for pid in found.stdout.split()[:1]:
            started.append(subprocess.Popen(
                [spy, "record", "--pid", pid, "--duration", str(int(seconds)), "--rate", "200",
                 "--nonblocking", "--format", "raw", "--output", str(out_dir / f"profile-{service}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
    return started


def _ms(summary: dict, name: str, stat: str) -> float:
    """A latency percentile of a level's summary in ms (NaN when the level has none)."""
    dist = summary.get(name) or {}
    return float(dist.get(stat, float("nan"))) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-json", type=Path, required=True)
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prompts-per-level", type=int, default=16,
                        help="requests per level (at least twice the concurrency)")
    parser.add_argument("--kv-cache-gib", type=float, default=8.0)
    parser.add_argument("--mode", nargs="+", default=["disaggregated"],
                        choices=["disaggregated", "colocated"], help="tandem up --mode, each in turn")
    parser.add_argument("--device", default="cuda", help="cuda (cpu only to try the script)")
    parser.add_argument("--up-args", default="", help="more `tandem up` flags, one string")
    parser.add_argument("--profile", type=float, default=0.0,
                        help="seconds of py-spy sampling of each process at the last concurrency")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_served"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu_served_out")))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        logger.info("no CUDA device: nothing to measure")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    folder = args.work / args.shape
    t0 = time.perf_counter()
    vocab = write_folder(folder, args.shape, args.tokenizer_json, args.device)
    logger.info("wrote %s (vocab %d) in %.0f s", folder, vocab, time.perf_counter() - t0)
    off = offline(folder, args.concurrency, args.input_tokens, args.output_tokens, args.device)
    logger.info("offline: %s", off)
    results = {"offline": off}
    for mode in args.mode:
        on = served(folder, args.concurrency, args.input_tokens, args.output_tokens,
                    args.prompts_per_level, args.out / mode, args.kv_cache_gib, args.device,
                    mode, args.profile, tuple(shlex.split(args.up_args)))  # fmt: skip
        results[mode] = on
        (args.out / "gpu_served.json").write_text(json.dumps(results, indent=1))
        _report(args, vocab, mode, off, on)
    return 0


def _report(args: argparse.Namespace, vocab: int, mode: str, off: dict[int, dict[str, float]],
            on: dict[int, dict[str, float]]) -> None:
    """Log the served-against-offline table of one mode."""
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    lines = [f"device: {name}, shape {args.shape} (vocab {vocab}), tandem up --mode {mode} {args.up_args}, "
             f"{args.input_tokens} in / {args.output_tokens} out",
             "| concurrency | offline tok/s | offline step ms | served tok/s | served/offline "
             "| TTFT p50 ms | ITL p50 ms | ITL p99 ms |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in args.concurrency:
        s = on.get(c, {})
        tok = s.get("output_throughput", float("nan"))
        lines.append(
            f"| {c} | {off[c]['tok_s']:.0f} | {off[c]['step_ms']:.2f} | {tok:.0f} | "
            f"{tok / off[c]['tok_s']:.2f} | {_ms(s, 'ttft', 'p50'):.1f} | "
            f"{_ms(s, 'itl', 'p50'):.2f} | {_ms(s, 'itl', 'p99'):.2f} |"
        )
    if 1 in off and 1 in on:
        lines.append(f"ITL p50 at c=1 over the offline batch-1 step: "
                     f"{_ms(on[1], 'itl', 'p50') / off[1]['step_ms']:.2f}x")  # fmt: skip
    logger.info("\n%s", "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
