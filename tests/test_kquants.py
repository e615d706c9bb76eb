"""GGUF's 5- and 6-bit types and the K types kept as stored: Q5_0 / Q5_1 -> ``q5``, Q4_K ->
``q4_k``, Q5_K -> ``q5_k``, Q6_K -> ``q6_k``.

``gguf.quants`` is the reference: the canonical form dequantizes to exactly what
``gguf.quants.dequantize`` gives (``gguf.quants.quantize`` writes Q5_0 / Q5_1; the K types are
random valid blocks, their float16 scales including a subnormal, a negative zero and the largest
value). The weight-only kernel, per instruction-set build this CPU runs, against the float64
product with the dequantized weight for 1-8 rows, more (group by group) and a prefill-sized
count, a row's result whatever its batch mates, and its tiles, transient dequantization and row
gathering as exact as the table.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from services.engine.core.kernels import cpu_qgemv
from services.engine.core.kernels.cpu_qgemv import CpuQGemv
from services.engine.core.kernels.native_build import load_library
from services.engine.core.linear import Linear, PackPlan
from services.engine.core.loaders.gguf_file import _quantized
from services.engine.core.quant.quantized_weight import (
    SUPPORTED_GGML_TYPES,
    QuantizedWeight,
    from_gguf_blocks,
    quantize_q8_0,
)
from services.engine.core.quant.type_summary import held_as, summarize_weight_types

NEW_TYPES = [T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
FORMAT_OF = {T.Q5_0: "q5", T.Q5_1: "q5", T.Q4_K: "q4_k", T.Q5_K: "q5_k", T.Q6_K: "q6_k"}
F16_OFFSETS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # byte offsets of d (and dmin)
OUT, IN = 70, 512  # 70 outputs: a partial last tile for every width; 2 super-blocks
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 512]  # register blocks, group by group, a prefill chunk


def _random_blocks(ggml_type: T, out: int, n_in: int, seed: int = 0) -> np.ndarray:
    """Valid blocks: gguf's own quantizer where it has one, else random bytes with finite float16
    scales (a few extreme ones first)."""
    rng = np.random.default_rng(seed)
    if ggml_type not in F16_OFFSETS:
        weight = rng.standard_normal((out, n_in)).astype(np.float32) * 0.05
        weight[3, 64:96] = 0.0  # an all-zero group (d = 0)
        return quantize(weight, ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n = out * n_in // block_size
    blocks = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
    for offset in F16_OFFSETS[ggml_type]:
        d = (rng.random(n) * 2e-3 - 1e-3).astype(np.float16)
        d[:3] = [6e-8, -0.0, 65504.0]  # a subnormal, negative zero, the largest float16
        blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(n, 2)
    return blocks.reshape(out, -1)


def _weight(ggml_type: T, out: int = OUT, n_in: int = IN, seed: int = 0) -> QuantizedWeight:
    weight = from_gguf_blocks(_random_blocks(ggml_type, out, n_in, seed), ggml_type, (out, n_in))
    assert weight is not None
    return weight


def _reference(raw: np.ndarray, ggml_type: T, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, ggml_type))).reshape(shape)


@functools.cache
def _kernel(isa: str) -> CpuQGemv:
    return CpuQGemv(load_library(cpu_qgemv.SOURCE, isa))


def _moderate(weight: QuantizedWeight) -> QuantizedWeight:
    """The same weight with the extreme super-block scales tamed, for products compared with a
    tolerance (65504 * 63 * 63 dwarfs every other term)."""
    if weight.d is None:
        return weight
    d = weight.d.float().clamp(-1e-3, 1e-3).half()
    dmin = None if weight.dmin is None else weight.dmin.float().clamp(-1e-3, 1e-3).half()
    return QuantizedWeight(weight.format, weight.qs, weight.scales, weight.mins, weight.qh, d, dmin)


# ------------------------------------------------------------------------------- conversion


@pytest.mark.parametrize("ggml_type", NEW_TYPES, ids=lambda t: t.name)
def test_blocks_dequantize_exactly(ggml_type: T) -> None:
    assert ggml_type in SUPPORTED_GGML_TYPES
    shape = (48, IN)
    raw = _random_blocks(ggml_type, *shape)
    weight = from_gguf_blocks(raw, ggml_type, shape)
    assert weight is not None and weight.format == FORMAT_OF[ggml_type] and weight.shape == shape
    assert torch.equal(weight.dequantize(), _reference(raw, ggml_type, shape))


@pytest.mark.parametrize(
    ("ggml_type", "bits"), [(T.Q5_0, 7.0), (T.Q4_K, 4.625), (T.Q5_K, 5.625), (T.Q6_K, 6.5625)],
    ids=lambda v: getattr(v, "name", str(v)),
)  # fmt: skip
def test_k_formats_hold_about_the_files_bytes(ggml_type: T, bits: float) -> None:
    """The K formats keep their integer sub-block scales: Q6_K's bytes exactly, Q4_K / Q5_K
    one byte per 32 more (their 6-bit scales and mins a byte each; the kernel's tiles pack them
    back); q5 has float32 scales."""
    weight = _weight(ggml_type)
    assert weight.nbytes() * 8 == bits * OUT * IN


@pytest.mark.parametrize("ggml_type", NEW_TYPES, ids=lambda t: t.name)
def test_row_operations(ggml_type: T) -> None:
    """Row maps (q/k un-permutation, embedding lookups) and concatenation (fused projections)
    carry every tensor of the format along."""
    weight, other = _weight(ggml_type, seed=1), _weight(ggml_type, out=24, seed=2)
    dense = weight.dequantize()
    perm = torch.randperm(OUT, generator=torch.Generator().manual_seed(0))
    assert torch.equal(weight.map_rows(lambda t: t[perm]).dequantize(), dense[perm])
    index = torch.tensor([[5, 0], [OUT - 1, 5]])
    assert torch.equal(weight.rows(index), dense[index])
    both = QuantizedWeight.cat([weight, other])
    assert both.format == weight.format and both.shape == (OUT + 24, IN)
    assert torch.equal(both.dequantize(), torch.cat([dense, other.dequantize()]))
    with pytest.raises(ValueError, match="formats and in_features"):
        QuantizedWeight.cat([weight, quantize_q8_0(torch.randn(4, IN))])


def test_inconsistent_tensors_are_rejected() -> None:
    q6 = _weight(T.Q6_K)
    with pytest.raises(ValueError, match="need d"):
        QuantizedWeight("q6_k", q6.qs, q6.scales, None, q6.qh)
    with pytest.raises(ValueError, match="no dmin"):
        QuantizedWeight("q6_k", q6.qs, q6.scales, None, q6.qh, q6.d, q6.d)
    with pytest.raises(ValueError, match="qh must be"):
        QuantizedWeight("q6_k", q6.qs, q6.scales, None, q6.qh[:, 1:], q6.d)
    with pytest.raises(ValueError, match="scales must be"):
        QuantizedWeight("q6_k", q6.qs, q6.scales.float(), None, q6.qh, q6.d)


def test_the_loader_keeps_the_new_types_as_stored() -> None:
    raw = _random_blocks(T.Q6_K, OUT, IN)
    tensor = SimpleNamespace(name="output.weight", tensor_type=T.Q6_K, data=raw)
    kept = _quantized(tensor, (OUT, IN), "q4")
    assert kept.format == "q6_k"
    assert torch.equal(kept.dequantize(), _reference(raw, T.Q6_K, (OUT, IN)))
    assert _quantized(tensor, (OUT, IN), "q8_0").format == "q8_0"  # q8_0 re-quantizes everything


def test_weight_type_summary() -> None:
    pairs = [(T.Q4_K, "q4_k")] * 3 + [("F32", torch.zeros(2))] * 5 + [(T.Q6_K, _weight(T.Q6_K))]
    line = "F32 -> float32 (5 tensors), Q4_K -> q4_k (3), Q6_K -> q6_k (1)"
    assert summarize_weight_types(pairs) == line
    assert summarize_weight_types([("Q8_0", "q8_0")]) == "Q8_0 -> q8_0 (1 tensor)"
    assert summarize_weight_types([]) == "no tensors"
    assert held_as(torch.zeros(1, dtype=torch.bfloat16)) == "bfloat16"


# ------------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("ggml_type", NEW_TYPES, ids=lambda t: t.name)
def test_kernel_equals_float64_reference(isa: str, ggml_type: T) -> None:
    """Register blocks (1-8 rows), group by group (more), a prefill chunk: x @ W^T + b against
    float64 over the dequantized weight; and each row's result whatever its batch mates."""
    qgemv = _kernel(isa)
    weight = _moderate(_weight(ggml_type, seed=3))
    packed = qgemv.tile_weight(weight)
    dense = weight.dequantize().double()
    torch.manual_seed(4)
    bias = torch.randn(OUT)
    x = torch.randn(max(ROWS), IN)
    expected = x.double() @ dense.T + bias.double()
    call = qgemv.bind(packed, qgemv.tile_format(weight), qgemv.tile_bias(bias), OUT)
    together = call(x)
    assert together.shape == (max(ROWS), OUT)
    scale = expected.abs().max()
    assert (together.double() - expected).abs().max() < 1e-5 * scale
    for rows in ROWS:
        got = call(x[:rows])
        assert torch.equal(got, together[:rows]), rows  # batch mates change nothing
    for r in (0, 7, 300):
        assert torch.equal(call(x[r : r + 1]), together[r : r + 1])


