"""QuantizedWeight: GGUF block conversion and q8_0 quantization against the ``gguf`` package,
and the 16-bit float formats.

``gguf.quants`` is the reference: converting its blocks to the canonical form and dequantizing
must give exactly (``torch.equal``) what ``gguf.quants.dequantize`` gives, for every format.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from services.engine.core.quant.quantized_weight import (
    GROUP,
    SUPPORTED_GGML_TYPES,
    QuantizedWeight,
    from_gguf_blocks,
    quantize_q8_0,
    to_half,
)


def _random_weight(shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal(shape).astype(np.float32) * 0.05
    weight[3, 64:96] = 0.0  # one all-zero group (d = 0)
    return weight


def _random_q4_k_blocks(out: int, n_in: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K super-blocks (gguf cannot quantize Q4_K): random bytes, finite f16 d/dmin."""
    rng = np.random.default_rng(seed)
    n_blocks = out * n_in // 256
    blocks = rng.integers(0, 256, size=(n_blocks, 144), dtype=np.uint8)
    d = (rng.random(n_blocks) * 1e-3).astype(np.float16)
    dmin = (rng.random(n_blocks) * 1e-3).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(n_blocks, 2)
    blocks[:, 2:4] = dmin.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(out, n_in // 256 * 144)


def _reference(raw: np.ndarray, ggml_type: T, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, ggml_type))).reshape(shape)


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_gguf_blocks_dequantize_exactly(ggml_type: T) -> None:
    shape = (48, 512)
    raw = quantize(_random_weight(shape), ggml_type)
    weight = from_gguf_blocks(raw, ggml_type, shape)
    assert weight is not None
    assert weight.format == ("q8_0" if ggml_type == T.Q8_0 else "q4")
    assert weight.shape == shape
    assert torch.equal(weight.dequantize(), _reference(raw, ggml_type, shape))


def test_q4_k_blocks_dequantize_exactly() -> None:
    # Exact, not just close: d * sc and dmin * m are exact in float32, so both sides round once.
    shape = (48, 512)
    raw = _random_q4_k_blocks(*shape)
    weight = from_gguf_blocks(raw, T.Q4_K, shape)
    assert weight is not None and weight.format == "q4_k"
    assert torch.equal(weight.dequantize(), _reference(raw, T.Q4_K, shape))


def test_raw_bytes_of_any_shape_are_accepted() -> None:
    shape = (8, 64)
    raw = quantize(_random_weight((8, 64)), T.Q4_1)
    flat = from_gguf_blocks(raw.reshape(-1), T.Q4_1, shape)
    rows = from_gguf_blocks(raw, T.Q4_1, shape)
    assert flat is not None and rows is not None
    assert torch.equal(flat.qs, rows.qs) and torch.equal(flat.mins, rows.mins)


