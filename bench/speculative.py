"""Speculative decoding served: ``tandem up`` with and without ``--speculative`` on a
copy-heavy workload, ``tandem bench serve`` against each, in one run.

    python bench/speculative.py [--model default gemma3-270m] [--concurrency 1 16]
        [--num-prompts 8] [--output-tokens 160] [--text-tokens 500] [--output-dir DIR]
        [--method ngram | --method draft --draft-model default --dtype float32 [--draft-kv build]]

``--method draft`` measures a draft model instead of prompt lookup (e.g. a quantized self-draft:
the served model as ``--dtype float32`` and its own 4-bit GGUF drafting with ``--draft-model
default``); ``--dtype`` applies to both runs.

The workload: chat requests asking the model to repeat a given text of about ``--text-tokens``
tokens (sentences drawn from a fixed pool with a fixed seed, so every prompt differs and every
run is the same), greedy, ending at EOS or ``--output-tokens``. Each model's stack is started
alone (nothing else on the machine's cores), first without speculation, then with it; the decode
worker's ``spec_decode_*`` counters are read before and after each level for the acceptance
rate. Greedy output is the same either way, so both runs generate the same tokens and output
tokens/s compare like with like. Prints one table; ``--output-dir`` keeps every sweep's
``results.json`` and the stacks' logs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout, too

from bench.serve_compare import _process  # noqa: E402  (start a stack, wait for ready, stop it)
from tests.ports import free_ports  # noqa: E402

logger = logging.getLogger("bench.speculative")

SENTENCES = [
    "The committee met on Tuesday to review the budget for the coming year.",
    "Three of the five proposals asked for more money for the harbour repairs.",
    "Dr. Amina Okafor presented the survey of the northern sea wall.",
    "She found that two sections had moved by more than four centimetres since 2019.",
    "The treasurer, Paul Lindqvist, warned that interest rates had risen twice.",
    "A motion to delay the library extension was carried by seven votes to four.",
    "Residents of Mill Lane submitted a petition about the new bus timetable.",
    "The petition carried 412 signatures and asked for an earlier morning service.",
    "Officers will report back on the cost of a second route by the end of March.",
    "The chair thanked the volunteers who cleaned the beach after the October storm.",
    "Water quality at the east pier has improved for the third year running.",
    "The next meeting will be held at the community hall at seven in the evening.",
    "Members asked for the minutes to be published online within ten working days.",
    "A grant of 25,000 pounds was approved for the youth football league.",
    "The league will use the money for floodlights and two new changing rooms.",
    "Councillor Reyes asked whether the floodlights would disturb nearby houses.",
]


QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "What are the main causes of inflation? Give three examples.",
    "Describe a day in the life of a medieval blacksmith.",
    "Give advice to someone starting to learn the piano as an adult.",
    "Why do leaves change colour in autumn?",
    "Plan a three-day trip to the mountains for a family with two children.",
    "Compare trains and planes for travelling between two cities 500 km apart.",
]


def chat_prompts(path: Path, count: int) -> None:
    """``count`` open-ended questions (little to copy): what speculation costs where it finds
    little to propose."""
    with path.open("w") as out:
        for i in range(count):
            messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
            out.write(json.dumps({"messages": messages}) + "\n")


def copy_prompts(path: Path, count: int, text_tokens: int, seed: int = 0) -> None:
    """``count`` chat requests, each asking to repeat a text of about ``text_tokens`` tokens
    (about 16 tokens a sentence)."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            sentences = [rng.choice(SENTENCES) for _ in range(max(1, text_tokens // 16))]
            text = " ".join(sentences)
            messages = [{"role": "user",
                         "content": f"Repeat the following text exactly, word for word:\n\n{text}"}]  # fmt: skip
            out.write(json.dumps({"messages": messages}) + "\n")


def counters(url: str) -> dict[str, float]:
    """The decode worker's speculative-decoding counters."""
    import urllib.request

    found: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("tandem:spec_decode_num_") and "{" not in line:
                name, value = line.split(" ")
                found[name] = float(value)
    return found