@pytest.mark.parametrize("ggml_type", [T.Q5_0, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out", [60, 330])  # even / odd tile counts, several calls per thread
def test_one_row_tile_sets(isa: str, ggml_type: T, threads: int, out: int) -> None:
    """A single row walks tiles two at a time: the same chain as the row-block path, however the
    tiles fall between the threads."""
    qgemv = _kernel(isa)
    weight = _moderate(_weight(ggml_type, out=out, seed=5))
    packed = qgemv.tile_weight(weight)
    x = torch.randn(2, IN)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one = qgemv(x[:1], packed, qgemv.tile_format(weight), None, out)
        two = qgemv(x, packed, qgemv.tile_format(weight), None, out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two[:1])


@pytest.mark.parametrize("ggml_type", NEW_TYPES, ids=lambda t: t.name)
def test_tiles_hold_every_bit(isa: str, ggml_type: T) -> None:
    """Tiles back to the canonical form, the transient float32 copy prefill hands to PyTorch and
    the rows a tied embedding gathers: all exactly the table, the extreme scales included."""
    qgemv = _kernel(isa)
    weight = _weight(ggml_type, seed=6)
    packed = qgemv.tile_weight(weight)
    assert packed.shape[1] == IN // qgemv.block_inputs[qgemv.tile_format(weight)]
    # the file's bits a weight: Q5_0 tiles (q5_0) hold the f16 scale, its offset implied (-16
    # times it), Q5_1 tiles the f16 scale and offset, the K types their super-blocks as they are
    assert qgemv.tile_format(weight) == ("q5_0" if ggml_type == T.Q5_0 else weight.format)
    bits = {T.Q5_0: 5.5, T.Q5_1: 6.0, T.Q4_K: 4.5, T.Q5_K: 5.5, T.Q6_K: 6.5625}[ggml_type]
    assert packed.numel() * 8 == bits * packed.shape[0] * qgemv.tile * IN
    back = qgemv.untile(packed, qgemv.tile_format(weight), OUT)
    for name, tensor in weight.tensors().items():
        assert torch.equal(getattr(back, name).view(torch.uint8), tensor.view(torch.uint8)), name
    dense = weight.dequantize()
    assert torch.equal(qgemv.dequantize_t(packed, qgemv.tile_format(weight), OUT).T, dense)
    index = torch.tensor([[0, OUT - 1, 17], [16, 5, 5]])
    assert torch.equal(qgemv.gather_rows(packed, qgemv.tile_format(weight), index, OUT), dense[index])


def test_linear_layer_serves_the_new_formats(isa: str) -> None:
    """Without a kernel a layer dequantizes per call (exactly F.linear on the table); packed, it
    runs the kernel and holds the tiles only."""
    qgemv = _kernel(isa)
    weight = _moderate(_weight(T.Q6_K, seed=7))
    x = torch.randn(5, IN)
    layer = Linear(IN, OUT)
    layer.set_quantized(weight)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, weight.dequantize(), layer.bias))
        layer.pack(PackPlan(qkernel=qgemv))
        assert layer.weight_format == "q6_k" and layer.quant is None and layer.packed is not None
        assert torch.allclose(layer(x), F.linear(x, weight.dequantize(), layer.bias), atol=1e-4)


