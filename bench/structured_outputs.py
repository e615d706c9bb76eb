"""What a JSON schema costs per output token: decode tokens/s with and without one, same engine,
same prompts, rounds taking turns.

    python bench/structured_outputs.py [--model default] [--batches 1 16] [--tokens 128] [--rounds 3]

Each row runs ``batch`` chat prompts for exactly ``--tokens`` output tokens: unconstrained with
``ignore_eos``, constrained by a schema that cannot finish sooner (an array of at least 64 small
objects), so both produce the same number of tokens and the only difference is the grammar: the
matchers, the masks (started on a helper thread when the step is scheduled) and the masked
sampling (a constrained row leaves the greedy fast path). Also the masks' own cost: the helper
thread's time per step, and per row.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 64, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "age"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False,
}  # fmt: skip


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import llguidance

    from services.common.model_source import resolve_model
    from services.common.sampling_params import SamplingParams
    from services.engine.core.grammar import GrammarMasks
    from services.engine.runtime.worker_options import WorkerOptions
    from services.engine.runtime.worker_runtime import build_engine
    from services.gateway.structured_outputs import JSON_LAYOUT
    from services.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model(args.model))
    engine, _ = build_engine(WorkerOptions(model=args.model, num_blocks=2048,
                                           max_num_seqs=max(args.batches)), tokenizer=tokenizer)  # fmt: skip
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=JSON_LAYOUT)
    fill_times: list[tuple[int, float]] = []  # (rows, seconds) of each helper-thread fill
    real_fill = GrammarMasks._fill

    def timed_fill(self: GrammarMasks, matchers: list[Any]) -> Any:
        started = time.perf_counter()
        out = real_fill(self, matchers)
        fill_times.append((sum(m is not None for m in matchers), time.perf_counter() - started))
        return out

    GrammarMasks._fill = timed_fill  # type: ignore[method-assign]
    topics = ["a team of engineers", "a school class", "a football club", "a choir", "a crew"]

    def run(batch: int, constrained: bool, seed: int) -> float:
        prompts = [tokenizer.encode_chat([{"role": "user", "content":
                   f"List the members of {topics[i % len(topics)]} number {seed}-{i} with ages."}],
                   add_generation_prompt=True) for i in range(batch)]  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                                grammar=grammar if constrained else None)  # fmt: skip
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{seed}-{i}", prompt, params)
        tokens, decode_s = 0, 0.0
        while engine.has_unfinished():
            started = time.perf_counter()
            outs = engine.step()
            elapsed = time.perf_counter() - started
            if all(s.output_token_ids for s in engine.scheduler.running) and not engine.scheduler.waiting:
                decode_s += elapsed  # decode steps only (every running sequence has its prompt)
                tokens += sum(len(o.new_token_ids) for o in outs)
        return tokens / decode_s

    print(f"{_cpu()}; model {args.model}; {args.tokens} output tokens per request; "
          f"best of {args.rounds} rounds, taking turns")
    print("| batch | unconstrained tok/s | JSON schema tok/s | constrained / unconstrained | "
          "mask fill per step (helper thread) | per row |")
    print("|---|---|---|---|---|---|")
    seed = 0
    for batch in args.batches:
        run(batch, True, seed := seed + 1)  # warm-up: compile the grammar, first shapes
        free: list[float] = []
        constrained: list[float] = []
        fills: list[tuple[int, float]] = []
        for _ in range(args.rounds):
            free.append(run(batch, False, seed := seed + 1))
            fill_times.clear()
            constrained.append(run(batch, True, seed := seed + 1))
            fills += fill_times
        per_step = statistics.median(t for _, t in fills) * 1e3
        per_row = statistics.median(t / rows for rows, t in fills if rows) * 1e6
        print(f"| {batch} | {max(free):.1f} | {max(constrained):.1f} | "
              f"{max(constrained) / max(free):.3f} | {per_step:.2f} ms | {per_row:.0f} µs |",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
