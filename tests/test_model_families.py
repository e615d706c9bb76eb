"""Every model family against Hugging Face transformers on the same random weights (float32).

``transformers`` builds each family from its own config class offline and saves it
(``save_pretrained``); Tandem loads the folder through its registry. Per family:

* a batched prefill of prompts of different lengths — some longer than the sliding window —
  through the paged cache gives each prompt's logits to ~1e-4;
* the engine's greedy tokens (prefill, then paged decode steps past the window) equal
  ``transformers``' ``generate``;
* the features a family adds are really exercised: turning them off changes the logits.

Tiny shapes keep it fast; ``realistic`` variants use each family's real head size (Gemma's 256,
Qwen3's 128, Phi's 96).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.engine.core.attention import AttentionMetadata
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.kv_cache import KVLayout, KVPool
from services.engine.core.loaders import LoadedModel, load_model

pytestmark = pytest.mark.slow

ATOL = 1e-4
BLOCK = 4
WINDOW = 8


def _tiny(head_dim: int) -> dict[str, Any]:
    heads = 4
    return dict(
        vocab_size=256, hidden_size=64 if head_dim <= 32 else heads * head_dim // 2,
        intermediate_size=128, num_hidden_layers=3, num_attention_heads=heads,
        num_key_value_heads=2, head_dim=head_dim, initializer_range=0.08,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def _qwen3(t: Any, head_dim: int) -> Any:
    return t.Qwen3ForCausalLM(t.Qwen3Config(**_tiny(head_dim), tie_word_embeddings=False))


def _qwen3_moe(t: Any, head_dim: int) -> Any:
    cfg = t.Qwen3MoeConfig(**_tiny(head_dim), num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True)  # fmt: skip
    return t.Qwen3MoeForCausalLM(cfg)


def _gemma3(t: Any, head_dim: int) -> Any:
    cfg = t.Gemma3TextConfig(
        **_tiny(head_dim), sliding_window=WINDOW, query_pre_attn_scalar=head_dim,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    )  # fmt: skip
    return t.Gemma3ForCausalLM(cfg)


def _gemma2(t: Any, head_dim: int) -> Any:
    cfg = t.Gemma2Config(**_tiny(head_dim), sliding_window=WINDOW, query_pre_attn_scalar=head_dim,
                         attn_logit_softcapping=5.0, final_logit_softcapping=3.0)  # fmt: skip
    return t.Gemma2ForCausalLM(cfg)


def _phi3(t: Any, head_dim: int) -> Any:
    """LongRoPE and Phi-4-mini's partial rotation (the first 3/4 of each head rotates)."""
    kw = _tiny(head_dim)
    kw.pop("head_dim")
    kw["hidden_size"] = 4 * head_dim
    rot = int(head_dim * 0.75) // 2
    cfg = t.Phi3Config(
        **kw, original_max_position_embeddings=64, partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(rot)],
                      "long_factor": [2.0 + 0.5 * i for i in range(rot)]},
    )  # fmt: skip
    return t.Phi3ForCausalLM(cfg)


FAMILIES: dict[str, tuple[Callable[[Any, int], Any], int, int]] = {
    # name: (builder, tiny head_dim, realistic head_dim)
    "qwen3": (_qwen3, 16, 128),
    "qwen3_moe": (_qwen3_moe, 16, 128),
    "gemma3": (_gemma3, 16, 256),
    "gemma2": (_gemma2, 16, 256),
    "phi3": (_phi3, 16, 96),
}
CASES = [(f, "tiny") for f in FAMILIES] + [(f, "realistic") for f in FAMILIES]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{s}" for f, s in CASES])
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, LoadedModel, torch.nn.Module]:
    import transformers

    name, size = request.param
    build, tiny, real = FAMILIES[name]
    torch.manual_seed(7)
    ref = build(transformers, tiny if size == "tiny" else real).eval()
    folder = tmp_path_factory.mktemp(f"{name}-{size}")
    ref.save_pretrained(folder, safe_serialization=True)
    ours = load_model(str(folder), torch.float32)
    assert ours.config.architecture == name
    return name, ours, ref


def _prefill_logits(loaded: LoadedModel, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All prompts in one batched prefill through the paged cache; each prompt's logits."""
    c = loaded.config
    lengths = [len(p) for p in prompts]
    tables, next_id = [], 1
    for n in lengths:  # interleaved block ids: a wrong table shows in the logits
        tables.append([next_id + len(lengths) * i for i in range(-(-n // BLOCK))])
        next_id += 1
    blocks = max(max(t) for t in tables) + 1
    kv = KVPool(blocks, KVLayout(c.num_layers, BLOCK, c.num_kv_heads, c.head_dim, "float32"))
    meta = AttentionMetadata.build(is_prefill=True, query_lens=lengths, context_lens=lengths,
                                   block_tables=tables, block_size=BLOCK)  # fmt: skip
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lengths])
    logits = loaded.model.compute_logits(loaded.model(ids, positions, kv, meta))
    return list(logits.split(lengths))


@torch.no_grad()
def test_batched_prefill_matches_transformers(family: tuple[str, LoadedModel, Any]) -> None:
    _, ours, ref = family
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 21, 1, 13)]
    for prompt, got in zip(prompts, _prefill_logits(ours, prompts), strict=True):
        expected = ref(torch.tensor([prompt])).logits[0]
        assert got.abs().max() > 0.05  # real signal, not a vanishing model
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_engine_greedy_matches_transformers(family: tuple[str, LoadedModel, Any]) -> None:
    """Prefill, then decode steps well past the sliding window, through the real engine."""
    _, ours, ref = family
    engine = LLMEngine(ours, EngineConfig(block_size=BLOCK, num_blocks=128))
    prompts = [[5, 17, 42, 99, 3, 8, 150, 7, 77, 31, 64], [9, 4, 200]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        expected = ref.generate(
            torch.tensor([prompt]), max_new_tokens=14, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()  # fmt: skip
        assert out.new_token_ids == expected


@torch.no_grad()
def test_family_features_are_exercised(family: tuple[str, LoadedModel, Any]) -> None:
    """Turn off what makes the family itself; the logits must move (so the parity tests above
    could fail)."""
    name, ours, _ = family
    prompt = torch.randint(3, 256, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    before = _prefill_logits(ours, [prompt])[0]
    model = ours.model
    attns = [layer.self_attn for layer in model.layers]
    saved = [(a.window, a.softcap, a.q_norm, a.k_norm) for a in attns]
    scaling = model.rope.scaling
    try:
        for a in attns:
            a.window, a.softcap = None, None
            if name == "qwen3":
                a.q_norm = a.k_norm = None
        if name == "phi3":
            model.rope.scaling = None
            model.rope.reset_tables()
        if name == "qwen3_moe":
            for layer in model.layers:
                layer.mlp.top_k = 1
        after = _prefill_logits(ours, [prompt])[0]
    finally:
        for a, (window, softcap, q_norm, k_norm) in zip(attns, saved, strict=True):
            a.window, a.softcap, a.q_norm, a.k_norm = window, softcap, q_norm, k_norm
        model.rope.scaling = scaling
        model.rope.reset_tables()
        if name == "qwen3_moe":
            for layer in model.layers:
                layer.mlp.top_k = ours.config.num_experts_per_tok
    assert (after - before).abs().max() > 1e-3