def test_canonical_q4_nibble_order() -> None:
    """Element i of a row: byte i // 2, low nibble when i is even (not GGUF's j / j + 16)."""
    # Q4_1 with d = 1, m = 0 stores q directly; make element i of each block equal i % 16.
    out, n_in = 2, 64
    blocks = np.zeros((out * n_in // 32, 20), dtype=np.uint8)
    blocks[:, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    q = np.arange(32) % 16
    blocks[:, 4:] = (q[:16] | (q[16:] << 4)).astype(np.uint8)  # GGUF: j low, j + 16 high
    weight = from_gguf_blocks(blocks, T.Q4_1, (out, n_in))
    assert weight is not None
    expected_values = torch.arange(n_in).remainder(16).float().expand(out, n_in)
    assert torch.equal(weight.dequantize(), expected_values)
    even = torch.arange(0, n_in, 2) % 16
    assert torch.equal(weight.qs, (even | ((even + 1) << 4)).to(torch.uint8).expand(out, -1))


def test_unsupported_type_returns_none() -> None:
    assert T.Q2_K not in SUPPORTED_GGML_TYPES
    assert from_gguf_blocks(np.zeros(84, dtype=np.uint8), T.Q2_K, (1, 256)) is None
    assert from_gguf_blocks(np.zeros(4, dtype=np.uint8), T.F32, (1, 1)) is None


def test_gguf_blocks_bad_sizes_raise() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        from_gguf_blocks(np.zeros(144, dtype=np.uint8), T.Q4_K, (2, 128))
    with pytest.raises(ValueError, match="bytes"):
        from_gguf_blocks(np.zeros(33, dtype=np.uint8), T.Q8_0, (1, 32))


def test_quantize_q8_0_matches_gguf() -> None:
    weight = _random_weight((48, 512), seed=1)
    ours = quantize_q8_0(torch.from_numpy(weight))
    raw = quantize(weight, T.Q8_0)
    theirs = from_gguf_blocks(raw, T.Q8_0, weight.shape)
    assert theirs is not None
    assert torch.equal(ours.qs, theirs.qs) and torch.equal(ours.scales, theirs.scales)
    assert torch.equal(ours.dequantize(), _reference(raw, T.Q8_0, weight.shape))
    assert torch.equal(ours.qs[3, 64:96], torch.zeros(32, dtype=torch.int8))  # all-zero group


def test_quantize_q8_0_rounds_half_away_from_zero() -> None:
    # amax = 127 gives d = 1 and id = 1, so x * id lands exactly on .5 ties.
    group = np.zeros(GROUP, dtype=np.float32)
    group[0] = 127.0
    group[1:9] = [0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.49999997]
    weight = np.stack([group, -group])
    ours = quantize_q8_0(torch.from_numpy(weight))
    assert ours.qs[0, 1:9].tolist() == [1, -1, 2, -2, 3, -3, 0, 0]  # torch.round gives 0, -0, 2...
    theirs = from_gguf_blocks(quantize(weight, T.Q8_0), T.Q8_0, weight.shape)
    assert theirs is not None
    assert torch.equal(ours.qs, theirs.qs) and torch.equal(ours.scales, theirs.scales)


def test_quantize_q8_0_scale_is_float16_rounded() -> None:
    weight = torch.full((1, GROUP), 0.3)
    d = weight.abs().max() / 127
    assert quantize_q8_0(weight).scales.item() == d.to(torch.float16).float().item()


def test_quantize_q8_0_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.zeros(4, 48))
    with pytest.raises(ValueError):
        quantize_q8_0(torch.zeros(64))


def _q4_weight(out: int, seed: int) -> QuantizedWeight:
    raw = quantize(_random_weight((out, 128), seed), T.Q4_1)
    weight = from_gguf_blocks(raw, T.Q4_1, (out, 128))
    assert weight is not None
    return weight


def test_map_rows_permutes_every_tensor() -> None:
    weight = _q4_weight(16, seed=2)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    permuted = weight.map_rows(lambda t: t[perm])
    assert permuted.shape == weight.shape
    assert torch.equal(permuted.dequantize(), weight.dequantize()[perm])
    q8 = quantize_q8_0(torch.randn(16, 64))
    assert q8.map_rows(lambda t: t[perm]).mins is None


def test_cat_stacks_rows() -> None:
    a, b = _q4_weight(8, seed=3), _q4_weight(24, seed=4)
    both = QuantizedWeight.cat([a, b])
    assert both.shape == (32, 128)
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_cat_rejects_mismatches() -> None:
    q4 = _q4_weight(8, seed=5)
    with pytest.raises(ValueError, match="formats and in_features"):
        QuantizedWeight.cat([q4, quantize_q8_0(torch.randn(8, 128))])
    wider = from_gguf_blocks(quantize(_random_weight((8, 256)), T.Q4_0), T.Q4_0, (8, 256))
    assert wider is not None
    with pytest.raises(ValueError, match="formats and in_features"):
        QuantizedWeight.cat([q4, wider])
    with pytest.raises(ValueError):
        QuantizedWeight.cat([])


@pytest.mark.parametrize("fmt", ["q8_0", "q4"])
def test_rows_is_an_embedding_lookup(fmt: str) -> None:
    weight = quantize_q8_0(torch.randn(40, 64)) if fmt == "q8_0" else _q4_weight(40, seed=7)
    index = torch.tensor([5, 0, 39, 5])
    assert torch.equal(weight.rows(index), weight.dequantize()[index])
    grid = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(weight.rows(grid), weight.dequantize()[grid])


def test_nbytes() -> None:
    assert _q4_weight(16, seed=8).nbytes() == 16 * 64 + 2 * 16 * 4 * 4
    assert quantize_q8_0(torch.randn(16, 64)).nbytes() == 16 * 64 + 16 * 2 * 4


def test_inconsistent_tensors_are_rejected() -> None:
    q8 = quantize_q8_0(torch.randn(4, 64))
    with pytest.raises(ValueError, match="unknown format"):
        QuantizedWeight("q3", q8.qs, q8.scales, None)
    with pytest.raises(ValueError, match="no mins"):
        QuantizedWeight("q8_0", q8.qs, q8.scales, q8.scales)
    with pytest.raises(ValueError, match="qs must be"):
        QuantizedWeight("q4", q8.qs, q8.scales, q8.scales)


@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
def test_16_bit_float_weights(fmt: str) -> None:
    """Values held as they are: rounding on the way in, exact widening on the way out; rows,
    row maps, concatenation and byte counts as for the quantized formats."""
    dense = torch.randn(40, 48)  # any in_features: no groups
    weight = to_half(dense, fmt)
    assert weight.shape == (40, 48) and weight.scales is None and weight.mins is None
    assert torch.equal(weight.dequantize(), dense.to(getattr(torch, fmt)).float())
    assert weight.nbytes() == 40 * 48 * 2
    index = torch.tensor([[3, 39], [0, 3]])
    assert torch.equal(weight.rows(index), weight.dequantize()[index])
    both = QuantizedWeight.cat([weight, weight.map_rows(lambda t: t[:5])])
    assert both.shape == (45, 48) and torch.equal(both.dequantize()[40:], weight.dequantize()[:5])
    q8 = quantize_q8_0(torch.randn(4, 64))
    assert torch.equal(to_half(q8, fmt).dequantize(), q8.dequantize().to(getattr(torch, fmt)).float())
    with pytest.raises(ValueError, match="no scales"):
        QuantizedWeight(fmt, weight.qs, torch.ones(40, 1), None)
    with pytest.raises(ValueError, match="2-D"):
        QuantizedWeight(fmt, weight.qs.float(), None, None)
    with pytest.raises(ValueError, match="not a 16-bit"):
        to_half(dense, "q8_0")


@pytest.mark.slow
def test_default_model_tensors(smollm2_gguf: Path) -> None:
    """SmolLM2's GGUF: a Q4_1 layer weight and the Q8_0 token embedding match gguf's dequantize."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(smollm2_gguf).tensors}
    for name, ggml_type in [("blk.0.ffn_down.weight", T.Q4_1), ("token_embd.weight", T.Q8_0)]:
        tensor = tensors[name]
        assert tensor.tensor_type == ggml_type
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        weight = from_gguf_blocks(tensor.data, tensor.tensor_type, shape)  # type: ignore[arg-type]
        assert weight is not None and weight.shape == shape
        assert torch.equal(weight.dequantize(), _reference(tensor.data, ggml_type, shape))
