"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's layer; the checkpoint already holds the fused
``qkv_proj`` and ``gate_up_proj`` (loaded as they are), the rotary embedding uses LongRoPE
(per-frequency factors, short and long) and, in Phi-4-mini, rotates only the first
``partial_rotary_factor`` of each head (:mod:`services.engine.core.rope`)."""

from __future__ import annotations

from services.engine.core.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3-mini/medium, Phi-3.5-mini, Phi-4-mini."""
