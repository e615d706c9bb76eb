"""Random weights of a named real shape, for benchmarks without a checkpoint (e.g. on a GPU box
that cannot receive model files). Values are small normal noise so activations stay finite."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from services.common.errors import ModelLoadError
from services.common.model_config import ModelConfig, RopeScaling

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
    """Yield Hugging Face-named random tensors of the config's shapes."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * 0.02

    yield "model.embed_tokens.weight", rand(config.vocab_size, h)
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        yield prefix + "input_layernorm.weight", torch.ones(h, dtype=dtype, device=device)
        yield prefix + "post_attention_layernorm.weight", torch.ones(h, dtype=dtype, device=device)
        yield prefix + "self_attn.q_proj.weight", rand(q, h)
        yield prefix + "self_attn.k_proj.weight", rand(kv, h)
        yield prefix + "self_attn.v_proj.weight", rand(kv, h)
        if config.attention_bias:
            yield prefix + "self_attn.q_proj.bias", rand(q)
            yield prefix + "self_attn.k_proj.bias", rand(kv)
            yield prefix + "self_attn.v_proj.bias", rand(kv)
        yield prefix + "self_attn.o_proj.weight", rand(h, q)
        yield prefix + "mlp.gate_proj.weight", rand(i, h)
        yield prefix + "mlp.up_proj.weight", rand(i, h)
        yield prefix + "mlp.down_proj.weight", rand(h, i)
    yield "model.norm.weight", torch.ones(h, dtype=dtype, device=device)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", rand(config.vocab_size, h)
