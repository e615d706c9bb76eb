"""``tandem bench serve``: sweep load levels against OpenAI-compatible servers and report.

Lifecycle of one invocation:

1. Check the flags: the servers (``--base-url``, or ``--compare NAME=URL[@MODEL] ...``), the
   levels (``--concurrency`` values first, then ``--request-rate`` values; ``--concurrency 1``
   when neither is given), the SLO.
2. Load the tokenizer (``--tokenizer``, Tandem's default model's by default) and build every
   level's requests up front (``workload.py``), so prompt building is never timed.
3. Per server, one after another: find its model (``GET /models`` unless given), send the
   warm-up requests one at a time (a 4xx naming ``ignore_eos`` or ``stream_options`` drops that
   field for the rest of the run, with a warning), then run every level (``runner.py``) and
   summarize it (``metrics.py``).
4. Print the markdown table (``report.py``) to stdout; with ``--output-dir``, write
   ``results.json`` (configuration, every summary and every request), ``results.md`` and the
   PNG figures (``plots.py``).

Exit status 0 once the sweep finished, whatever the requests' errors (they are in the table);
2 for a bad flag, a missing tokenizer or a server whose model cannot be found.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from services.common.errors import InvalidArgumentError
from services.common.model_source import resolve_model
from services.loadgen.client import ClientOptions, StreamingClient
from services.loadgen.metrics import Slo, summarize
from services.loadgen.report import markdown_table, results_document, write_json
from services.loadgen.results import Level, LevelResult, ServerRun
from services.loadgen.runner import run_level
from services.loadgen.target import Target, model_id, normalize_base_url, parse_compare
from services.loadgen.workload import RequestSpec, Workload, WorkloadConfig, load_prompts_file
from services.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_ARRIVAL_SEED_STRIDE = 1_000_003


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tandem bench serve``."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", help="the server's OpenAI base URL, e.g. "
                        "http://127.0.0.1:8000/v1 (/v1 is added to a URL without a path)")
    server.add_argument("--compare", nargs="+", metavar="NAME=URL[@MODEL]",
                        help="run the same sweep against several servers, one after another")
    server.add_argument("--model", help="model to ask for (default: the first id of GET /models)")
    server.add_argument("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    server.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                        help="/chat/completions or /completions (default chat)")
    server.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="seconds one request may take (default 300)")
    work = parser.add_argument_group("workload")
    work.add_argument("--tokenizer", default="default", metavar="PATH",
                      help="tokenizer that counts tokens: a .gguf file or Hugging Face folder "
                      "(default: Tandem's default model)")
    work.add_argument("--input-tokens", type=int, default=128, metavar="N",
                      help="mean prompt length of synthetic prompts (default 128)")
    work.add_argument("--input-tokens-stdev", type=float, default=0.0, metavar="S")
    work.add_argument("--output-tokens", type=int, default=128, metavar="M",
                      help="max_tokens of each request (default 128)")
    work.add_argument("--output-tokens-stdev", type=float, default=0.0, metavar="S")
    work.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                      help="send ignore_eos: true so every request produces max_tokens tokens "
                      "(default yes)")
    work.add_argument("--extra-body", metavar="JSON",
                      help='a JSON object merged into every request, e.g. '
                           '\'{"response_format": {"type": "json_object"}}\'')
    work.add_argument("--temperature", type=float, default=0.0, metavar="T",
                      help="default 0 (greedy)")
    work.add_argument("--prompts-file", metavar="F.jsonl",
                      help='one JSON object per line: "prompt" or "messages", optional '
                      '"max_tokens" (instead of synthetic prompts)')
    work.add_argument("--num-prompts", type=int, default=50, metavar="N",
                      help="requests per level (default 50)")
    work.add_argument("--seed", type=int, default=0,
                      help="seeds prompt lengths, prompts and arrival times (default 0)")
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", type=int, nargs="+", default=[], metavar="C",
                      help="levels with C requests in flight")
    load.add_argument("--request-rate", type=float, nargs="+", default=[], metavar="R",
                      help="levels with Poisson arrivals at R requests/s (inf: all at once)")
    load.add_argument("--max-concurrency", type=int, default=None, metavar="C",
                      help="cap on requests in flight during --request-rate levels")
    load.add_argument("--warmup", type=int, default=1, metavar="N",
                      help="warm-up requests first (default 1)")
    out = parser.add_argument_group("results")
    out.add_argument("--slo", metavar="KEY=SECONDS,...",
                     help="goodput bounds in seconds, e.g. ttft=0.5,tpot=0.05[,e2e=10]")
    out.add_argument("--output-dir", type=Path, metavar="DIR",
                     help="write results.json, results.md and PNGs")
    out.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                     help="a progress bar on stderr (default yes)")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tandem bench serve``."""
    targets = _targets(args)
    levels = _levels(args)
    _check_workload_flags(args)
    slo = Slo.parse(args.slo) if args.slo else None
    options = ClientOptions(endpoint=args.endpoint, api_key=args.api_key,
                            ignore_eos=args.ignore_eos, temperature=args.temperature,
                            timeout_s=args.timeout,
                            extra_body=_extra_body(args.extra_body))  # fmt: skip
    tokenizer = Tokenizer.load(resolve_model(args.tokenizer))
    workload = _workload(args, tokenizer)
    level_specs = [workload.level(position) for position in range(len(levels))]
    warmup_specs = workload.warmup(args.warmup)
    runs = asyncio.run(_sweep(args, targets, levels, level_specs, warmup_specs, options,
                              workload.count_tokens, slo))  # fmt: skip
    text = _header(args, runs, tokenizer.name) + "\n\n" + markdown_table(runs, slo is not None)
    print(text, flush=True)
    if args.output_dir is not None:
        _write_outputs(args, runs, levels, slo, tokenizer.name, text)
    return 0


