"""Every instruction-set build of the CPU kernels (avx512vnni, avx512, avxvnni, avx2, generic) on this machine.

Per build: the float32, q8_0, q4, bfloat16 and float16 kernels equal a float64 reference (the
compact ones on the dequantized weight, both the few-rows register path and the group-by-group path);
every one of the 65,536 bfloat16 and float16 bit patterns widens exactly; a row's result
does not depend on its batch mates (one row, 4- and 2-tile sets, register blocks, group blocks); tiling round-trips
and stores nibbles in step order; the
decode- and prefill-attention kernels equal the torch reference. Also: a bad or unsupported ``TANDEM_CPU_ISA``
is a clear build error and the loaders fall back to PyTorch.
"""

from __future__ import annotations

import functools
import logging
import platform

import pytest
import torch

from services.engine.core.attention import AttentionMetadata, TorchPagedAttention
from services.engine.core.kernels import cpu_gemv, cpu_paged_attention, cpu_qgemv
from services.engine.core.kernels import native_build
from services.engine.core.kernels.cpu_gemv import CpuGemv
from services.engine.core.kernels.cpu_paged_attention import CpuPagedAttention
from services.engine.core.kernels.cpu_qgemv import CpuQGemv
from services.engine.core.kernels.native_build import (
    NativeBuildError,
    build_library,
    load_library,
    selected_isa,
    supported_isas,
)
from services.engine.core.quant.quantized_weight import (
    HALF_FORMATS,
    QuantizedWeight,
    quantize_q8_0,
    to_half,
)

ROWS = [1, 2, 3, 5, 8, 9, 17, 40]  # register blocks of 8/4/2/1; more than 8 go group by group
OUT, IN = 70, 288  # 70 outputs: a partial last tile for every width; 288 inputs: a partial K block


@functools.cache
def _kernels(isa: str) -> tuple[CpuGemv, CpuQGemv]:
    return CpuGemv(load_library(cpu_gemv.SOURCE, isa)), CpuQGemv(load_library(cpu_qgemv.SOURCE, isa))


def _q8_weight(seed: int, out: int = OUT) -> QuantizedWeight:
    torch.manual_seed(seed)
    return quantize_q8_0(torch.randn(out, IN) * 0.1)


