"""The int8-activation decode kernel (``tandem_a8_gemv`` in ``cpu_q4a8_gemm.c``, ``--dtype q4_a8``'s
decode rows), per instruction-set build this machine runs.

Against a float64 reference of the same int8-quantized math: each row rounded per group of 32
inputs as the kernel documents (``q = round_half_even(x * (127 / max|x|))``, ``d = max|x| / 127``,
the prefill GEMM's rounding), times the weight dequantized exactly, so the comparison is to float32
summation error, not to the rounding the kernel adds on purpose. Every format it reads (q8_0, q4
from Q4_0 and Q4_1, q5 from Q5_0 and Q5_1, q4_k, q5_k, q6_k), a row's result whatever its batch
mates and thread count, the rounding equal to the GEMM's, and bad arguments as errors. In a
:class:`Linear` (``PackPlan.int8_decode``, what ``q4_a8_decode`` sets): every row takes it (or the
GEMM, with the same bits), and an autotune never switches a layer's rows back to float32.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from torch import nn

from services.engine.core.kernels import cpu_q4a8_gemm, cpu_qgemv, isa_tuning, native_build
from services.engine.core.kernels.cpu_q4a8_gemm import DECODE_FORMATS, CpuQ4A8Gemm
from services.engine.core.kernels.cpu_qgemv import CpuQGemv
from services.engine.core.kernels.native_build import load_library
from services.engine.core.linear import Linear, PackPlan, pack_linears
from services.engine.core.quant.quantized_weight import QuantizedWeight
from tests.conftest import native_kernel_or_skip
from tests.int8_cases import (
    IN,
    OUT,
    TWIN_RANGES,
    TYPES,
    int8_kernels,
    int8_rows,
    quant_weight,
    reference,
    rounded_rows,
    twin_inputs,
)

ROWS = [1, 2, 3, 4, 5, 7, 9]  # register blocks of 4, 2 and 1 rows


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", ROWS)
def test_kernel_equals_the_int8_reference(isa: str, ggml_type: T, rows: int) -> None:
    qgemv, a8 = int8_kernels(isa)
    weight = quant_weight(ggml_type, seed=rows)
    bias = torch.randn(OUT)
    call = a8.bind_decode(qgemv.tile_weight(weight), qgemv.tile_bias(bias), OUT, qgemv.tile_format(weight))
    x = int8_rows(rows, seed=rows)
    got = call(x).double()
    expected = reference(x, weight, bias)
    scale = rounded_rows(x).abs() @ weight.dequantize().double().abs().T  # the products' size
    error = ((got - expected).abs() / (scale + 1e-30)).max().item()
    assert error < 1e-5, (ggml_type.name, rows, error)  # float32 sums of ~16 groups


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_its_batch_mates(isa: str, ggml_type: T) -> None:
    """Every row count (one row in registers; 2 to 7 in register blocks of 2, an odd one alone;
    8 to 15 group by group; 16 and more as a GEMM over the tile's panel in register blocks of
    rows, 70 leaving a partial block) and thread count runs the same chain per output: bit
    equal."""
    qgemv, a8 = int8_kernels(isa)
    weight = quant_weight(ggml_type, seed=3)
    call = a8.bind_decode(qgemv.tile_weight(weight), None, OUT, qgemv.tile_format(weight))
    x = int8_rows(70, seed=5)
    previous = torch.get_num_threads()
    try:
        alone = torch.cat([call(x[i : i + 1]) for i in range(70)])
        torch.set_num_threads(1)
        assert torch.equal(call(x), alone)
    finally:
        torch.set_num_threads(previous)
    for lo, hi in ((0, 2), (3, 8), (1, 8), (2, 10), (5, 45)):
        assert torch.equal(call(x[lo:hi]), alone[lo:hi]), (lo, hi)


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_every_tile_is_computed_once_whoever_takes_it(isa: str, ggml_type: T) -> None:
    """The team shares a call's tiles out (tile_claims.h: a contiguous range each, the tails
    taken by threads done with their own). With more threads than this machine's cores (so some
    are preempted mid-range and others take over their tails), and more threads than tiles (so
    some start with nothing and only take), every output is there, bit equal to one thread's."""
    qgemv, a8 = int8_kernels(isa)
    out = 37 * 32 + 5  # a partial last tile, and an odd count of tiles at either width
    weight = quant_weight(ggml_type, seed=11, out=out)
    call = a8.bind_decode(qgemv.tile_weight(weight), None, out, qgemv.tile_format(weight))
    small = a8.bind_decode(qgemv.tile_weight(quant_weight(ggml_type, seed=12)), None, OUT,
                           qgemv.tile_format(weight))  # fmt: skip
    x = int8_rows(3, seed=13)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone, alone_small = call(x), small(x)
        for threads in (2, 3, 8, 17):
            torch.set_num_threads(threads)
            for _ in range(20):
                assert torch.equal(call(x[:1]), alone[:1]), threads
                assert torch.equal(call(x), alone), threads
                assert torch.equal(small(x[:1]), alone_small[:1]), threads
    finally:
        torch.set_num_threads(previous)