def sweep(args: argparse.Namespace, model: str, speculative: bool, prompts: Path,
          out: Path) -> list[dict[str, float]]:  # fmt: skip
    """Start the stack, run every level, stop it; per level: output tok/s, ITL p50 and the
    acceptance rate (drafts accepted / drafted) during that level."""
    tandem = Path(sys.executable).with_name("tandem")
    ports = free_ports(10)
    gateway, decode_metrics = ports[0], ports[1]
    flags = ["--gateway-port", str(gateway), "--decode-metrics-port", str(decode_metrics),
             "--decode-port", str(ports[2]), "--prefill-port", str(ports[3]),
             "--prefill-metrics-port", str(ports[4]), "--tokenizer-port", str(ports[5]),
             "--tokenizer-metrics-port", str(ports[6]), "--gateway-metrics-port", str(ports[7])]  # fmt: skip
    if args.dtype:
        flags += ["--dtype", args.dtype]
    if speculative:
        flags += ["--speculative", args.method, "--num-speculative-tokens", str(args.k)]
        if args.method == "draft":
            flags += ["--draft-model", args.draft_model, "--worker-args", f"--draft-kv {args.draft_kv}"]
    model_flags = [] if model == "default" else ["--model", model]
    argv = [str(tandem), "up", *model_flags, *flags]
    name = f"{model}-{args.method if speculative else 'off'}"
    rows = []
    metrics_url = f"http://127.0.0.1:{decode_metrics}/metrics"
    with _process(argv, f"http://127.0.0.1:{gateway}/ready", out / f"{name}.log", dict(os.environ)):
        for level in args.concurrency:
            before = counters(metrics_url)
            level_out = out / f"{name}-c{level}"
            subprocess.run([str(tandem), "bench", "serve", "--base-url", f"http://127.0.0.1:{gateway}/v1",
                            "--prompts-file", str(prompts), "--no-ignore-eos",
                            "--output-tokens", str(args.output_tokens),
                            "--num-prompts", str(args.num_prompts), "--concurrency", str(level),
                            "--tokenizer", model, "--output-dir", str(level_out), "--no-progress"],
                           check=True, stdout=subprocess.DEVNULL)  # fmt: skip
            after = counters(metrics_url)
            summary = json.loads((level_out / "results.json").read_text())["servers"][0]["levels"][0]["summary"]
            drafted = after.get("tandem:spec_decode_num_draft_tokens_total", 0) - before.get(
                "tandem:spec_decode_num_draft_tokens_total", 0)
            accepted = after.get("tandem:spec_decode_num_accepted_tokens_total", 0) - before.get(
                "tandem:spec_decode_num_accepted_tokens_total", 0)
            rows.append({"tok_s": summary["output_throughput"], "itl_p50": summary["itl"]["p50"],
                         "tokens": summary["output_tokens"], "failed": summary["failed"],
                         "drafted": drafted, "accepted": accepted})  # fmt: skip
            logger.info("%s c=%d: %.1f tok/s", name, level, summary["output_throughput"])
    return rows


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["default"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--num-prompts", type=int, default=8, help="requests per level")
    parser.add_argument("--output-tokens", type=int, default=160)
    parser.add_argument("--text-tokens", type=int, default=500)
    parser.add_argument("--k", type=int, default=8, help="--num-speculative-tokens")
    parser.add_argument("--workload", choices=["copy", "chat"], default="copy",
                        help="copy: repeat a given text (default); chat: open-ended questions")
    parser.add_argument("--method", choices=["ngram", "draft"], default="ngram")
    parser.add_argument("--draft-model", default="default", help="the draft method's model")
    parser.add_argument("--draft-kv", choices=["auto", "build"], default="auto",
                        help="the workers' --draft-kv: a handed-off prompt's draft KV adopted "
                             "from the target's (auto, a same-shape draft) or built")
    parser.add_argument("--dtype", default=None, help="the served model's --dtype (both runs)")
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = args.output_dir or Path(tempfile.mkdtemp(prefix="bench-speculative-"))
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / f"{args.workload}_prompts.jsonl"
    count = max(args.num_prompts, max(args.concurrency))
    if args.workload == "copy":
        copy_prompts(prompts, count, args.text_tokens)
        workload = f"copy-heavy chat (~{args.text_tokens}-token text to repeat)"
    else:
        chat_prompts(prompts, count)
        workload = "open-ended chat questions"
    lines = [f"CPU: {cpu_model()}, {os.cpu_count()} cores; {workload}, greedy, up to "
             f"{args.output_tokens} tokens, {args.num_prompts} "
             f"requests per level, k={args.k}, --speculative {args.method}"
             + (f" --draft-model {args.draft_model} --draft-kv {args.draft_kv}"
                if args.method == "draft" else "")
             + (f", --dtype {args.dtype}" if args.dtype else ""), "",
             f"| model | concurrency | off tok/s | {args.method} tok/s | speed-up | acceptance "
             f"| accepted / drafted | ITL p50 off → {args.method} |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for model in args.model:
        off = sweep(args, model, False, prompts, out)
        on = sweep(args, model, True, prompts, out)
        for level, a, b in zip(args.concurrency, off, on, strict=True):
            rate = b["accepted"] / b["drafted"] if b["drafted"] else 0.0
            lines.append(f"| {model} | {level} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | "
                         f"{b['tok_s'] / a['tok_s']:.2f}x | {rate:.0%} | {b['accepted']:.0f} / "
                         f"{b['drafted']:.0f} | {a['itl_p50'] * 1e3:.1f} → {b['itl_p50'] * 1e3:.1f} ms |")  # fmt: skip
            if a["failed"] or b["failed"]:
                lines.append(f"|  | {level} | failed: {a['failed']} / {b['failed']} | | | | | |")
    table = "\n".join(lines)
    (out / "results.md").write_text(table + "\n")
    sys.stdout.write("\n" + table + "\n")
    logger.info("results in %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
