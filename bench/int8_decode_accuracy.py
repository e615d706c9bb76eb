"""What ``q4_a8``'s int8 decode rows cost in tokens: docs/models.md's agreement with float32.

    python bench/int8_decode_accuracy.py [--model default|gemma3-270m] [--tokens 64]

Loads the model as ``float32``, as ``q4_a8`` (the 4-bit layers' rows rounded to int8) and as
``q4_a8_decode`` (every layer the int8 decode kernel reads), and on
the 8 prompts of the model's tests (SmolLM2: ``tests/test_quantized_model.py``'s chats; Gemma 3
270M: ``tests/test_gemma3_gguf.py``'s) reports against float32: free-running greedy tokens equal
at the same position and each prompt's common prefix; teacher-forced over float32's continuation
(one prefill of prompt + continuation: every row computed as the engine computes any row), argmax agreement, max |logit diff| and KL per prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import services.engine.core.model_runner as model_runner  # noqa: E402
from services.common.model_source import resolve_model  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from services.engine.core.linear import Linear  # noqa: E402
from services.engine.core.loaders import LoadedModel, load_model  # noqa: E402
from tests.test_quantized_model import CHATS, agreement, prefill_logits  # noqa: E402


def prompts_for(model: str) -> list[list[int]]:
    if model == "default":
        return CHATS
    from services.common.model_source import GEMMA3_270M_NAME, ModelSource, gemma3_270m_path
    from services.tokenizer.tokenizer import Tokenizer
    from tests.test_gemma3_gguf import _prompts

    return _prompts(Tokenizer.load(ModelSource("gguf", str(gemma3_270m_path()), GEMMA3_270M_NAME)))


def load(model: str, dtype: str, int8_decode: bool) -> tuple[LoadedModel, LLMEngine]:
    original = model_runner.pack_plan

    def plan(*args, **kwargs):  # type: ignore[no-untyped-def]
        made = original(*args, **kwargs)
        return None if made is None else dataclasses.replace(made, int8_decode=int8_decode)

    model_runner.pack_plan = plan
    try:
        loaded = load_model(resolve_model(model), dtype)
        return loaded, LLMEngine(loaded, EngineConfig(num_blocks=512))
    finally:
        model_runner.pack_plan = original


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    prompts = prompts_for(args.model)
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    f32, f32_engine = load(args.model, "float32", False)
    reference = [o.new_token_ids for o in f32_engine.generate(prompts, greedy)]
    total = sum(map(len, reference))
    print(f"{args.model}: {len(prompts)} prompts x {args.tokens} greedy tokens against float32; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    for name, int8_decode in (("q4_a8 (4-bit layers int8)", False), ("q4_a8_decode (every int8-capable layer)", True)):
        quant, engine = load(args.model, "q4_a8", int8_decode)
        layers = [m for m in quant.model.modules() if isinstance(m, Linear) and m.packed is not None]
        rounded = sum(layer.int8_activations for layer in layers)
        tokens = [o.new_token_ids for o in engine.generate(prompts, greedy)]
        same, prefixes = agreement(tokens, reference)
        teacher, worst, kls = 0, 0.0, []
        with torch.inference_mode():
            for prompt, continuation in zip(prompts, reference, strict=True):
                ids = prompt + continuation
                got = prefill_logits(quant, ids)  # every row as the engine computes it
                dense = prefill_logits(f32, ids)
                span = slice(len(prompt) - 1, len(ids) - 1)
                worst = max(worst, (got[span] - dense[span]).abs().max().item())
                picks = got[span].argmax(-1).tolist()
                teacher += sum(a == b for a, b in zip(picks, continuation, strict=True))
                kls.append(torch.nn.functional.kl_div(
                    got[span].log_softmax(-1), dense[span].log_softmax(-1), log_target=True,
                    reduction="batchmean",
                ).item())  # fmt: skip
        print(f"| {name} ({rounded}/{len(layers)} layers int8) | free-running "
              f"{same}/{total}, common prefixes {prefixes} | teacher-forced {teacher}/{total} | "
              f"max |logit diff| {worst:.2f} | KL {min(kls):.4f}-{max(kls):.4f} |", flush=True)
        del quant, engine
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
