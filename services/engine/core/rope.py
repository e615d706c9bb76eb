"""Rotary position embeddings in the Hugging Face (``rotate_half``) layout, with Llama-3
frequency scaling. The cos/sin table is computed once per model and indexed by position."""

from __future__ import annotations

import math

import torch

from services.common.model_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """``1 / theta^(2i/d)``, rescaled the way Llama 3.1 does when ``scaling`` is given."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
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
        freqs = torch.outer(positions, inv).to(self.cos.device)
        self.cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)
        self.sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[T, 1, head_dim]`` in ``dtype`` (as transformers casts them)."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[T, heads, head_dim]`` with tables from :meth:`lookup`."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
