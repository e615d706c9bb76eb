"""Gemma 3 (text) and, with two switches, Gemma 2.

Reads top to bottom: embedding × √hidden → N × (RMSNorm → attention → RMSNorm → residual →
RMSNorm → GeGLU → RMSNorm → residual) → RMSNorm → LM head. Every norm scales by ``1 + w``
(:class:`~services.engine.core.models.blocks.GemmaRMSNorm`); the MLP's activation is the tanh
GELU. Layers alternate between a sliding window and global attention (Gemma 3: five local to
one global, the local ones with rope base 10k, the global ones 1M; Gemma 2: one to one, one rope
base). Gemma 3 normalises each q/k head; Gemma 2 instead soft-caps attention scores and the
final logits. The score scale is ``query_pre_attn_scalar ** -0.5``.

On CPU, decode-sized float32 batches run each norm (``1 + w`` folded into the kernel's weight),
the q/k norms with the rotation, and the GeGLU as fused C calls; a decode step runs all layers as
one C call (:meth:`~services.engine.core.models.base.CausalLM.use_decode_layers`), with the same
kernels in the same order.
"""

from __future__ import annotations

import torch

from services.common.model_config import ModelConfig
from services.engine.core.attention import AttentionMetadata, PagedAttention
from services.engine.core.models.base import CausalLM, DecoderLayer, LayerNorms
from services.engine.core.models.blocks import Attention, FusedOps, GatedMLP, Rope, make_norm


class GemmaDecoderLayer(DecoderLayer):
    """``x + norm(attn(norm(x)))``, then ``x + norm(mlp(norm(x)))``."""

    def __init__(self, config: ModelConfig, backend: PagedAttention, index: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = make_norm(config, hidden)
        self.self_attn = Attention(config, backend, index)
        self.post_attention_layernorm = make_norm(config, hidden)
        self.pre_feedforward_layernorm = make_norm(config, hidden)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act)
        self.post_feedforward_layernorm = make_norm(config, hidden)
        self.fused: FusedOps | None = None

    def one_call_norms(self) -> LayerNorms:
        return (self.input_layernorm, self.pre_feedforward_layernorm,
                self.post_attention_layernorm, self.post_feedforward_layernorm)  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        fused = self.fused
        if fused is not None and x.dtype == torch.float32 and fused.applies(x):
            return self._fused_forward(fused, x, rope, k_cache, v_cache, meta)
        h = self.self_attn.forward(self.input_layernorm.forward(x), rope, k_cache, v_cache, meta)
        x = x + self.post_attention_layernorm.forward(h)
        h = self.mlp.forward(self.pre_feedforward_layernorm.forward(x))
        return x + self.post_feedforward_layernorm.forward(h)

    def _fused_forward(
        self, fused: FusedOps, x: torch.Tensor, rope: Rope, k_cache: torch.Tensor,
        v_cache: torch.Tensor, meta: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """:meth:`forward` with each norm one fused call, in the one-call C layers' order."""
        eps = self.input_layernorm.eps
        normed = fused.add_rmsnorm(x, None, self.input_layernorm.kernel_weight(), eps)
        h = self.self_attn.forward(normed, rope, k_cache, v_cache, meta)
        h = fused.add_rmsnorm(h, None, self.post_attention_layernorm.kernel_weight(), eps)
        residual = torch.empty_like(x)  # x + h, written by the fused norm
        normed = fused.add_rmsnorm(x, h, self.pre_feedforward_layernorm.kernel_weight(), eps,
                                   residual)  # fmt: skip
        h = self.mlp.forward(normed)
        h = fused.add_rmsnorm(h, None, self.post_feedforward_layernorm.kernel_weight(), eps)
        return residual.add_(h)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 270M / 1B (text only) and the text stack of the larger ones; Gemma 2."""

    def __init__(self, config: ModelConfig, backend: PagedAttention | None = None) -> None:
        super().__init__(config, backend)
        self.embed_scale = config.hidden_size**0.5

    def make_layer(self, config: ModelConfig, backend: PagedAttention, index: int) -> DecoderLayer:
        return GemmaDecoderLayer(config, backend, index)