def _q4_weight(seed: int, out: int = OUT) -> QuantizedWeight:
    """Random nibbles with float16-representable scales and offsets, as a GGUF holds them."""
    gen = torch.Generator().manual_seed(seed)
    qs = torch.randint(0, 256, (out, IN // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(out, IN // 32, generator=gen) * 0.02 + 1e-3).half().float()
    mins = (-torch.rand(out, IN // 32, generator=gen) * 0.15).half().float()
    return QuantizedWeight("q4", qs, scales, mins)


def _weights(out: int = OUT) -> dict[str, QuantizedWeight]:
    torch.manual_seed(7)
    dense = torch.randn(out, IN) * 0.1
    halves = {fmt: to_half(dense, fmt) for fmt in HALF_FORMATS}
    return {"q8_0": _q8_weight(1, out), "q4": _q4_weight(2, out), **halves}


FORMATS = ["q8_0", "q4", "bfloat16", "float16"]


def test_kernels_report_their_isa(isa: str) -> None:
    gemv, qgemv = _kernels(isa)
    assert gemv.isa == qgemv.isa == native_build.library_isa(cpu_gemv.SOURCE, isa)
    assert gemv.tile == qgemv.tile == {"avx512": 32, "avx2": 16, "generic": 8}[native_build.vector_isa(isa)]
    assert f"-{gemv.isa}-" in gemv.build and f"-{gemv.isa}-" in qgemv.build


@pytest.mark.parametrize("bias", [False, True])
def test_float32_kernel_equals_float64_reference(isa: str, bias: bool) -> None:
    gemv, _ = _kernels(isa)
    torch.manual_seed(3)
    weight, b = torch.randn(OUT, IN) * 0.1, torch.randn(OUT)
    tiled = gemv.tile_weight(weight)
    for rows in ROWS:
        x = torch.randn(rows, IN)
        expected = x.double() @ weight.double().T + (b.double() if bias else 0)
        got = gemv(x, tiled, gemv.tile_bias(b) if bias else None, OUT)
        assert got.shape == (rows, OUT)
        assert torch.allclose(got.double(), expected, atol=2e-5), (rows, (got - expected).abs().max())


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_kernel_equals_float64_reference(isa: str, fmt: str) -> None:
    """Both paths (register blocks, group by group) against x @ dequantized W in float64."""
    _, qgemv = _kernels(isa)
    weight = _weights()[fmt]
    dense = weight.dequantize().double()
    packed = qgemv.tile_weight(weight)
    torch.manual_seed(4)
    b = torch.randn(OUT)
    for rows in ROWS:
        x = torch.randn(rows, IN)
        for bias in (None, b):
            expected = x.double() @ dense.T + (0 if bias is None else bias.double())
            got = qgemv(x, packed, fmt, None if bias is None else qgemv.tile_bias(bias), OUT)
            assert got.shape == (rows, OUT)
            assert torch.allclose(got.double(), expected, atol=2e-5), (rows, (got - expected).abs().max())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
# even / odd tile counts (the last pair partial or single); 330 outputs: several 4-tile calls per
# thread, then a pair and a single tile, on every width
@pytest.mark.parametrize("out", [60, 70, 330])
def test_one_row_tile_sets_equal_the_two_row_path(isa: str, fmt: str, threads: int, out: int) -> None:
    """A single row walks tiles four or two at a time: the same per-output chain as the
    row-block path, however the tiles fall between the threads."""
    _, qgemv = _kernels(isa)
    weight = _weights(out)[fmt]
    packed = qgemv.tile_weight(weight)
    torch.manual_seed(6)
    x, b = torch.randn(1, IN), torch.randn(out)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for bias in (None, b):
            tiled_bias = None if bias is None else qgemv.tile_bias(bias)
            got = qgemv(x, packed, fmt, tiled_bias, out)
            two = qgemv(torch.cat([x, torch.randn(1, IN)]), packed, fmt, tiled_bias, out)
            assert got.shape == (1, out) and torch.equal(got, two[:1])
            expected = x.double() @ weight.dequantize().double().T
            expected += 0 if bias is None else bias.double()
            assert torch.allclose(got.double(), expected, atol=2e-5)
    finally:
        torch.set_num_threads(before)


def test_rows_do_not_depend_on_batch_mates(isa: str) -> None:
    """One row alone (register path) equals that row among 11 (group-by-group path)."""
    gemv, qgemv = _kernels(isa)
    torch.manual_seed(5)
    batch = torch.randn(11, IN)
    dense = torch.randn(OUT, IN)
    tiled = gemv.tile_weight(dense)
    calls = [lambda x: gemv(x, tiled, None, OUT)]
    for fmt, weight in _weights().items():
        packed = qgemv.tile_weight(weight)
        calls.append(lambda x, packed=packed, fmt=fmt: qgemv(x, packed, fmt, None, OUT))
    for call in calls:
        together = call(batch)
        for r in range(11):
            assert torch.equal(call(batch[r : r + 1]), together[r : r + 1])
        assert torch.equal(call(batch[3:8]), together[3:8])


@pytest.mark.parametrize("fmt", FORMATS)
def test_tile_untile_round_trip(isa: str, fmt: str) -> None:
    _, qgemv = _kernels(isa)
    weight = _weights()[fmt]
    back = qgemv.untile(qgemv.tile_weight(weight), fmt, OUT)
    assert back.format == fmt
    assert back.qs.dtype == weight.qs.dtype and torch.equal(back.qs, weight.qs)
    for got, expected in ((back.scales, weight.scales), (back.mins, weight.mins)):
        assert (got is None) == (expected is None)
        if got is not None and expected is not None:
            assert torch.equal(got, expected)


def test_q4_tiles_keep_float16_scales_and_refuse_others(isa: str) -> None:
    """q4 tiles hold the file's float16 scale and offset (4 bytes a group and column, not 8): a
    value float16 does not hold is refused, never rounded."""
    _, qgemv = _kernels(isa)
    weight = _q4_weight(3)
    assert qgemv.block_bytes["q4"] == 4 * qgemv.tile + 32 * qgemv.tile // 2
    off = QuantizedWeight("q4", weight.qs, weight.scales * (1 + 2**-20), weight.mins)
    with pytest.raises(ValueError, match="float16"):
        qgemv.tile_weight(off)


@pytest.mark.parametrize(
    ("fmt", "span", "sub", "strided"),
    [("q4", 32, 32, False), ("q4_k", 256, 32, False), ("q5", 32, 32, True),
     ("q5_k", 256, 32, True), ("q6_k", 256, 16, True)],
)  # fmt: skip
def test_nibbles_are_stored_in_step_order(fmt: str, span: int, sub: int, strided: bool) -> None:
    """Step k of a group holds, per column byte, its 4 inputs side by side (one 32-bit word, the
    operand order of vpmaddubsw): 4k..4k+3, or k + (sub / 4) i for the formats with high-bit
    words; and the order is undone exactly."""
    half, steps = 8, sub // 4
    rows = torch.randint(0, 256, (2, 3, span, half), dtype=torch.uint8)
    stored = cpu_qgemv.to_steps(rows, fmt)
    assert stored.shape == (2, 3, span // 4, half, 4)
    for g in range(span // sub):
        for k in range(steps):
            for i in range(4):
                j = g * sub + (k + steps * i if strided else 4 * k + i)
                assert torch.equal(stored[:, :, g * steps + k, :, i], rows[:, :, j, :])
    back = cpu_qgemv.from_steps(stored.reshape(2, 3, span, half), fmt)
    assert torch.equal(back, rows)


@pytest.mark.parametrize("fmt", FORMATS)
def test_transient_dequantization_equals_the_table(isa: str, fmt: str) -> None:
    """The float32 copy many-row batches hand to PyTorch's GEMM: every weight exactly, in whole
    tiles and in the last, partial one."""
    _, qgemv = _kernels(isa)
    weight = _weights()[fmt]
    assert OUT % qgemv.tile  # the layout has a partial tile
    wt = qgemv.dequantize_t(qgemv.tile_weight(weight), fmt, OUT)
    assert wt.shape == (weight.shape[1], OUT)
    assert torch.equal(wt.T, weight.dequantize())


@pytest.mark.parametrize("fmt", sorted(HALF_FORMATS))
def test_every_16_bit_value_widens_exactly(isa: str, fmt: str) -> None:
    """All 65,536 bit patterns (subnormals, infinities, NaNs) through the kernel's conversion equal
    PyTorch's widening to float32, bit for bit (NaNs: stay NaN)."""
    _, qgemv = _kernels(isa)
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    weight = QuantizedWeight(fmt, every.view(HALF_FORMATS[fmt]).reshape(2048, 32), None, None)
    got = qgemv.dequantize_t(qgemv.tile_weight(weight), fmt, 2048).T
    expected = weight.dequantize()
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), expected[~nan].view(torch.int32))
    assert int(nan.sum()) == (2046 if fmt == "float16" else 254)  # both signs' NaN patterns


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_gathered_from_tiles_equal_the_table(isa: str, fmt: str) -> None:
    """A tied embedding reads the head's tiles: the same rows as the quantized table gives."""
    _, qgemv = _kernels(isa)
    weight = _weights()[fmt]
    index = torch.tensor([[0, OUT - 1, 17], [16, 5, 5]])  # first, last (partial tile), repeats
    packed = qgemv.tile_weight(weight)
    assert torch.equal(qgemv.gather_rows(packed, fmt, index, OUT), weight.rows(index))
    for bad in (OUT, -1):  # the padding rows of the last tile are not rows of the weight
        with pytest.raises(IndexError, match="outside"):
            qgemv.gather_rows(packed, fmt, torch.tensor([0, bad]), OUT)


def test_attention_kernel_matches_torch_reference(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_ISA", isa)
    cpu_paged_attention.load_cpu_attention.cache_clear()
    try:
        assert cpu_paged_attention.load_cpu_attention() is not None
        built = native_build.library_isa(cpu_paged_attention.SOURCE, isa)  # a VNNI set: its base's
        library = build_library(cpu_paged_attention.SOURCE)
        assert library.name.startswith(f"cpu_paged_attention-{built}-")
        torch.manual_seed(6)
        heads, kv_heads, dim, block, lens = 6, 2, 40, 4, [1, 7, 13]  # GQA; 40: not a vector multiple
        pool = torch.randn(16, 2, 2, block, kv_heads, dim)  # strided views, as the KV pool gives
        k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
        tables = [[5], [9, 2], [3, 11, 1, 7]]
        meta = AttentionMetadata.build(
            is_prefill=False, query_lens=[1] * len(lens), context_lens=lens, block_tables=tables,
            block_size=block,
        )
        q = torch.randn(len(lens), heads, dim)
        k, v = torch.randn(len(lens), kv_heads, dim), torch.randn(len(lens), kv_heads, dim)
        before = pool.clone()
        expected = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, dim**-0.5)
        stored = pool.clone()
        pool.copy_(before)  # the kernel stores this step's K/V itself, in the same call
        got = CpuPagedAttention().forward(q, k, v, k_cache, v_cache, meta, dim**-0.5)
        assert torch.allclose(got, expected, atol=2e-6), (got - expected).abs().max()
        assert torch.equal(pool, stored)  # the same slots written, nothing else touched

        # prefill: a cached prefix, a prompt past one key tile, and a decode row in one step
        dim, query_lens, context_lens = 32, [9, 70, 1], [30, 70, 5]
        tables = [[12, 3, 6, 1, 8, 10, 13, 2], list(range(31, 13, -1)), [11, 4]]
        pool = torch.randn(32, 2, 2, block, kv_heads, dim)
        k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
        meta = AttentionMetadata.build(
            is_prefill=True, query_lens=query_lens, context_lens=context_lens,
            block_tables=tables, block_size=block,
        )  # fmt: skip
        tokens = sum(query_lens)
        q = torch.randn(tokens, heads, dim)
        k, v = torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
        expected = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, dim**-0.5)
        got = CpuPagedAttention().forward(q, k, v, k_cache, v_cache, meta, dim**-0.5)
        assert torch.allclose(got, expected, atol=2e-6), (got - expected).abs().max()
    finally:
        cpu_paged_attention.load_cpu_attention.cache_clear()


def test_kernel_shape_checks(isa: str) -> None:
    gemv, qgemv = _kernels(isa)
    tiled = gemv.tile_weight(torch.randn(OUT, IN))
    with pytest.raises(ValueError, match="does not fit"):
        gemv(torch.randn(2, IN - 1), tiled, None, OUT)
    with pytest.raises(ValueError, match="does not fit"):
        gemv(torch.randn(2, IN), tiled, None, 10_000)  # more outputs than tiles
    with pytest.raises(TypeError, match="float32"):
        gemv(torch.randn(2, IN, dtype=torch.float64), tiled, None, OUT)
    packed = qgemv.tile_weight(_q4_weight(7))
    with pytest.raises(ValueError, match="does not fit"):
        qgemv(torch.randn(2, IN - 32), packed, "q4", None, OUT)
    with pytest.raises(ValueError, match="does not fit"):
        qgemv(torch.randn(2, IN), packed, "q8_0", None, OUT)  # 4-bit tiles read as 8-bit
    with pytest.raises(TypeError, match="float32"):
        qgemv(torch.randn(2, IN, dtype=torch.float64), packed, "q4", None, OUT)


def _clear_loaders() -> None:
    cpu_gemv.load_cpu_gemv.cache_clear()
    cpu_qgemv.load_cpu_qgemv.cache_clear()
    cpu_paged_attention.load_cpu_attention.cache_clear()


def _assert_loaders_fall_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, reason: str
) -> None:
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "1")  # the ISA is checked before any compiler
    _clear_loaders()
    try:
        with caplog.at_level(logging.WARNING):
            assert cpu_gemv.load_cpu_gemv() is None
            assert cpu_qgemv.load_cpu_qgemv() is None
            assert cpu_paged_attention.load_cpu_attention() is None
    finally:
        _clear_loaders()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and all(reason in w for w in warnings), warnings


def test_unknown_isa_is_a_build_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TANDEM_CPU_ISA", "bogus")
    every = "avx512vnni, avx512, avxvnni, avx2, neondot, generic"
    with pytest.raises(NativeBuildError, match=f"'bogus' is not one of {every}"):
        selected_isa()
    _assert_loaders_fall_back(monkeypatch, caplog, "is not one of")


def test_forced_isa_is_checked_against_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_ISA", " AVX2 ")  # case and spaces don't matter
    if "avx2" in supported_isas():
        assert selected_isa() == "avx2"
    monkeypatch.setenv("TANDEM_CPU_ISA", "generic")
    assert selected_isa() == "generic" and supported_isas()[-1] == "generic"
    monkeypatch.delenv("TANDEM_CPU_ISA")
    monkeypatch.setenv("TANDEM_AUTOTUNE", "fixed")  # the flags alone (no measured VNNI choice)
    assert selected_isa() == supported_isas()[0]


@pytest.mark.parametrize("missing", ["avx512vnni", "avx512", "avxvnni", "avx2"])
def test_isa_the_cpu_lacks_falls_back(
    missing: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On this CPU if it lacks the set; otherwise on a CPU whose flags are SSE2 only."""
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        pytest.skip("x86 instruction sets")
    if missing in supported_isas():  # this CPU has it: present a baseline x86-64 CPU instead
        monkeypatch.setattr(native_build, "_cpu_flags", lambda: "flags\t\t: fpu sse sse2 lm")
        assert supported_isas() == ["generic"]
    monkeypatch.setenv("TANDEM_CPU_ISA", missing)
    with pytest.raises(NativeBuildError, match=f"{missing} but this CPU lacks it"):
        selected_isa()
    _assert_loaders_fall_back(monkeypatch, caplog, "lacks it")


def test_an_arm_cpu_selects_neondot_where_it_has_the_dot_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """aarch64's /proc/cpuinfo lists ``asimddp`` in Features where Armv8.2's sdot is there."""
    monkeypatch.setattr(native_build.platform, "machine", lambda: "aarch64")
    monkeypatch.delenv("TANDEM_CPU_ISA", raising=False)
    monkeypatch.setenv("TANDEM_AUTOTUNE", "fixed")  # the flags alone
    monkeypatch.setattr(native_build, "_cpu_flags", lambda: "Features\t: fp asimd asimddp i8mm")
    assert supported_isas() == ["neondot", "generic"] and selected_isa() == "neondot"
    assert native_build.vector_isa("neondot") == "generic"
    monkeypatch.setattr(native_build, "_cpu_flags", lambda: "Features\t: fp asimd crc32")
    assert supported_isas() == ["generic"]  # a Cortex-A72: NEON alone
    monkeypatch.setenv("TANDEM_CPU_ISA", "neondot")
    with pytest.raises(NativeBuildError, match="neondot but this CPU lacks it"):
        selected_isa()


def test_only_the_kernels_vnni_changes_have_vnni_builds() -> None:
    """A kernel whose code reads ``A8_DPBUSD`` (itself or through the sources it includes) is
    built per VNNI set; every other shares its base set's library (one build in an image)."""
    directory = cpu_gemv.SOURCE.parent
    text = {p.name: p.read_text() for p in directory.glob("*.[ch]")}

    def closure(name: str, seen: set[str]) -> set[str]:
        seen.add(name)
        for line in text[name].splitlines():
            included = line.partition('#include "')[2].partition('"')[0]
            if included in text and included not in seen:
                closure(included, seen)
        return seen

    changed = {
        source.name for source in native_build.kernel_sources()
        if any("A8_DPBUSD" in text[n] for n in closure(source.name, set()))
    }  # fmt: skip
    assert changed == native_build.VNNI_SOURCES == {"cpu_q4a8_gemm.c", "cpu_decode_layers.c"}
    for source in native_build.kernel_sources():
        for isa, base in (("avx512vnni", "avx512"), ("avxvnni", "avx2"), ("avx2", "avx2")):
            assert native_build.vector_isa(isa) == base
            expected = isa if source.name in changed else base
            assert native_build.library_isa(source, isa) == expected, (source.name, isa)
