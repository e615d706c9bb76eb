"""Llama (2, 3, 3.1, 3.2), Mistral, SmolLM2 and Qwen2 / Qwen2.5 (Llama with a QKV bias).

Reads top to bottom: embedding → N × (RMSNorm → attention → residual → RMSNorm → SwiGLU →
residual) → RMSNorm → LM head. Q/K/V and gate/up projections are fused into one matmul each
(the loaders concatenate the checkpoint's weights). Decode-sized float32 batches on CPU run
the residual add + norm as one fused call (:meth:`LlamaDecoderLayer.forward`); the PyTorch ops
stay the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from services.common.model_config import ModelConfig
from services.engine.core.attention import AttentionMetadata, PagedAttention
from services.engine.core.models.base import CausalLM, DecoderLayer, LayerNorms
from services.engine.core.models.blocks import Attention, FusedOps, GatedMLP, Rope, make_norm


class LlamaDecoderLayer(DecoderLayer):
    """Pre-norm: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; ``mlp`` may be any module
    with Llama's ``forward(x)`` (Qwen3-MoE puts its routed experts there)."""

    def __init__(self, config: ModelConfig, backend: PagedAttention, index: int,
                 mlp: nn.Module | None = None) -> None:  # fmt: skip
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn = Attention(config, backend, index)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.mlp = mlp or GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.fused: FusedOps | None = None

    def one_call_norms(self) -> LayerNorms | None:
        if not isinstance(self.mlp, GatedMLP):  # routed experts: per op
            return None
        return self.input_layernorm, self.post_attention_layernorm, None, None

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        fused = self.fused
        if fused is not None and fused.applies(x):
            norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
            h = self.self_attn.forward(
                fused.add_rmsnorm(x, None, norm1.kernel_weight(), norm1.eps), rope, k_cache,
                v_cache, meta,
            )  # fmt: skip
            residual = torch.empty_like(x)  # x + h, written by the fused norm
            h = self.mlp.forward(
                fused.add_rmsnorm(x, h, norm2.kernel_weight(), norm2.eps, residual)
            )
            return residual.add_(h)
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), rope, k_cache, v_cache, meta)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / SmolLM2 / Qwen2 causal LM over a paged KV cache."""

    def make_layer(self, config: ModelConfig, backend: PagedAttention, index: int) -> DecoderLayer:
        return LlamaDecoderLayer(config, backend, index)
