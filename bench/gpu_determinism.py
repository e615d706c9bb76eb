"""Greedy determinism on the GPU: does the same greedy request give the same tokens (and the same
logprob bits) on every path a request can take, with ``--device cuda``?

    python bench/gpu_determinism.py [--dtype float32 bfloat16] [--hidden 512] [--layers 4]
                                    [--kv-cache-dtype fp8]

Without a CUDA device it says so and exits 0. On CPU the guarantee is tested in CI
(``tests/test_deterministic_greedy.py``: the native kernels compute each position the same way
whatever the batch). On a GPU, cuBLAS and the Triton kernels choose their reduction order by
shape, so a row's numbers may depend on the batch it ran in; this script measures how often
that changes the *tokens* and not only the last bits of the logprobs. It runs one random Llama
(weights made on the CPU) through the paths of the CPU test: cold, a full prefix-cache hit, a
batch of 16, chunked prefill (7-token chunks), prefilled on one engine and decoded on another,
and resumed after 5 tokens; for several prompts, with CUDA graphs and eagerly. Prints a table:
per dtype and path, prompts whose tokens differ from the cold run and prompts whose logprobs
differ in any bit. ``--kv-cache-dtype`` runs every engine with that KV cache (``fp8``: the cold
run attends to its prompt's K/V as the cache holds them, so no path should differ more than with
the model's own dtype).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

logger = logging.getLogger("bench.gpu_determinism")
BLOCK = 16
Result = tuple[list[int], list[float | None]]


def _result(out: object) -> Result:
    return out.new_token_ids, [lp.logprob if lp is not None else None for lp in out.new_logprobs]  # type: ignore[attr-defined]


def _drain(engine: object) -> list[object]:
    outs: list[object] = []
    while engine.has_unfinished():  # type: ignore[attr-defined]
        outs.extend(engine.step())  # type: ignore[attr-defined]
    return outs


def _follow(outs: list[object]) -> Result:
    got: Result = ([], [])
    for out in outs:
        got[0].extend(out.new_token_ids)  # type: ignore[attr-defined]
        got[1].extend(lp.logprob if lp is not None else None for lp in out.new_logprobs)  # type: ignore[attr-defined]
    return got


def paths(loaded: object, prompt: list[int], others: list[list[int]], graphs: bool,
          tokens: int, kv_cache_dtype: str | None = None) -> dict[str, Result]:
    """Each path's result for ``prompt`` (the cold one first)."""
    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=0)

    def config(**extra: object) -> EngineConfig:
        base: dict[str, object] = dict(block_size=BLOCK, num_blocks=600, cuda_graphs=graphs,
                                       kv_cache_dtype=kv_cache_dtype)
        base.update(extra)
        return EngineConfig(**base)  # type: ignore[arg-type]

    got: dict[str, Result] = {}
    cold = LLMEngine(loaded, config(enable_prefix_caching=False))  # type: ignore[arg-type]
    got["cold"] = _result(cold.generate([prompt], params)[0])
    cached = LLMEngine(loaded, config())  # type: ignore[arg-type]
    cached.generate([prompt], params)
    got["full prefix hit"] = _result(cached.generate([prompt], params)[0])
    got["batched with 15 others"] = _result(cold.generate([prompt, *others], params)[0])
    chunked = LLMEngine(loaded, config(enable_prefix_caching=False, max_num_batched_tokens=7))  # type: ignore[arg-type]
    got["chunked prefill"] = _result(chunked.generate([prompt], params)[0])
    prefill = LLMEngine(loaded, config())  # type: ignore[arg-type]
    decode = LLMEngine(loaded, config())  # type: ignore[arg-type]
    prefill.add_request("r", prompt, params, prefill_only=True)
    (done,) = [o for o in _drain(prefill) if o.finish_reason == "prefilled"]  # type: ignore[attr-defined]
    dest = decode.block_manager.allocate(len(done.block_ids))
    decode.kv.write_blocks(dest, prefill.kv.read_blocks(done.block_ids))
    prefill.release_blocks(done.block_ids)
    decode.add_prefilled("r", prompt, params, block_ids=dest, first_token_id=done.new_token_ids[0],
                         first_logprob=done.new_logprobs[0])  # fmt: skip
    first = _result(done)
    rest = _follow(_drain(decode))
    got["prefilled here, decoded there"] = (first[0] + rest[0], first[1] + rest[1])
    migrated = LLMEngine(loaded, config())  # type: ignore[arg-type]
    migrated.add_request("m", prompt, params, resume_output_ids=got["cold"][0][:5])
    resumed = _follow(_drain(migrated))
    got["resumed after 5 tokens"] = (got["cold"][0][:5] + resumed[0],
                                     got["cold"][1][:5] + resumed[1])  # fmt: skip
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--kv-cache-dtype", default=None, help="every engine's (default: the model's)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.info("no CUDA device: nothing to measure")
        return 0
    from services.engine.core.loaders import load_model
    from tests.tiny_stack import write_tiny_model

    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[tuple[str, str, str, int, int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_model(Path(tmp) / "model", args.vocab, context=2048,
                                  hidden=args.hidden, layers=args.layers, heads=8)  # fmt: skip
        for dtype in args.dtype:
            loaded = load_model(str(folder), dtype, "cuda")
            for graphs in (True, False):
                diff_tokens: dict[str, int] = {}
                diff_bits: dict[str, int] = {}
                for seed in range(args.prompts):
                    rng = random.Random(seed)
                    prompt = [rng.randrange(3, args.vocab) for _ in range(2 * BLOCK + 1)]
                    others = [[rng.randrange(3, args.vocab) for _ in range(rng.randrange(3, 70))]
                              for _ in range(15)]  # fmt: skip
                    got = paths(loaded, prompt, others, graphs, args.tokens, args.kv_cache_dtype)
                    for name, result in got.items():
                        diff_tokens[name] = diff_tokens.get(name, 0) + (result[0] != got["cold"][0])
                        diff_bits[name] = diff_bits.get(name, 0) + (result != got["cold"])
                for name in diff_tokens:
                    if name != "cold":
                        rows.append((dtype, "graphs" if graphs else "eager", name,
                                     diff_tokens[name], diff_bits[name]))  # fmt: skip
    print(f"\n{torch.cuda.get_device_name()}: {args.prompts} prompts of {2 * BLOCK + 1} tokens, "
          f"{args.tokens} greedy tokens, random Llama {args.layers}x{args.hidden}, KV cache "
          f"{args.kv_cache_dtype or 'the model dtype'}")
    print("| dtype | decode | path | prompts whose tokens differ from cold | logprob bits differ |")
    print("|---|---|---|---|---|")
    for dtype, mode, name, tokens, bits in rows:
        print(f"| {dtype} | {mode} | {name} | {tokens}/{args.prompts} | {bits}/{args.prompts} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