def test_rounding_equals_the_gemms(isa: str) -> None:
    """Decode and prompt rows round their inputs alike: on q4 tiles the two kernels agree to
    float32 summation error (their sums run in different orders)."""
    qgemv, a8 = int8_kernels(isa)
    weight = quant_weight(T.Q4_1, seed=7)
    packed = qgemv.tile_weight(weight)
    x = int8_rows(5, seed=9)
    got, gemm = a8.bind_decode(packed, None, OUT, "q4")(x), a8(x, packed, None, OUT, "q4")
    assert (got - gemm).abs().max().item() < 1e-4 * gemm.abs().max().item()


def test_bad_arguments_are_errors(isa: str) -> None:
    qgemv, a8 = int8_kernels(isa)
    weight = quant_weight(T.Q4_K)
    packed = qgemv.tile_weight(weight)
    with pytest.raises(ValueError, match="reads"):
        a8.bind_decode(packed, None, OUT, "bfloat16")
    with pytest.raises(ValueError, match="do not hold"):
        a8.bind_decode(packed, None, OUT + qgemv.tile, "q4_k")
    with pytest.raises(ValueError, match="do not hold"):
        a8.bind_decode(packed[..., :-1], None, OUT, "q4_k")
    assert set(DECODE_FORMATS) == {"q8_0", "q4", "q5", "q5_0", "q4_k", "q5_k", "q6_k"}


# ------------------------------------------------------------------ VNNI's vpdpbusd, same bits