def test_a_fused_layer_keeps_parts_of_different_formats(isa: str) -> None:
    """A Q4_K_M file's q/k/v: Q4_K q and k next to a Q6_K v. The loader keeps each as stored (one
    part per run of a format, no Q8_0 re-quantization), and the layer, with its fused bias, is
    the fused product whether it dequantizes per call or runs each part's kernel."""
    from collections import Counter

    from services.engine.core.loaders.weights import _fuse

    q, k, v = (_moderate(_weight(t, out, IN, seed)) for t, out, seed in
               ((T.Q4_K, 64, 1), (T.Q4_K, 32, 2), (T.Q6_K, 32, 3)))  # fmt: skip
    parts = _fuse([q, k, v], "q4_a8")
    assert isinstance(parts, list) and [p.format for p in parts] == ["q4_k", "q6_k"]
    assert sum(p.nbytes() for p in parts) == q.nbytes() + k.nbytes() + v.nbytes()
    float_parts = _fuse([q, torch.randn(32, IN), v], "q8_0")  # a float part: Q8_0 of its own
    assert isinstance(float_parts, list)
    assert [p.format for p in float_parts] == ["q4_k", "q8_0", "q6_k"]
    dense = _fuse([q, k, v], "bfloat16")  # a 16-bit load: one float weight, converted as one
    assert isinstance(dense, torch.Tensor) and dense.shape == (128, IN)
    layer = Linear(IN, 128, bias=True)
    layer.set_parts(parts)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(128))  # loaded after the weight: the parts see it
    weight = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    x = torch.randn(5, IN)
    with torch.inference_mode():
        assert torch.equal(layer.dequantized_weight(), weight)
        assert torch.allclose(layer(x), F.linear(x, weight, layer.bias), atol=1e-5)
        pack_plan = PackPlan(qkernel=_kernel(isa))
        for module in layer.modules():  # as pack_linears does: the parts are layers of their own
            if isinstance(module, Linear):
                module.pack(pack_plan)
        assert layer.weight_format == "q4_k+q6_k" and layer.packed is None
        tiles = layer.kernel_tiles(1)
        assert tiles is not None and [t.format for t in tiles] == ["q4_k", "q6_k"]
        assert torch.allclose(layer(x), F.linear(x, weight, layer.bias), atol=1e-4)
    assert Counter(type(m).__name__ for m in layer.modules()) == Counter(Linear=3, ModuleList=1)
    with pytest.raises(ValueError, match="do not fit"):
        Linear(IN, 100).set_parts(parts)
