"""Tiny random embedding checkpoints and their ``transformers`` reference, shared by the
embeddings tests (tests/test_embeddings.py: engine and pieces; tests/test_embeddings_served.py:
served end to end).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

COSINE = 0.9999
CONTEXT = 128
INPUT_LENGTHS = (1, 5, 23, 77)  # with a 32-token budget: the long ones span passes


def _tiny(vocab: int, tie: bool = False) -> dict[str, Any]:
    return dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.08,
        max_position_embeddings=CONTEXT, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=tie,
    )  # fmt: skip


def write_checkpoint(folder: Path, kind: str, vocab: int = 256, *, tie: bool = False) -> Path:
    """A random checkpoint as ``save_pretrained`` writes it: ``qwen3`` / ``llama`` base models
    (architectures ``Qwen3Model`` / ``LlamaModel``) or a ``llama-causal`` LM; ``tie``: the
    config ties the head to the embedding (Qwen3-Embedding's does)."""
    import transformers as t

    torch.manual_seed(0)
    if kind == "qwen3":
        model = t.Qwen3Model(t.Qwen3Config(**_tiny(vocab, tie)))
    elif kind == "llama":
        model = t.LlamaModel(t.LlamaConfig(**_tiny(vocab, tie)))
    else:
        model = t.LlamaForCausalLM(t.LlamaConfig(**_tiny(vocab, tie)))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@functools.lru_cache(maxsize=4)
def _reference_model(folder: Path) -> torch.nn.Module:
    from transformers import AutoModel

    return AutoModel.from_pretrained(folder, dtype=torch.float32).eval()


def reference(folder: Path, ids: list[int], pooling: str) -> torch.Tensor:
    """``transformers.AutoModel``'s last hidden state of ``ids`` (the base model even of a causal
    LM's folder), pooled the same way, in float32."""
    with torch.no_grad():
        hidden = _reference_model(folder)(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return hidden[-1] if pooling == "last" else hidden.mean(dim=0)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))


def prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in INPUT_LENGTHS]
