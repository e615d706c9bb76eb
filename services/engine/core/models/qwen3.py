"""Qwen3 (dense): Llama's layer with an RMSNorm over each query and key head before the rotary
embedding, and no QKV bias (:class:`~services.engine.core.models.blocks.Attention` with
``config.qk_norm``).

It takes every CPU fast path Llama takes: the q/k head norms and the rotation are one fused C
call per layer (``tandem_qk_norm_rope``), and a decode step runs all layers as one C call
(:meth:`~services.engine.core.models.base.CausalLM.use_decode_layers`)."""

from __future__ import annotations

from services.engine.core.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 0.6B–32B: the q/k norms are read from ``self_attn.q_norm`` / ``k_norm``."""
