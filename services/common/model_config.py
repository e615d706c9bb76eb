"""Shape parameters of a decoder-only transformer, read from a Hugging Face ``config.json`` dict,
GGUF metadata or a named dummy shape.

:data:`ARCHITECTURES` is the one table from a checkpoint's architecture name (Hugging Face
``architectures``) to a model family; the engine's model registry
(``services.engine.core.models``) maps each family to its module. Families:

* ``llama``: Llama 2/3/3.1/3.2 (Llama-3 rope scaling), Mistral, SmolLM2;
* ``qwen2``: Qwen2 / Qwen2.5 (a Llama with QKV bias);
* ``qwen3``: per-head q/k RMSNorm, no bias;
* ``gemma2`` / ``gemma3``: GeGLU (tanh GELU), ``(1 + w)`` RMSNorm before and after attention and
  the MLP, embeddings scaled by √hidden, sliding-window layers interleaved with global ones
  (Gemma 3: each with its own rope base; Gemma 2: attention and final logit soft-capping);
* ``phi3``: Phi-3 / Phi-3.5 / Phi-4-mini (fused QKV and gate-up in the checkpoint, LongRoPE,
  partial rotary);
* ``qwen3_moe``: Qwen3's attention with top-k routed SwiGLU experts.

Base checkpoints of the Llama, Mistral, Qwen2 and Qwen3 families (``LlamaModel``, ``Qwen3Model``
...: embedding models) load as their family with :attr:`ModelConfig.base_model` set.

Anything else is refused with a one-line :class:`ModelLoadError`.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from services.common.errors import ModelLoadError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # base checkpoints (embedding models: Qwen3-Embedding, e5-mistral): BASE_MODEL_ARCHITECTURES
    "LlamaModel": "llama",
    "MistralModel": "llama",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
}
BASE_MODEL_ARCHITECTURES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})
"""Base checkpoints: the decoder stack and its final norm without an LM head (their weights carry
no ``model.`` prefix); unless the head is tied to the embedding they serve embeddings only."""
FAMILIES = frozenset(ARCHITECTURES.values())
SLIDING, FULL = "sliding_attention", "full_attention"
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary frequency scaling. ``rope_type`` ``llama3`` (Llama 3.1: low/high frequency
    factors), ``linear`` (positions divided by ``factor``) or ``longrope`` (Phi-3: one factor per
    frequency, ``short_factor`` below ``original_max_position_embeddings``, ``long_factor`` from
    there on, and cos/sin multiplied by ``attention_factor``)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the model and the KV cache need to know about a checkpoint's shape.

    The fields after ``eos_token_ids`` describe the families other than Llama; their defaults
    are Llama's.
    """

    architecture: str  # the family: a value of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_tanh
    qk_norm: bool = False  # RMSNorm over each q and k head before the rotation (Qwen3, Gemma 3)
    query_scale: float | None = None  # attention's score scale; None: head_dim ** -0.5
    sliding_window: int | None = None  # a sliding layer's query sees keys q - window < k <= q
    layer_types: tuple[str, ...] = ()  # SLIDING or FULL per layer; () : all FULL
    local_rope_theta: float | None = None  # sliding layers' rope base where it differs (Gemma 3)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits (Gemma 2)
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotate (Phi-4-mini)
    num_experts: int = 0  # routed experts per MoE layer (Qwen3-MoE); 0: a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the top-k router weights renormalised to sum to 1
    mlp_only_layers: tuple[int, ...] = ()  # layers with a dense MLP in an MoE model
    decoder_sparse_step: int = 1  # every this many layers is an MoE layer
    base_model: bool = False  # a base checkpoint (BASE_MODEL_ARCHITECTURES): no LM head stored

    @property
    def has_lm_head(self) -> bool:
        """Whether the model can produce logits: a causal LM, or a base checkpoint whose head is
        its embedding (tied); an untied base checkpoint serves embeddings only."""
        return not self.base_model or self.tie_word_embeddings

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head rotate (all but Phi-4-mini's last quarter)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends over the sliding window only."""
        return (
            self.sliding_window is not None
            and bool(self.layer_types)
            and self.layer_types[layer] == SLIDING
        )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the routed experts (Qwen3-MoE's rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict; refuse unsupported architectures."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            model_type = cfg.get("model_type", "?")
            raise ModelLoadError(
                f"unsupported architecture {archs or model_type!r}; supported: "
                + ", ".join(sorted(ARCHITECTURES))
            )
        family = ARCHITECTURES[arch]
        try:
            config = _from_hf(cfg, family)
            return replace(config, base_model=True) if arch in BASE_MODEL_ARCHITECTURES else config
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad field: {exc}") from exc

    def fingerprint(self) -> str:
        """A short stable hash of the shape; the KV hand-off refuses KV from another model."""
        blob = json.dumps(asdict(self), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _from_hf(cfg: dict[str, Any], family: str) -> ModelConfig:
    gemma = family in ("gemma2", "gemma3")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act in _GELU_TANH:
        act = "gelu_tanh"
    if act not in ("silu", "gelu_tanh") or cfg.get("mlp_bias"):
        raise ModelLoadError(
            f"unsupported MLP activation {act!r}: gated silu or tanh-GELU without bias only"
        )
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    # transformers 5 writes rope settings as ``rope_parameters`` (theta inside; per layer type
    # for Gemma 3); 4.x as ``rope_theta`` + ``rope_scaling`` (+ ``rope_local_base_freq``).
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    local_theta = cfg.get("rope_local_base_freq")
    if FULL in rope or SLIDING in rope:
        local_theta = rope.get(SLIDING, {}).get("rope_theta", local_theta)
        rope = rope.get(FULL, {})
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    partial = float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    window = cfg.get("sliding_window") or None
    if family in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window"):
        window = None  # Qwen configs carry a window they do not use unless told to
    types = tuple(cfg.get("layer_types") or ())
    if window is not None and not types:
        types = tuple(_default_layer_types(family, layers, cfg))
    if len(types) not in (0, layers) or any(t not in (SLIDING, FULL) for t in types):
        raise ModelLoadError(f"unsupported layer_types {list(types)!r}")
    scalar = cfg.get("query_pre_attn_scalar")
    return ModelConfig(
        architecture=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        num_layers=layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
        rope_scaling=_rope_scaling(rope, cfg, max_pos),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        hidden_act=act,
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        query_scale=None if scalar is None or not gemma else float(scalar) ** -0.5,
        sliding_window=None if window is None else int(window),
        layer_types=types if window is not None else (),
        local_rope_theta=None if local_theta is None else float(local_theta),
        attn_softcap=_cap(cfg.get("attn_logit_softcapping")) if family == "gemma2" else None,
        final_softcap=_cap(cfg.get("final_logit_softcapping")),
        partial_rotary_factor=partial,
        num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if family == "qwen3_moe" else 0,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
    )


def _default_layer_types(family: str, layers: int, cfg: dict[str, Any]) -> list[str]:
    """Older configs without ``layer_types``: Gemma 2 alternates (sliding first), Gemma 3
    slides on all but every ``sliding_window_pattern``-th layer, Qwen from layer
    ``max_window_layers`` on; others (Mistral v0.1, Phi-3) slide everywhere."""
    if family == "gemma2":
        return [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    if family == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        return [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    if family.startswith("qwen"):
        first = int(cfg.get("max_window_layers", layers))
        return [SLIDING if i >= first else FULL for i in range(layers)]
    return [SLIDING] * layers


def _cap(value: Any) -> float | None:
    return None if value in (None, 0, 0.0) else float(value)


def _rope_scaling(raw: dict[str, Any] | None, cfg: dict[str, Any], max_pos: int) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(factor=float(raw["factor"]), rope_type="linear")
    if kind in ("longrope", "su"):
        original = int(
            raw.get("original_max_position_embeddings")
            or cfg.get("original_max_position_embeddings")
            or max_pos
        )
        factor = float(raw.get("factor") or max_pos / original)
        attention = raw.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return RopeScaling(
            factor=factor, original_max_position_embeddings=original, rope_type="longrope",
            short_factor=tuple(float(f) for f in raw["short_factor"]),
            long_factor=tuple(float(f) for f in raw["long_factor"]),
            attention_factor=float(attention),
        )  # fmt: skip
    if kind != "llama3":
        raise ModelLoadError(
            f"unsupported rope_scaling type {kind!r}; supported: llama3, linear, longrope"
        )
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )
