"""The CPU fast paths of :class:`Linear` (native tiles, split ``bmm``) equal ``F.linear``."""

from __future__ import annotations

import pytest
import torch

from services.engine.core.linear import Linear, PackPlan, pack_linears
from tests.conftest import native_kernel_or_skip


def kernel_plan() -> PackPlan:
    return PackPlan(kernel=native_kernel_or_skip())


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("splits", [2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_split_bmm_equals_reference(rows: int, splits: int, bias: bool) -> None:
    torch.manual_seed(rows * 10 + splits)
    layer = Linear(24, 37, bias=bias)  # 37 outputs: not divisible, exercises the padding
    x = torch.randn(rows, 24)
    expected = layer(x)
    layer.pack(PackPlan(splits=splits))
    assert layer.split is not None and layer.split.shape == (splits, 24, -(-37 // splits))
    assert torch.allclose(layer(x), expected, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 40])  # kernel row blocks of 4, 2 and 1
@pytest.mark.parametrize("bias", [False, True])
def test_native_kernel_equals_reference(rows: int, bias: bool) -> None:
    plan = kernel_plan()
    torch.manual_seed(rows)
    layer = Linear(200, 70, bias=bias)  # 70 outputs: a partial last tile; 200 inputs: partial K block
    x = torch.randn(rows, 200)
    expected = (x.double() @ layer.weight.double().T).float()
    if bias:
        expected += layer.bias
    layer.pack(plan)
    assert layer.packed is not None and layer.packed.shape[1:] == (200, plan.kernel.tile)
    got = layer(x)
    assert got.shape == (rows, 70)
    assert torch.allclose(got, expected, atol=2e-5, rtol=1e-5)


def test_native_kernel_rows_do_not_depend_on_batch_mates() -> None:
    """Every output is one fixed multiply-add chain: a row alone equals that row in a batch."""
    plan = kernel_plan()
    torch.manual_seed(0)
    layer = Linear(576, 100)
    layer.pack(plan)
    batch = torch.randn(7, 576)
    together = layer(batch)
    for r in range(7):
        assert torch.equal(layer(batch[r : r + 1]), together[r : r + 1])


def test_native_kernel_strided_input_and_thread_counts() -> None:
    plan = kernel_plan()
    torch.manual_seed(1)
    layer = Linear(64, 96, bias=True)
    wide = torch.randn(3, 100)
    x = wide[:, 10:74]  # rows 100 floats apart: the kernel takes the row stride
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    layer.pack(plan)
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(layer(x))
    finally:
        torch.set_num_threads(previous)
    for got in results:
        assert torch.allclose(got, expected, atol=1e-5)
    assert torch.equal(results[0], results[1]) and torch.equal(results[1], results[2])


@pytest.mark.parametrize("use_kernel", [False, True])
def test_free_dense_keeps_shared_weights(tiny_llama_dir, use_kernel: bool) -> None:  # type: ignore[no-untyped-def]
    from services.engine.core.loaders import load_model

    plan = kernel_plan() if use_kernel else PackPlan(splits=2)
    loaded = load_model(str(tiny_llama_dir))
    model = loaded.model
    assert pack_linears(model, plan, free_dense=True) == 1 + 4 * loaded.config.num_layers
    assert model.layers[0].mlp.down_proj.weight.numel() == 0  # dense copy released
    assert model.embed_tokens.weight.numel() == loaded.config.vocab_size * loaded.config.hidden_size


def test_native_kernel_refuses_mismatched_shapes() -> None:
    plan = kernel_plan()
    layer = Linear(64, 40)
    layer.pack(plan)
    with pytest.raises(ValueError, match="does not fit"):
        layer(torch.randn(2, 63))
    with pytest.raises(TypeError, match="float32"):
        layer(torch.randn(2, 64, dtype=torch.float64))