@pytest.fixture(scope="module", params=["emulated", "avx512vnni", "avxvnni"])
def vnni_twins(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[CpuQGemv, CpuQ4A8Gemm, CpuQ4A8Gemm]:
    """(tiles, a build summing its integer dots with vpmaddubsw, its twin with vpdpbusd): a VNNI
    set where this CPU has one; "emulated" everywhere: this CPU's own vector set built with
    vpdpbusd emulated (``TANDEM_EMULATE_DPBUSD``), so the VNNI loops run here too."""
    native_kernel_or_skip()
    if request.param == "emulated":
        base = native_build.vector_isa(native_build.selected_isa())
        if base == "generic":
            pytest.skip("no byte multiply-add to emulate vpdpbusd with")
        target = tmp_path_factory.mktemp("vnni") / "cpu_q4a8_gemm-emulated.so"
        flags = [*native_build.CFLAGS, *native_build.isa_flags(base), "-DTANDEM_EMULATE_DPBUSD"]
        native_build.compile_library(cpu_q4a8_gemm.SOURCE, base, flags, target)
        twin = CpuQ4A8Gemm(ctypes.CDLL(str(target)))
    else:
        if request.param not in native_build.supported_isas():
            pytest.skip(f"this CPU lacks {request.param}")
        base = native_build.vector_isa(request.param)
        twin = int8_kernels(request.param)[1]
    qgemv, a8 = int8_kernels(base)
    assert twin.dpbusd and not a8.dpbusd and twin.tile == a8.tile
    return qgemv, a8, twin


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_vnni_dots_give_the_same_bits(
    vnni_twins: tuple[CpuQGemv, CpuQ4A8Gemm, CpuQ4A8Gemm], ggml_type: T
) -> None:
    """The int8 decode rows by vpdpbusd equal vpmaddubsw's bit for bit, every path (one row, row
    blocks, group by group, the panel), random and largest values; and the prefill GEMM's."""
    qgemv, a8, twin = vnni_twins
    weights, x = twin_inputs(ggml_type)
    for weight in weights:
        packed, fmt = qgemv.tile_weight(weight), qgemv.tile_format(weight)
        bias = qgemv.tile_bias(torch.randn(OUT))
        calls = [(a8.bind_decode(packed, bias, OUT, fmt), twin.bind_decode(packed, bias, OUT, fmt))]
        if fmt in cpu_q4a8_gemm.FORMATS:
            calls.append((a8.bind(packed, bias, OUT, fmt), twin.bind(packed, bias, OUT, fmt)))
        for plain, vnni in calls:
            for lo, hi in TWIN_RANGES:
                assert torch.equal(vnni(x[lo:hi]), plain(x[lo:hi])), (ggml_type.name, lo, hi)


def test_tune_times_the_vnni_build_against_its_base(
    vnni_twins: tuple[CpuQGemv, CpuQ4A8Gemm, CpuQ4A8Gemm],
) -> None:
    """``tandem tune``'s comparison (kernels/isa_tuning.py) on the real pair: both regimes timed,
    every format's decode rows and the GEMM run through both builds; a pair reading other tiles
    is refused."""
    qgemv, a8, twin = vnni_twins
    speedup = isa_tuning.compare(twin, a8, rounds=2, read_bytes=8 << 20)
    assert set(speedup) == {"decode", "prefill"}
    assert all(0 < ratio < float("inf") for ratio in speedup.values())
    other = CpuQ4A8Gemm(load_library(cpu_q4a8_gemm.SOURCE, "generic"))
    if other.tile != a8.tile:
        with pytest.raises(ValueError, match="read different tiles"):
            isa_tuning.compare(other, a8, rounds=1, read_bytes=1 << 20)


# ------------------------------------------------------------------------------- in a Linear


def _linear(ggml_type: T, seed: int, out: int = OUT, n_in: int = IN) -> tuple[Linear, QuantizedWeight]:
    weight = quant_weight(ggml_type, seed, out, n_in)
    layer = Linear(n_in, out)
    layer.set_quantized(weight)
    return layer, weight


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q5_0], ids=lambda t: t.name)
def test_linear_rounds_every_row_with_one_definition(
    ggml_type: T, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``q4_a8_decode`` (``int8_decode``): every row of every layer the decode kernel reads is
    rounded to int8, whatever the call's row count, with the decode kernel's bits (the GEMM, where
    the format has one, gives the same); without ``int8_decode`` (``q4_a8``) only the formats the
    GEMM reads round, and ``--dtype q4`` (no int8 kernel at all) keeps float32 rows."""
    native_kernel_or_skip()
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TANDEM_AUTOTUNE", "measure")  # timed now, as `tandem tune` does
    qgemv, a8 = cpu_qgemv.load_cpu_qgemv(), cpu_q4a8_gemm.load_cpu_q4a8_gemm()
    assert qgemv is not None and a8 is not None
    layer, weight = _linear(ggml_type, 1)
    pack_linears(nn.Sequential(layer), PackPlan(qkernel=qgemv, a8kernel=a8, int8_decode=True))
    assert layer.int8_activations
    decode = a8.bind_decode(layer.packed, None, OUT, layer.weight_format)
    big = int8_rows(40, seed=2)
    with torch.inference_mode():
        whole = decode(big)
        for rows in (1, 5, 15, 16, 40):
            assert torch.equal(layer(big[:rows]), whole[:rows])
        if ggml_type in (T.Q4_K,):  # a GEMM format: the GEMM's bits are the decode kernel's
            assert torch.equal(a8(big, layer.packed, None, OUT, layer.weight_format), whole)
    tiles = layer.kernel_tiles(1)
    assert tiles is not None and len(tiles) == 1 and tiles[0].int8_activations

    prompt_only, _ = _linear(ggml_type, 1)  # q4_a8: the GEMM's formats only
    pack_linears(nn.Sequential(prompt_only), PackPlan(qkernel=qgemv, a8kernel=a8))
    assert prompt_only.int8_activations == (ggml_type == T.Q4_K)
    plain, _ = _linear(ggml_type, 1)  # q4: float32 rows
    pack_linears(nn.Sequential(plain), PackPlan(qkernel=qgemv))
    assert not plain.int8_activations
    with torch.inference_mode():
        assert torch.equal(plain(big), plain.float_forward(big))
    plain_tiles = plain.kernel_tiles(1)
    assert plain_tiles is not None and not plain_tiles[0].int8_activations


class SlowDecode(CpuQ4A8Gemm):
    """The real decode kernel, a few milliseconds late on every call."""

    calls = 0

    def bind_decode(self, packed, bias, out_features, fmt):  # type: ignore[no-untyped-def]
        call = super().bind_decode(packed, bias, out_features, fmt)

        def slow(x: torch.Tensor) -> torch.Tensor:
            SlowDecode.calls += 1
            time.sleep(0.05)
            return call(x)

        return slow


def test_a_slower_decode_kernel_keeps_the_layers_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounding activations to int8 is the dtype's numeric definition, not a speed choice: an
    autotune that measured the decode kernel slower than float32 activations must not switch a
    layer back (two workers, or two machines of one kind, would then disagree on its bits)."""
    native_kernel_or_skip()
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TANDEM_AUTOTUNE", "measure")  # timed now, as `tandem tune` does
    slow = SlowDecode(load_library(cpu_q4a8_gemm.SOURCE))
    slow.build = f"slow-{slow.build}"
    layer, weight = _linear(T.Q6_K, 2, out=256, n_in=256)
    pack_linears(nn.Sequential(layer), PackPlan(qkernel=cpu_qgemv.load_cpu_qgemv(), a8kernel=slow,
                                                autotune=True, int8_decode=True))  # fmt: skip
    assert layer.int8_activations
    SlowDecode.calls = 0
    x = torch.randn(3, 256)
    with torch.inference_mode():
        got = layer(x)
    assert SlowDecode.calls == 1
    assert torch.allclose(got.double(), reference(x, weight, None), atol=1e-4)  # int8 rows
