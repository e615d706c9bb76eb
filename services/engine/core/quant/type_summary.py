"""What each GGUF tensor type became at load, in one line for the log.

A GGUF file mixes types (a Q4_K_M file holds Q4_K, Q6_K and F32 tensors), and a load keeps some as
stored, re-quantizes others or widens them to float32; the line says which, e.g.
``Q4_K -> q4_k (112 tensors), Q6_K -> q6_k (17), F32 -> float32 (33)``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from gguf import GGMLQuantizationType

from services.engine.core.quant.quantized_weight import QuantizedWeight

Held = torch.Tensor | QuantizedWeight | str


def held_as(weight: Held) -> str:
    """The name of the form a loaded weight is held in: a quantized format (``"q4_k"``), a float
    dtype (``"float32"``), or ``weight`` itself when it is already a name."""
    if isinstance(weight, QuantizedWeight):
        return weight.format
    if isinstance(weight, torch.Tensor):
        return str(weight.dtype).removeprefix("torch.")
    return weight


def summarize_weight_types(pairs: Iterable[tuple[GGMLQuantizationType | str, Held]]) -> str:
    """``"Q4_K -> q4_k (112 tensors), Q6_K -> q6_k (17), F32 -> float32 (33)"`` for the
    (GGML type, loaded weight or its format name) of each tensor: one entry per pair of names,
    the most frequent first; ``"no tensors"`` for none."""
    counts = Counter(
        (source.name if isinstance(source, GGMLQuantizationType) else str(source), held_as(held))
        for source, held in pairs
    )
    if not counts:
        return "no tensors"
    ordered = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    unit = " tensor" if ordered[0][1] == 1 else " tensors"
    return ", ".join(
        f"{source} -> {held} ({n}{unit if i == 0 else ''})"
        for i, ((source, held), n) in enumerate(ordered)
    )
