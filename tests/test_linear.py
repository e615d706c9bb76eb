"""The CPU fast path of :class:`Linear` (split ``bmm``) equals the ``F.linear`` reference."""

from __future__ import annotations

import pytest
import torch

from services.engine.linear import Linear, pack_linears


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("splits", [2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_reference(rows: int, splits: int, bias: bool) -> None:
    torch.manual_seed(rows * 10 + splits)
    layer = Linear(24, 37, bias=bias)  # 37 outputs: not divisible, exercises the padding
    x = torch.randn(rows, 24)
    expected = layer(x)
    layer.pack(splits)
    assert layer.packed is not None and layer.packed.shape == (splits, 24, -(-37 // splits))
    assert torch.allclose(layer(x), expected, atol=1e-6)


def test_free_dense_keeps_shared_weights(tiny_llama_dir) -> None:  # type: ignore[no-untyped-def]
    from services.engine.loaders import load_model

    loaded = load_model(str(tiny_llama_dir))
    model = loaded.model
    assert pack_linears(model, 2, free_dense=True) == 1 + 4 * loaded.config.num_layers
    assert model.layers[0].mlp.down_proj.weight.numel() == 0  # dense copy released
    assert model.embed_tokens.weight.numel() == loaded.config.vocab_size * loaded.config.hidden_size