def _extra_body(raw: str | None) -> dict[str, Any]:
    """``--extra-body``: a JSON object merged into every request's body."""
    if raw is None:
        return {}
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise InvalidArgumentError(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidArgumentError("--extra-body must be a JSON object")
    return obj


def _targets(args: argparse.Namespace) -> list[Target]:
    if args.compare and args.base_url:
        raise InvalidArgumentError("give --base-url or --compare, not both")
    if args.compare:
        targets = parse_compare(args.compare)
        return [t if t.model else Target(t.name, t.base_url, args.model) for t in targets]
    if not args.base_url:
        raise InvalidArgumentError("give the server with --base-url URL (or --compare)")
    url = normalize_base_url(args.base_url)
    return [Target(url, url, args.model)]


def _levels(args: argparse.Namespace) -> list[Level]:
    if any(c < 1 for c in args.concurrency):
        raise InvalidArgumentError("--concurrency levels must be at least 1")
    if any(not r > 0 for r in args.request_rate):
        raise InvalidArgumentError("--request-rate levels must be positive (or inf)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise InvalidArgumentError("--max-concurrency must be at least 1")
    levels = [Level("concurrency", float(c)) for c in args.concurrency]
    levels += [Level("rate", float(r)) for r in args.request_rate]
    return levels or [Level("concurrency", 1.0)]


def _check_workload_flags(args: argparse.Namespace) -> None:
    if args.input_tokens < 1 or args.output_tokens < 1 or args.num_prompts < 1:
        raise InvalidArgumentError(
            "--input-tokens, --output-tokens and --num-prompts must be at least 1"
        )
    if args.warmup < 0 or args.timeout <= 0:
        raise InvalidArgumentError("--warmup must be >= 0 and --timeout positive")


def _workload(args: argparse.Namespace, tokenizer: Tokenizer) -> Workload:
    entries: list[RequestSpec] | None = None
    if args.prompts_file:
        entries = load_prompts_file(args.prompts_file, tokenizer, args.output_tokens)
        if args.endpoint == "completions" and any(e.messages is not None for e in entries):
            raise InvalidArgumentError(
                f"{args.prompts_file} has chat messages: use --endpoint chat"
            )
    config = WorkloadConfig(
        num_prompts=args.num_prompts, input_tokens=args.input_tokens,
        input_tokens_stdev=args.input_tokens_stdev, output_tokens=args.output_tokens,
        output_tokens_stdev=args.output_tokens_stdev, seed=args.seed,
    )  # fmt: skip
    return Workload(config, tokenizer, entries)


async def _sweep(
    args: argparse.Namespace,
    targets: Sequence[Target],
    levels: Sequence[Level],
    level_specs: Sequence[Sequence[RequestSpec]],
    warmup_specs: Sequence[RequestSpec],
    options: ClientOptions,
    count_tokens: Callable[[str], int],
    slo: Slo | None,
) -> list[ServerRun]:
    runs = []
    for target in targets:
        # No pool cap (the level sets the load), and a connection of its own per request:
        # llama.cpp's server closes a connection after a streamed answer, and a pooled one it
        # closed fails the next request at its first write (half of them, measured).
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            model = target.model or await model_id(session, target, args.api_key)
            target = replace(target, model=model)
            run = ServerRun(target.name, target.base_url, model)
            client = StreamingClient(session, target, options, count_tokens)
            await _warm_up(client, warmup_specs, run)
            for position, (level, specs) in enumerate(zip(levels, level_specs)):
                duration, records = await run_level(
                    client.send, specs, level,
                    seed=args.seed * _ARRIVAL_SEED_STRIDE + position,
                    max_concurrency=args.max_concurrency, progress=args.progress,
                    description=f"{target.name} {level.label}",
                )  # fmt: skip
                summary = summarize(records, duration, slo)
                run.levels.append(LevelResult(level, duration, tuple(records), summary))
                logger.info(
                    "%s %s: %d/%d ok, %.1f output tok/s, %d errors", target.name, level.label,
                    summary.completed, summary.requests, summary.output_throughput,
                    summary.failed,
                )  # fmt: skip
            runs.append(run)
    return runs


async def _warm_up(client: StreamingClient, specs: Sequence[RequestSpec], run: ServerRun) -> None:
    """Send the warm-up requests one by one; drop an optional field the server refuses."""
    for spec in specs:
        record = await client.send(spec)
        while not record.ok and (dropped := client.drop_field(record)) is not None:
            logger.warning("%s refused %s (%s); sending without it", run.name, dropped,
                           record.error)  # fmt: skip
            run.dropped_fields.append(dropped)
            record = await client.send(spec)
        if not record.ok:
            message = f"{record.error_kind}: {record.error}"
            logger.warning("%s warm-up request failed: %s", run.name, message)
            run.warmup_errors.append(message)


def _header(args: argparse.Namespace, runs: Sequence[ServerRun], tokenizer: str) -> str:
    if args.prompts_file:
        work = f"prompts from {args.prompts_file}"
    else:
        work = (f"synthetic prompts of {args.input_tokens} tokens"
                f"{_stdev(args.input_tokens_stdev)} by the {tokenizer} tokenizer")  # fmt: skip
    lines = [
        f"tandem bench serve: {args.endpoint} endpoint, {work}, max_tokens {args.output_tokens}"
        f"{_stdev(args.output_tokens_stdev)}, ignore_eos {'on' if args.ignore_eos else 'off'}, "
        f"{args.num_prompts} requests per level, {args.warmup} warm-up"
        + (f", extra body {args.extra_body}" if args.extra_body else ""),
    ]
    lines += [f"- {run.name}: {run.base_url}, model {run.model}" if run.name != run.base_url
              else f"- {run.base_url}, model {run.model}" for run in runs]  # fmt: skip
    return "\n".join(lines)


def _stdev(value: float) -> str:
    return f" (stdev {value:g})" if value > 0 else ""


def _write_outputs(
    args: argparse.Namespace,
    runs: Sequence[ServerRun],
    levels: Sequence[Level],
    slo: Slo | None,
    tokenizer: str,
    text: str,
) -> None:
    from services.loadgen.plots import write_plots

    out: Path = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if isinstance(v, (str, int, float, bool, list, Path, type(None)))}  # fmt: skip
    config.update(tokenizer_name=tokenizer, slo=slo.to_json() if slo else None,
                  levels=[level.to_json() for level in levels])  # fmt: skip
    write_json(out / "results.json", results_document(runs, config, sys.argv))
    (out / "results.md").write_text(text + "\n")
    write_plots(out, runs)
    logger.info("results in %s", out)
