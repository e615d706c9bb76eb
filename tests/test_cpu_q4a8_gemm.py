"""The 4-bit-weight x 8-bit-activation GEMM (``cpu_q4a8_gemm.c``, ``--dtype q4_a8``), per
instruction-set build this machine runs.

Against a float64 reference that rounds the activations as the kernel documents (per row and
group of 32: ``q = round_half_even(x * (127 / max|x|))``, ``d = max|x| / 127``), so the comparison is to float32 summation error, not to the rounding the
kernel adds on purpose. Also: a row's result does not depend on its batch mates, bad arguments
are errors, and in a :class:`Linear` the kernel serves only the rows marked as prompt tokens (the
model runner marks them: never a generated token's, not even when a preempted or migrated request
recomputes it), and only where it measured faster.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn

from services.engine.core.kernels import cpu_q4a8_gemm, cpu_qgemv, native_build
from services.engine.core.kernels.cpu_q4a8_gemm import CpuQ4A8Gemm
from services.engine.core.kernels.cpu_qgemv import CpuQGemv
from services.engine.core.kernels.native_build import load_library
from services.engine.core.linear import Linear, PackPlan, pack_linears
from services.engine.core.quant.quantized_weight import QuantizedWeight, from_gguf_blocks
from tests.conftest import native_kernel_or_skip

ROWS = [1, 2, 3, 5, 33, 70]  # register blocks of 4 (AVX-512) or 3 rows (AVX2, generic: 2), 1-row tails
OUT, IN = 70, 288  # a partial last tile for every width; 9 groups of 32


@functools.cache
def _kernels(isa: str) -> tuple[CpuQGemv, CpuQ4A8Gemm]:
    return (
        CpuQGemv(load_library(cpu_qgemv.SOURCE, isa)),
        CpuQ4A8Gemm(load_library(cpu_q4a8_gemm.SOURCE, isa)),
    )


def _q4_weight(seed: int, out: int = OUT, inputs: int = IN) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    qs = torch.randint(0, 256, (out, inputs // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(out, inputs // 32, generator=gen) * 0.02).half().float()  # as GGUF holds them
    mins = (-8 * scales * torch.rand(out, inputs // 32, generator=gen)).half().float()
    return QuantizedWeight("q4", qs, scales, mins)


def reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 of what the kernel computes: x rounded to int8 per group times the weight."""
    rows, inputs = x.shape
    groups = x.reshape(rows, inputs // 32, 32)
    peak = groups.abs().amax(-1, keepdim=True)
    # a true division (torch's 127 / t is 127 * (1 / t)); an all-zero group rounds to zeros
    inverse = torch.where(peak > 0, torch.full_like(peak, 127.0) / peak, torch.zeros_like(peak))
    rounded = torch.round(groups * inverse).double() * (peak.double() / 127)
    y = rounded.reshape(rows, inputs) @ weight.dequantize().double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("rows", ROWS)
def test_kernel_equals_the_int8_reference(isa: str, rows: int) -> None:
    qgemv, gemm = _kernels(isa)
    weight = _q4_weight(rows)
    packed = qgemv.tile_weight(weight)
    bias = torch.randn(OUT)
    x = torch.randn(rows, IN) * torch.logspace(-2, 1, IN)  # groups of very different sizes
    x[0, :32] = 0.0  # an all-zero group (d = 0)
    got = gemm(x, packed, qgemv.tile_bias(bias), OUT)
    expected = reference(x, weight, bias)
    assert got.shape == (rows, OUT)
    assert (got.double() - expected).abs().max() < 1e-4 * expected.abs().max(), isa
    # the rounding it adds on purpose, against float32 activations: small, not zero
    dense = x @ weight.dequantize().T + bias
    assert 0 < (got - dense).abs().max() < 0.05 * dense.abs().max()


def test_a_rows_result_does_not_depend_on_its_batch_mates(isa: str) -> None:
    qgemv, gemm = _kernels(isa)
    weight = _q4_weight(7, out=100, inputs=576)
    packed = qgemv.tile_weight(weight)
    x = torch.randn(37, 576)
    together = gemm(x, packed, None, 100)
    for start, stop in ((0, 1), (3, 4), (5, 8), (36, 37), (1, 34)):
        assert torch.equal(gemm(x[start:stop], packed, None, 100), together[start:stop])


def test_strided_input_rows(isa: str) -> None:
    qgemv, gemm = _kernels(isa)
    weight = _q4_weight(3)
    packed = qgemv.tile_weight(weight)
    wide = torch.randn(9, 2 * IN)
    assert torch.equal(gemm(wide[:, :IN], packed, None, OUT), gemm(wide[:, :IN].clone(), packed, None, OUT))


def test_bad_arguments_are_errors() -> None:
    native_kernel_or_skip()
    gemm = cpu_q4a8_gemm.load_cpu_q4a8_gemm()
    qgemv = cpu_qgemv.load_cpu_qgemv()
    assert gemm is not None and qgemv is not None
    packed = qgemv.tile_weight(_q4_weight(0))
    with pytest.raises(ValueError, match="inputs"):
        gemm(torch.randn(2, IN + 32), packed, None, OUT)
    with pytest.raises(TypeError, match="float32"):
        gemm(torch.randn(2, IN, dtype=torch.float64), packed, None, OUT)
    with pytest.raises(ValueError, match="do not hold"):
        gemm.bind(packed, None, packed.shape[0] * gemm.tile + 1)
    with pytest.raises(ValueError, match="do not hold"):
        gemm.bind(packed[..., :-1], None, OUT)
    assert gemm(torch.randn(0, IN), packed, None, OUT).shape == (0, OUT)


def _q4_linear(seed: int, out: int = 512, inputs: int = 576) -> tuple[Linear, QuantizedWeight]:
    layer = Linear(inputs, out)
    weight = _q4_weight(seed, out, inputs)
    layer.set_quantized(weight)
    return layer, weight


@pytest.mark.usefixtures("one_thread")
def test_linear_rounds_every_row_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One numeric definition per layer: every row is rounded to int8, whatever the call's row
    count; the GEMM (many rows) and the decode kernel (a few) give a row the same bits."""
    native_kernel_or_skip()
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TANDEM_AUTOTUNE", "measure")  # timed now, as `tandem tune` does
    plan = PackPlan(qkernel=cpu_qgemv.load_cpu_qgemv(), a8kernel=cpu_q4a8_gemm.load_cpu_q4a8_gemm())
    layer, weight = _q4_linear(1)
    pack_linears(nn.Sequential(layer), plan, free_dense=True)
    assert layer.int8_activations
    assert plan.qkernel is not None and plan.a8kernel is not None
    a8 = functools.partial(plan.a8kernel, packed=layer.packed, bias=None, out_features=512)
    big = torch.randn(70, 576)
    with torch.inference_mode():
        whole = layer(big)
        assert torch.equal(whole, a8(big))  # the GEMM's rounding of every row
        for rows in (1, 5, 15, 16, 70):
            assert torch.equal(layer(big[:rows]), whole[:rows])
        assert torch.equal(layer.int8_decode_forward(big), whole)  # the decode kernel: same bits
        assert not torch.equal(whole, layer.float_forward(big))
        assert torch.allclose(whole, big @ weight.dequantize().T, atol=0.05, rtol=0.05)


class SlowQ4A8(CpuQ4A8Gemm):
    """The real 8-bit-activation kernel, a few milliseconds late on every call."""

    calls = 0

    def bind(self, packed, bias, out_features, fmt="q4"):  # type: ignore[no-untyped-def]
        call = super().bind(packed, bias, out_features, fmt)

        def slow(x: torch.Tensor) -> torch.Tensor:
            SlowQ4A8.calls += 1
            time.sleep(0.05)
            return call(x)

        return slow


@pytest.mark.usefixtures("one_thread")
def test_a_slower_int8_gemm_loses_its_autotune(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMM is only a faster way to the decode kernel's numbers: measured slower, it never
    runs, and the layer's rows still round to int8 (through the decode kernel)."""
    native_kernel_or_skip()
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TANDEM_AUTOTUNE", "measure")  # timed now, as `tandem tune` does
    slow = SlowQ4A8(load_library(cpu_q4a8_gemm.SOURCE))
    slow.build = f"slow-{slow.build}"
    layer, weight = _q4_linear(2, out=256, inputs=256)
    pack_linears(nn.Sequential(layer), PackPlan(qkernel=cpu_qgemv.load_cpu_qgemv(), a8kernel=slow,
                                                autotune=True), free_dense=True)  # fmt: skip
    assert layer.int8_activations
    SlowQ4A8.calls = 0
    x = torch.randn(100, 256)
    with torch.inference_mode():
        assert torch.equal(layer(x), layer.int8_decode_forward(x))
        assert torch.allclose(layer(x), x @ weight.dequantize().T, atol=0.05, rtol=0.05)
    assert SlowQ4A8.calls == 0


def test_the_int8_kernel_follows_an_instruction_set_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/engine_throughput.py measures each instruction set in one process, clearing the loaded
    kernels between sets: the q4 x int8 kernel must then match the weight-only kernel's tiles. It
    used to keep the first set's build (``q4 tiles (128, 64, 384) do not hold 2048 outputs`` on a
    Llama-3.2-1B-shaped Q4_K_M file: AVX2 tiles, the AVX-512 kernel)."""
    from services.engine.core.kernels.loaded import forget_loaded_kernels
    from services.engine.core.kernels.native_build import supported_isas
    from services.engine.core.linear import pack_plan

    native_kernel_or_skip()
    if len(supported_isas()) < 2:
        pytest.skip("one instruction set here: nothing to switch")
    try:
        for isa in supported_isas()[-2:]:  # the 1B shapes: q_proj / o_proj, fused qkv, gate_up
            monkeypatch.setenv("TANDEM_CPU_ISA", isa)
            forget_loaded_kernels()
            cpu = torch.device("cpu")
            plan = pack_plan(cpu, torch.float32, autotune=False, int8_activations=True)
            assert plan is not None and plan.a8kernel is not None and plan.qkernel is not None
            for out, inputs in ((2048, 2048), (3072, 2048), (2048, 8192)):
                layer, weight = _q4_linear(out, out, inputs)
                layer.pack(plan)
                assert layer.int8_activations
                x = torch.randn(3, inputs)
                with torch.inference_mode():
                    assert torch.allclose(layer.int8_forward(x), reference(x, weight, None).float(),
                                          rtol=1e-4, atol=1e-3)  # fmt: skip
            # a VNNI set (or neondot) builds the int8 kernel its way, the tiles as its base set
            assert plan.a8kernel.isa == native_build.library_isa(cpu_q4a8_gemm.SOURCE, isa)
            assert plan.qkernel.isa == native_build.library_isa(cpu_qgemv.SOURCE, isa)
    finally:
        monkeypatch.undo()
        forget_loaded_kernels()  # later tests get the selected set's builds again


def _q4_k_weight(seed: int, out: int, inputs: int) -> QuantizedWeight:
    """Random Q4_K super-blocks (random scales, mins and nibbles, small float16 d and dmin)."""
    rng = np.random.default_rng(seed)
    n = out * inputs // 256
    blocks = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    for offset in (0, 2):
        d = (rng.random((n, 1)) * 1e-3).astype(np.float16)
        blocks[:, offset : offset + 2] = d.view(np.uint8)
    weight = from_gguf_blocks(blocks, GGMLQuantizationType.Q4_K, (out, inputs))
    assert weight is not None and weight.format == "q4_k"
    return weight


@pytest.mark.parametrize("rows", [1, 3, 70])
def test_q4_k_tiles_equal_the_int8_reference(isa: str, rows: int) -> None:
    """Q4_K kept as stored (``q4_k`` tiles: scales d * sc and offsets -dmin * m per group, made in
    the kernel) is read by the same integer path as q4."""
    qgemv, gemm = _kernels(isa)
    weight = _q4_k_weight(rows, OUT, 512)
    packed = qgemv.tile_weight(weight)
    bias = torch.randn(OUT)
    x = torch.randn(rows, 512) * torch.logspace(-2, 1, 512)
    call = gemm.bind(packed, qgemv.tile_bias(bias), OUT, "q4_k")
    got = call(x)
    expected = reference(x, weight, bias)
    assert (got.double() - expected).abs().max() < 1e-4 * expected.abs().max(), isa
    assert torch.equal(call(x[-1:]), got[-1:])  # a row alone, the same bits
    with pytest.raises(ValueError, match="do not hold"):
        gemm.bind(packed, None, OUT, "q4")  # q4_k blocks are not q4 blocks
    with pytest.raises(ValueError, match="reads"):
        gemm.bind(packed, None, OUT, "q6_k")


def test_a_q4_k_linear_rounds_prompt_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    native_kernel_or_skip()
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TANDEM_AUTOTUNE", "measure")  # timed now, as `tandem tune` does
    plan = PackPlan(qkernel=cpu_qgemv.load_cpu_qgemv(), a8kernel=cpu_q4a8_gemm.load_cpu_q4a8_gemm())
    layer = Linear(512, 96)
    layer.set_quantized(_q4_k_weight(4, 96, 512))
    pack_linears(nn.Sequential(layer), plan, free_dense=True)
    assert layer.int8_activations and layer.weight_format == "q4_k"
    x = torch.randn(40, 512)
    with torch.inference_mode():
        assert torch.equal(layer(x), layer.int8_forward(x))
        assert torch.equal(layer(x[:3]), layer.int8_forward(x)[:3])
        assert not torch.equal(layer(x), layer.float_forward(x))
