"""Random weights of a named real shape, for benchmarks without a checkpoint (e.g. on a GPU box
that cannot receive model files). Values are small normal noise so activations stay finite."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from services.common.errors import ModelLoadError
from services.common.model_config import FULL, SLIDING, ModelConfig, RopeScaling

_LLAMA3_ROPE = RopeScaling(8.0, 1.0, 4.0, 8192)

DUMMY_SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0, 8192, True),
    "smollm2-360m": ModelConfig("llama", 49152, 960, 2560, 32, 15, 5, 64, 1e-5, 100000.0, 8192, True),
    "llama-3.2-1b": ModelConfig(
        "llama", 128256, 2048, 8192, 16, 32, 8, 64, 1e-5, 500000.0, 131072, True, False,
        RopeScaling(32.0, 1.0, 4.0, 8192),
    ),
    "llama-3-8b": ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0, 8192, False),
    "llama-3.1-8b": ModelConfig(
        "llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0, 131072, False, False, _LLAMA3_ROPE
    ),
    "qwen2-0.5b": ModelConfig("qwen2", 151936, 896, 4864, 24, 14, 2, 64, 1e-6, 1000000.0, 32768, True, True),
    "tiny": ModelConfig("llama", 512, 64, 128, 2, 4, 2, 16, 1e-5, 10000.0, 1024, False),
    "qwen3-1.7b": ModelConfig(
        "qwen3", 151936, 2048, 6144, 28, 16, 8, 128, 1e-6, 1000000.0, 40960, True, qk_norm=True
    ),
    "gemma-3-1b": ModelConfig(
        "gemma3", 262144, 1152, 6912, 26, 4, 1, 256, 1e-6, 1000000.0, 32768, True,
        hidden_act="gelu_tanh", qk_norm=True, query_scale=256**-0.5, sliding_window=512,
        layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(26)),
        local_rope_theta=10000.0,
    ),
    "qwen3-30b-a3b": ModelConfig(
        "qwen3_moe", 151936, 2048, 6144, 48, 32, 4, 128, 1e-6, 1000000.0, 40960, False,
        qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    ),
}


def dummy_config(shape: str) -> ModelConfig:
    """The :class:`ModelConfig` of a named shape, or a ModelLoadError listing the known ones."""
    config = DUMMY_SHAPES.get(shape)
    if config is None:
        raise ModelLoadError(
            f"unknown dummy shape {shape!r}; known: " + ", ".join(sorted(DUMMY_SHAPES))
        )
    return config


def iter_dummy_weights(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield Hugging Face-named random tensors of the config's shapes (any family)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * 0.02

    def ones(size: int) -> torch.Tensor:  # Gemma's norms store w of (1 + w): zero is identity
        one = 0.0 if config.architecture in ("gemma2", "gemma3") else 1.0
        return torch.full((size,), one, dtype=dtype, device=device)

    yield "model.embed_tokens.weight", rand(config.vocab_size, h)
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        if config.architecture in ("gemma2", "gemma3"):
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for norm in norms:
            yield prefix + norm + ".weight", ones(h)
        if config.qk_norm:
            yield prefix + "self_attn.q_norm.weight", ones(config.head_dim)
            yield prefix + "self_attn.k_norm.weight", ones(config.head_dim)
        yield prefix + "self_attn.q_proj.weight", rand(q, h)
        yield prefix + "self_attn.k_proj.weight", rand(kv, h)
        yield prefix + "self_attn.v_proj.weight", rand(kv, h)
        if config.attention_bias:
            yield prefix + "self_attn.q_proj.bias", rand(q)
            yield prefix + "self_attn.k_proj.bias", rand(kv)
            yield prefix + "self_attn.v_proj.bias", rand(kv)
        yield prefix + "self_attn.o_proj.weight", rand(h, q)
        if config.is_moe_layer(layer):
            m = config.moe_intermediate_size
            yield prefix + "mlp.gate.weight", rand(config.num_experts, h)
            for e in range(config.num_experts):
                yield prefix + f"mlp.experts.{e}.gate_proj.weight", rand(m, h)
                yield prefix + f"mlp.experts.{e}.up_proj.weight", rand(m, h)
                yield prefix + f"mlp.experts.{e}.down_proj.weight", rand(h, m)
            continue
        yield prefix + "mlp.gate_proj.weight", rand(i, h)
        yield prefix + "mlp.up_proj.weight", rand(i, h)
        yield prefix + "mlp.down_proj.weight", rand(h, i)
    yield "model.norm.weight", ones(h)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", rand(config.vocab_size, h)
