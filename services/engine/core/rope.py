"""Rotary position embeddings in the Hugging Face (``rotate_half``) layout, with Llama-3, linear
and LongRoPE (Phi-3) frequency scaling and partial rotation (the first ``dim`` of each head's
dims). The cos/sin table is computed once per model and indexed by position.

LongRoPE has two sets of frequencies: ``short_factor`` for positions below
``original_max_position_embeddings`` and ``long_factor`` from there on. Hugging Face switches the
whole sequence once it grows past that length; here, as in vLLM, each position takes the table
of its own range, so K already in the paged cache never needs recomputing."""

from __future__ import annotations

import math

import torch

from services.common.model_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """``1 / theta^(2i/d)``, rescaled the way Llama 3.1 does when ``scaling`` is given."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "longrope":  # the short factors; the long ones: longrope_tables
        return inv / torch.tensor(scaling.short_factor, dtype=torch.float32)
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Cos/sin tables and the rotation ``x * cos + rotate_half(x) * sin`` (Hugging Face layout).

    The tables are stored full width with the sign of ``rotate_half`` folded into ``sin``
    (``[-sin, sin]``), so the rotation is four tensor ops: ``x * cos + x.roll(d/2) * sin``.
    :meth:`lookup` runs once per forward pass; every layer reuses its result.
    """

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        if self.cos.device.type != "meta":
            self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the float32 tables on the buffers' device."""
        inv = inverse_frequencies(self.head_dim, self.theta, self.scaling).float()
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv)
        scaling = self.scaling
        if scaling is not None and scaling.rope_type == "longrope":
            long_inv = inv * torch.tensor(scaling.short_factor) / torch.tensor(scaling.long_factor)
            beyond = positions >= scaling.original_max_position_embeddings
            freqs[beyond] = torch.outer(positions[beyond], long_inv)
        freqs = freqs.to(self.cos.device)
        cos, sin = freqs.cos(), freqs.sin()
        if scaling is not None and scaling.rope_type == "longrope":
            cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
        self.cos = torch.cat((cos, cos), dim=-1)
        self.sin = torch.cat((-sin, sin), dim=-1)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[T, 1, head_dim]`` in ``dtype`` (as transformers casts them)."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[T, heads, head_dim]`` with tables from :meth:`lookup`; tables
    narrower than the head rotate its leading dims and pass the rest through (partial rotary)."""
    dim = cos.shape[-1]
    if dim != x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
