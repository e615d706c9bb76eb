"""Gemma 2: Gemma 3's layer stack (:mod:`services.engine.core.models.gemma3`) without q/k norms,
with attention-score and final-logit soft-capping (``attn_logit_softcapping``,
``final_logit_softcapping``) and one rope base for local and global layers; the config carries
the differences. Its soft-capped sliding and global layers take the one-call C decode layers on
CPU like Gemma 3's (the decode attention kernel soft-caps scores); the final soft-cap is applied
to the logits after them."""

from __future__ import annotations

from services.engine.core.models.gemma3 import Gemma3ForCausalLM


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 2B / 9B / 27B."""
