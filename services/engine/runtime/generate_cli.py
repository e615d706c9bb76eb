"""``tandem generate``: run prompts as one batch through the paged engine, offline.

The demo of the engine alone (no services): load the model and its tokenizer, render chat
prompts with the model's template, generate all prompts together, print the text (or one JSON
object per prompt with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from services.common.model_source import resolve_model
from services.common.sampling_params import SamplingParams
from services.engine.runtime.worker_options import (
    DTYPE_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    add_speculative_arguments,
    speculative_from_args,
)

logger = logging.getLogger(__name__)


class _Ordered(argparse.Action):
    """Collect ``--prompt`` and ``--chat`` in the order given, tagged by kind."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        items = list(getattr(namespace, "inputs", None) or [])
        items.append((self.dest, values))
        namespace.inputs = items


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="default | PATH to a .gguf file or Hugging Face folder (env TANDEM_MODEL)")
    parser.add_argument("--prompt", action=_Ordered, dest="prompt", help="raw text prompt (repeatable)")
    parser.add_argument("--chat", action=_Ordered, dest="chat",
                        help="user message rendered with the chat template (repeatable)")
    parser.add_argument("--system", default=None, help="system message for --chat prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="auto (default) | float32 | bfloat16 | float16 | q8_0 | q4")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default="auto",
                        help="auto (default) | float32 | bfloat16 | float16 | q8_0, as for the workers")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    add_speculative_arguments(parser)
    parser.set_defaults(inputs=[])


def run(args: argparse.Namespace) -> int:
    import torch

    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model, parse_dtype
    from services.engine.runtime.output_text import OutputText
    from services.engine.runtime.worker_runtime import load_draft
    from services.tokenizer.tokenizer import Tokenizer

    if not args.inputs:
        print("tandem generate: give at least one --prompt or --chat", file=sys.stderr)
        return 2
    source = resolve_model(args.model or os.environ.get("TANDEM_MODEL", "default"))
    loaded = load_model(source, parse_dtype(args.dtype))
    tokenizer = Tokenizer.load(source)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
    ).validate()
    prompts: list[list[int]] = []
    for kind, text in args.inputs:
        if kind == "chat":
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": text})
            prompts.append(tokenizer.encode_chat(messages, add_generation_prompt=True))
        else:
            prompts.append(tokenizer.encode(text))
    spec = speculative_from_args(args)
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=max(64, len(prompts)),
                                            kv_cache_dtype=args.kv_cache_dtype, speculative=spec),
                       draft=load_draft(spec, loaded, tokenizer, "cpu"),
                       eos_token_ids=tokenizer.eos_token_ids or None)
    with torch.inference_mode():
        outputs = engine.generate(prompts, params, output_filter=OutputText(tokenizer))
    for (kind, text), prompt, out in zip(args.inputs, prompts, outputs):
        if args.json:
            record = {
                "prompt": text,
                "kind": kind,
                "text": out.text,
                "token_ids": out.new_token_ids,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(out.new_token_ids),
                "finish_reason": out.finish_reason,
            }
            sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            sys.stdout.write(f"--- {kind}: {text}\n{out.text}\n[{out.finish_reason}]\n")
    sys.stdout.flush()
    return 0
