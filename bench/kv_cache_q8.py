"""A ``q8_0`` KV cache against a float16 one (issue 44): what it saves and what it costs.

    python bench/kv_cache_q8.py speed GGUF [--context 4096] [--steps 24] [--rounds 3]
    python bench/kv_cache_q8.py accuracy [--context 4096] [--new-tokens 32] [--families ...]
    python bench/kv_cache_q8.py kernel [--shapes 32,8,64 16,8,128] [--context 4096] [--rounds 7]

``speed``: batch-1 decode step time at ``--context`` tokens of context, the file loaded as
``tandem up`` serves it (``--dtype auto``; the one-call C decode layers as the engine picks
them), one engine per KV dtype in the same process, rounds alternating (the baseline in the same
run). Each engine receives its context as a decode worker does after a hand-off
(``add_prefilled``): blocks filled with K/V of unit-variance random values in the pool's format
(a step's time does not depend on the values), then ``--steps`` greedy tokens one engine step
each; a round's figure is the mean step time, each dtype keeps its best round. Also prints KV
bytes per token. The 1B-class shape: ``python bench/random_gguf.py /tmp/l1b.gguf``.

``kernel``: one layer's decode attention call alone (the C kernel, batch 1, scattered 16-token
blocks), float16 and ``q8_0`` alternating, best of ``--rounds``; a shape is
``heads,kv_heads,head_dim`` (Llama-3.2-1B and Qwen3-1.7B by default).

``accuracy``: per family, a ``--context``-token prompt (this repository's docs as text, the same
ids for the random-weight families) with a float16 and a ``q8_0`` cache: greedy tokens equal to
the float16 cache's at the same position (out of ``--new-tokens``), and teacher-forced — the
prompt and float16's continuation as one prefill, whose attention reads each cache as decode
does — the largest absolute logit difference over the continuation's positions and how many
argmaxes agree. Families: the default model (SmolLM2-135M, Llama; real weights), Gemma 3 270M
(real weights), and random-weight checkpoints of Qwen3, Qwen3-MoE, Gemma 2, Gemma 3 and Phi-3 at
their real head sizes built offline with ``transformers`` (tests/test_model_families.py's
builders), all with float32 activations (``--dtype auto``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.core import kv_quant  # noqa: E402
from services.engine.core.attention import AttentionMetadata  # noqa: E402
from services.engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from services.engine.core.kernels.native_build import selected_isa  # noqa: E402
from services.engine.core.kv_cache import KVLayout, KVPool  # noqa: E402
from services.engine.core.loaders import LoadedModel, load_model  # noqa: E402

logger = logging.getLogger("bench.kv_cache_q8")
KV_DTYPES = ("float16", "q8_0")
BLOCK = 16
RANDOM_FAMILIES = ("qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3")


def _engine_with_context(loaded: LoadedModel, kv: str, context: int, steps: int) -> tuple[LLMEngine, list[int]]:
    """An engine whose pool holds random K/V in its format, and the blocks of a ``context``-token
    sequence with room for ``steps`` more tokens."""
    blocks = -(-(context + steps + 1) // BLOCK)
    engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK, num_blocks=blocks + 2, kv_cache_dtype=kv,
                                            enable_prefix_caching=False,
                                            max_model_len=context + steps + 2))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    pool, head_dim = engine.kv.data, engine.layout.head_dim
    with torch.inference_mode():
        for b in range(pool.shape[0]):  # block by block: a float32 copy of the pool may not fit
            values = torch.randn(*pool.shape[1:-1], head_dim, generator=gen)
            pool[b] = kv_quant.store_form(values, pool.dtype)
    ids = engine.block_manager.allocate(-(-context // BLOCK))
    return engine, ids


def _decode_ms(engine: LLMEngine, ids: list[int], context: int, steps: int, round_: int) -> float:
    """Mean ms of ``steps`` batch-1 decode steps of a ``context``-token sequence in ``ids``."""
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    prompt = [(7 * i + round_) % 1000 + 100 for i in range(context)]
    engine.add_prefilled(f"r{round_}", prompt, params, block_ids=list(ids), first_token_id=prompt[-1])
    engine.step()  # the first step: warm-up (kernels built, buffers sized)
    start, done = time.perf_counter(), 0
    while engine.has_unfinished():
        done += sum(len(out.new_token_ids) for out in engine.step())
    elapsed = (time.perf_counter() - start) * 1000 / max(done, 1)
    return elapsed


def speed(path: str, context: int, steps: int, rounds: int) -> None:
    loaded = load_model(path, "auto")
    c = loaded.config
    print(f"{Path(path).name}: {loaded.weight_format}, {c.num_layers} layers, {c.num_kv_heads} KV heads x "
          f"{c.head_dim}; ISA {selected_isa()}, {torch.get_num_threads()} threads; context {context}, "
          f"batch 1, {steps} steps per round, best of {rounds}")  # fmt: skip
    best = dict.fromkeys(KV_DTYPES, float("inf"))
    per_round: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
    for round_ in range(rounds):
        for kv in KV_DTYPES if round_ % 2 == 0 else KV_DTYPES[::-1]:
            engine, ids = _engine_with_context(loaded, kv, context, steps)
            ms = _decode_ms(engine, ids, context, steps, round_)
            per_round[kv].append(ms)
            best[kv] = min(best[kv], ms)
            del engine
    print("| KV cache | bytes per token | step ms, best | rounds | tok/s |")
    print("|---|---|---|---|---|")
    for kv in KV_DTYPES:
        layout = KVLayout(c.num_layers, BLOCK, c.num_kv_heads, c.head_dim, kv)
        rounds_ms = " / ".join(f"{ms:.1f}" for ms in per_round[kv])
        print(f"| {kv} | {layout.bytes_per_token:,} | {best[kv]:.2f} | {rounds_ms} | {1000 / best[kv]:.1f} |")
    print(f"q8_0 vs float16: {best['float16'] / best['q8_0']:.3f}x the decode speed")


def kernel(shapes: list[str], context: int, rounds: int) -> None:
    from services.engine.core.kernels.cpu_paged_attention import cpu_paged_decode_attention

    print(f"ISA {selected_isa()}, {torch.get_num_threads()} threads; one layer's decode attention, "
          f"batch 1, context {context}, best of {rounds}")  # fmt: skip
    print("| heads, KV heads, head dim | float16 µs | q8_0 µs | q8_0 vs float16 | K/V MB read f16 / q8_0 |")
    print("|---|---|---|---|---|")
    for shape in shapes:
        heads, kv_heads, dim = (int(x) for x in shape.split(","))
        per_seq = -(-context // BLOCK)
        gen = torch.Generator().manual_seed(0)
        tables = (torch.randperm(per_seq, generator=gen) + 1).view(1, per_seq)
        lens = torch.tensor([context])
        base = torch.randn(per_seq + 1, 2, BLOCK, kv_heads, dim, generator=gen)
        pools = {"float16": base.half(), "q8_0": kv_quant.quantize(base)}
        q = torch.randn(1, heads, dim, generator=gen)
        best = dict.fromkeys(KV_DTYPES, float("inf"))
        reps = max(1, int(4e7 // (context * kv_heads * dim)))
        for kv in KV_DTYPES:  # warm-up
            cpu_paged_decode_attention(q, pools[kv][:, 0], pools[kv][:, 1], tables, lens, dim**-0.5)
        for _ in range(rounds):
            for kv in KV_DTYPES:
                pool = pools[kv]
                start = time.perf_counter()
                for _ in range(reps):
                    cpu_paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, lens, dim**-0.5)
                best[kv] = min(best[kv], (time.perf_counter() - start) / reps)
        mb = [context * kv_heads * 2 * n / 1e6 for n in (2 * dim, kv_quant.row_bytes(dim))]
        print(f"| {heads}, {kv_heads}, {dim} | {best['float16'] * 1e6:.0f} | {best['q8_0'] * 1e6:.0f} | "
              f"{best['float16'] / best['q8_0']:.2f}x | {mb[0]:.1f} / {mb[1]:.1f} |")  # fmt: skip


def _prompt_ids(loaded: LoadedModel, context: int) -> list[int]:
    """``context`` token ids of this repository's docs (the model's tokenizer where it has one),
    within its vocabulary."""
    root = Path(__file__).resolve().parents[1]
    text = "\n\n".join(p.read_text() for p in sorted((root / "docs").glob("*.md")))
    ids: list[int] = []
    if loaded.source.kind == "gguf":  # the trained models: their own tokenizer
        from services.tokenizer.tokenizer import Tokenizer

        ids = Tokenizer.load(loaded.source).encode(text)
    if len(ids) < context:  # random-weight folders (no tokenizer): the text's bytes
        ids = [b % 250 + 3 for b in text.encode()]
    vocab = loaded.config.vocab_size
    return [i % vocab for i in ids[:context]]


@torch.inference_mode()
def _teacher_forced(loaded: LoadedModel, ids: list[int], kv: str, first: int) -> torch.Tensor:
    """Logits of positions ``first - 1 ..`` when ``ids`` is prefilled over a ``kv`` cache (a
    torch dtype's name or ``q8_0``) on the model's device."""
    c = loaded.config
    blocks = -(-len(ids) // BLOCK)
    device = next(loaded.model.parameters()).device
    pool = KVPool(blocks + 1, KVLayout(c.num_layers, BLOCK, c.num_kv_heads, c.head_dim, kv),
                  device=device)
    meta = AttentionMetadata.build(is_prefill=True, query_lens=[len(ids)], context_lens=[len(ids)],
                                   block_tables=[list(range(1, blocks + 1))], block_size=BLOCK,
                                   device=device)  # fmt: skip
    hidden = loaded.model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device),
                          pool, meta)  # fmt: skip
    return loaded.model.compute_logits(hidden[first - 1 :])


def agreement(name: str, loaded: LoadedModel, context: int, new_tokens: int,
              base: str = "float16", quantized: str = "q8_0") -> str:
    """One table row: ``quantized`` KV against ``base`` KV on a ``context``-token prompt (greedy
    tokens equal, teacher-forced argmax equal, largest logit difference)."""
    prompt = _prompt_ids(loaded, context)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    tokens = {}
    for kv in (base, quantized):
        engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK, kv_cache_dtype=kv,
                                                num_blocks=-(-(context + new_tokens) // BLOCK) + 2,
                                                max_model_len=context + new_tokens + 2))  # fmt: skip
        tokens[kv] = engine.generate([prompt], params)[0].new_token_ids
    pairs = list(zip(tokens[quantized], tokens[base], strict=True))
    same = sum(a == b for a, b in pairs)
    diverge = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    ids = prompt + tokens[base][:-1]
    stored = {"fp8": "float8_e4m3fn"}  # the flag's name -> the pool's dtype name
    ref = _teacher_forced(loaded, ids, stored.get(base, base), len(prompt)).float()
    got = _teacher_forced(loaded, ids, stored.get(quantized, quantized), len(prompt)).float()
    worst = (got - ref).abs().max().item()
    spread = ref.abs().max().item()
    argmax = int((got.argmax(-1) == ref.argmax(-1)).sum())
    c = loaded.config
    where = "none" if diverge is None else str(diverge)
    return (f"| {name} | {loaded.weight_format} | {c.num_kv_heads} x {c.head_dim} | {same} / {new_tokens} "
            f"(first difference: {where}) | {argmax} / {new_tokens} | {worst:.3g} | {spread:.3g} |")  # fmt: skip


def random_family(name: str, positions: int) -> str:
    """A folder holding a small random-weight checkpoint of family ``name`` (the builders of
    tests/test_model_families.py at the family's real head size) for ``positions`` tokens."""
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.test_model_families import FAMILIES

    build, _, head_dim = FAMILIES[name]
    torch.manual_seed(7)
    folder = tempfile.mkdtemp(prefix=f"kv-{name}-")
    model = build(transformers, head_dim)
    # the test builders' context (256 positions) is far under a long prompt's: widen it (rope
    # tables are computed, not stored, so the weights stay the same)
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, positions)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def accuracy(context: int, new_tokens: int, families: list[str]) -> None:
    from services.common.model_source import gemma3_270m_path

    print(f"context {context} tokens, {new_tokens} greedy tokens; ISA {selected_isa()}")
    print("| family (checkpoint) | weights | KV heads x head dim | greedy tokens equal to float16 KV's "
          "| teacher-forced argmax equal | max abs logit diff | max abs logit |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name in families:
        if name == "llama":
            loaded, label = load_model("default", "auto"), "Llama (SmolLM2-135M, trained)"
        elif name == "gemma3-270m":
            loaded, label = load_model(str(gemma3_270m_path()), "auto"), "Gemma 3 (270M, trained)"
        else:
            folder = random_family(name, context + new_tokens + 16)
            loaded, label = load_model(folder, "auto"), f"{name} (random weights, small)"
        print(agreement(label, loaded, context, new_tokens), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("gguf")
    s.add_argument("--context", type=int, default=4096)
    s.add_argument("--steps", type=int, default=24)
    s.add_argument("--rounds", type=int, default=3)
    k = sub.add_parser("kernel")
    k.add_argument("--shapes", nargs="+", default=["32,8,64", "16,8,128"])
    k.add_argument("--context", type=int, default=4096)
    k.add_argument("--rounds", type=int, default=7)
    a = sub.add_parser("accuracy")
    a.add_argument("--context", type=int, default=4096)
    a.add_argument("--new-tokens", type=int, default=32)
    a.add_argument("--families", nargs="+", default=["llama", "gemma3-270m", *RANDOM_FAMILIES])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.what == "speed":
        speed(args.gguf, args.context, args.steps, args.rounds)
    elif args.what == "kernel":
        kernel(args.shapes, args.context, args.rounds)
    else:
        accuracy(args.context, args.new_tokens, args.families)


if __name__ == "__main__":
    main()
