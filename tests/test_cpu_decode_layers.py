"""All decoder layers of a decode step in one C call: the same bits as the per-op kernel path
(hidden states and the K/V it stores), on every instruction set the machine runs, for float32
and quantized weights, for Llama, Qwen3 (q/k head norms), Gemma 3 (sandwich ``1 + w`` norms,
GeGLU, sliding-window layers with their own rope base) and Gemma 2 (score soft-cap); used only
where every op of a layer chose its kernel; measured against the per-op path at load, so a slower
one never runs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from services.engine.core.attention import AttentionMetadata
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.kernels import autotune
from services.engine.core.kernels.autotune import KernelRegimes
from services.engine.core.kernels.cpu_decode_layers import DecodeLayersCall, load_cpu_decode_layers
from services.engine.core.kernels.cpu_fused import DECODE_LAYER_ROWS, MAX_ROWS
from services.engine.core.kernels.loaded import forget_loaded_kernels
from services.engine.core.kernels.native_build import supported_isas
from services.engine.core.linear import Linear
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.core.quant.quantized_weight import to_half
from tests.conftest import native_kernel_or_skip
from tests.test_model_families import FAMILIES

CONTEXTS = [5, 17, 33, 2, 40, 16, 9, 64] * 4  # one per sequence: partial and whole blocks
ONE_CALL_FAMILIES = ["llama", "qwen3", "gemma3", "gemma2"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> dict[str, Path]:
    """Tiny random checkpoints written by ``transformers`` (test_model_families' builders: Gemma's
    sliding window of 8 is shorter than most CONTEXTS)."""
    import transformers

    dirs = {"llama": tiny_llama_dir}
    for name in ONE_CALL_FAMILIES[1:]:
        build, head_dim, _ = FAMILIES[name]
        torch.manual_seed(3)
        folder = tmp_path_factory.mktemp(f"one-call-{name}")
        build(transformers, head_dim).save_pretrained(folder, safe_serialization=True)
        dirs[name] = folder
    return dirs


@pytest.fixture(params=supported_isas())
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    native_kernel_or_skip()
    monkeypatch.setenv("TANDEM_CPU_ISA", request.param)
    forget_loaded_kernels()
    yield request.param
    monkeypatch.delenv("TANDEM_CPU_ISA")
    forget_loaded_kernels()


def _engine_with_every_kernel(
    tiny_llama_dir: Path, dtype: str, prepare: Callable[[LoadedModel], None] | None = None
) -> tuple[LoadedModel, LLMEngine]:
    """The tiny model packed for the native kernels (``prepare`` runs on it before packing),
    every op forced onto its kernel (whatever this machine's timings chose), the one-call layers
    bound for up to MAX_ROWS rows."""
    loaded = load_model(str(tiny_llama_dir), dtype)
    if prepare is not None:
        prepare(loaded)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=160))
    model = loaded.model
    for module in model.modules():
        if isinstance(module, Linear):
            module.regimes = KernelRegimes()
    for layer in model.layers:
        layer.self_attn.backend.regimes = KernelRegimes()
    assert model.use_decode_layers(load_cpu_decode_layers()) == MAX_ROWS
    return loaded, engine


def _regimes(native: bool) -> KernelRegimes:
    return KernelRegimes(rows=DECODE_LAYER_ROWS, use_kernel=(native,) * len(DECODE_LAYER_ROWS))


def _decode_step(loaded: LoadedModel, engine: LLMEngine, rows: int, native: bool) -> torch.Tensor:
    """One decode step of ``rows`` sequences (contexts ``CONTEXTS``) over the pool as it is."""
    model = loaded.model
    model.decode_layers_regimes = _regimes(native)
    block_size = engine.kv.layout.block_size
    tables = [[1 + 4 * i + j for j in range(-(-CONTEXTS[i] // block_size))] for i in range(rows)]
    meta = AttentionMetadata.build(
        is_prefill=False, query_lens=[1] * rows, context_lens=CONTEXTS[:rows],
        block_tables=tables, block_size=block_size,
    )  # fmt: skip
    ids = torch.arange(rows) * 7 + 3
    positions = torch.tensor(CONTEXTS[:rows]) - 1
    with torch.inference_mode():
        return model(ids, positions, engine.kv, meta)


@pytest.mark.parametrize("family", ONE_CALL_FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "q8_0"])
def test_one_call_equals_the_per_op_path_bit_for_bit(
    isa: str, dtype: str, family: str, family_dirs: dict[str, Path]
) -> None:
    loaded, engine = _engine_with_every_kernel(family_dirs[family], dtype)
    call = loaded.model.decode_layers
    assert call is not None and call.isa == isa
    assert loaded.model.fast_path_gaps() == []
    if family.startswith("gemma"):  # windows shorter than the contexts, on some layers only
        windows = {layer.self_attn.window for layer in loaded.model.layers}
        assert None in windows and 8 in windows and max(CONTEXTS) > 8
    assert {t.format for t in call.tiles()} == {dtype}
    _one_call_equals_per_op(loaded, engine)


def _one_call_equals_per_op(loaded: LoadedModel, engine: LLMEngine) -> None:
    """From one random KV pool, a decode step of 1, 3, 8 and 32 sequences gives the same hidden
    states and writes the same K/V into the same slots in one call as per op."""
    torch.manual_seed(0)
    pool = engine.kv.data
    with torch.inference_mode():
        pool.normal_()
    start = pool.clone()
    for rows in (1, 3, 8, 32):
        pool.copy_(start)
        per_op = _decode_step(loaded, engine, rows, native=False)
        stored = pool.clone()
        pool.copy_(start)
        one_call = _decode_step(loaded, engine, rows, native=True)
        assert torch.equal(one_call, per_op), rows
        assert torch.equal(pool, stored), rows  # the same K/V written into the same slots
        assert not torch.equal(stored, start)


def _in_parts(loaded: LoadedModel) -> None:
    """Every layer's q/k/v and gate/up as a file with two formats stores them: q and k (gate) in
    Q8_0, v (up) in bfloat16, each kept as its own part."""
    for layer in loaded.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear, split in ((attn.qkv_proj, attn.q_size + attn.kv_size),
                              (mlp.gate_up_proj, mlp.gate_up_proj.out_features // 2)):  # fmt: skip
            weight = linear.quant
            assert weight is not None and weight.format == "q8_0"
            rest = to_half(weight.map_rows(lambda t: t[split:]).dequantize(), "bfloat16")
            linear.set_parts([weight.map_rows(lambda t: t[:split]), rest])


@pytest.mark.parametrize("family", ONE_CALL_FAMILIES)
def test_projections_in_parts_equal_the_per_op_path(
    isa: str, family: str, family_dirs: dict[str, Path]
) -> None:
    """A fused projection whose parts are stored in two formats: each part runs its own kernel,
    in one call and per op alike, bit for bit, and their outputs sit where the fused one's did
    (the K/V stored and the step's output match the model dequantized as one weight)."""
    loaded, engine = _engine_with_every_kernel(family_dirs[family], "q8_0", _in_parts)
    model, call = loaded.model, loaded.model.decode_layers
    assert call is not None and {t.format for t in call.tiles()} == {"q8_0", "bfloat16"}
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight_format == "q8_0+bfloat16" and len(qkv.kernel_tiles(1) or ()) == 2
    _one_call_equals_per_op(loaded, engine)
    x = torch.randn(5, qkv.in_features)
    with torch.inference_mode():
        reference = x @ qkv.dequantized_weight().T
        assert torch.allclose(qkv(x), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ONE_CALL_FAMILIES)
def test_int8_activation_projections_equal_the_per_op_path(
    isa: str, family: str, family_dirs: dict[str, Path]
) -> None:
    """``q4_a8``'s decode rows: every projection over int8 activations (the decode kernel of
    ``cpu_q4a8_gemm.c``), in one call and per op alike, bit for bit; and not the float32 path."""
    from services.engine.core.kernels.cpu_q4a8_gemm import load_cpu_q4a8_gemm

    loaded, engine = _engine_with_every_kernel(family_dirs[family], "q8_0")
    model, a8 = loaded.model, load_cpu_q4a8_gemm()
    assert a8 is not None and a8.isa == isa
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.packed is not None]
    torch.manual_seed(0)
    pool = engine.kv.data
    with torch.inference_mode():
        pool.normal_()
    start = pool.clone()
    float_step = _decode_step(loaded, engine, 3, native=False)
    for layer in linears:
        layer._a8gemv = a8.bind_decode(layer.packed, layer.packed_bias, layer.out_features,
                                       layer.weight_format)  # fmt: skip
    assert model.use_decode_layers(load_cpu_decode_layers()) == MAX_ROWS
    call = model.decode_layers
    assert call is not None and all(t.int8_activations for t in call.tiles())
    for rows in (1, 3, 8):
        pool.copy_(start)
        per_op = _decode_step(loaded, engine, rows, native=False)
        stored = pool.clone()
        pool.copy_(start)
        one_call = _decode_step(loaded, engine, rows, native=True)
        assert torch.equal(one_call, per_op), rows
        assert torch.equal(pool, stored), rows
        if rows == 3:  # rounded activations: close to the float32 path, not equal
            assert not torch.equal(per_op, float_step)
            assert (per_op - float_step).abs().max() < 0.1 * float_step.abs().max()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_engine_decodes_the_same_tokens_through_it(
    family: str, family_dirs: dict[str, Path]
) -> None:
    from services.common.sampling_params import SamplingParams

    native_kernel_or_skip()
    loaded, engine = _engine_with_every_kernel(family_dirs[family], "float32")
    calls = 0
    real = DecodeLayersCall.__call__

    def counted(self, *args):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return real(self, *args)

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[1, 5, 9, 13], [1, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    tokens = {}
    for native in (True, False):
        loaded.model.decode_layers_regimes = _regimes(native)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(DecodeLayersCall, "__call__", counted)
            tokens[native] = [out.new_token_ids for out in engine.generate(prompts, params)]
        assert (calls > 0) == native
        calls = 0
    assert tokens[True] == tokens[False] and all(len(t) == 10 for t in tokens[True])


def test_it_runs_only_where_every_op_chose_its_kernel(tiny_llama_dir: Path) -> None:
    native_kernel_or_skip()
    loaded, _ = _engine_with_every_kernel(tiny_llama_dir, "float32")
    model, kernel = loaded.model, load_cpu_decode_layers()
    rows = model.use_decode_layers(kernel)
    assert rows > 1
    model.layers[-1].mlp.down_proj.regimes = KernelRegimes(use_kernel=(False, True, True, True))
    assert model.use_decode_layers(kernel) == 0 and model.decode_layers is None
    model.layers[-1].mlp.down_proj.regimes = KernelRegimes()
    assert model.use_decode_layers(kernel) == rows
    model.use_fused(None)  # the one call computes the fused ops: off with them
    assert model.decode_layers is None and model.decode_layers_rows == 0


def test_a_slower_one_call_loses_to_the_per_op_path(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    native_kernel_or_skip()
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))  # measured now, not read from a cache
    monkeypatch.setenv("TANDEM_AUTOTUNE", "measure")  # as `tandem tune` does
    monkeypatch.setattr(autotune, "_machine_busy", lambda: False)
    monkeypatch.setattr(autotune, "_cpu_sample", lambda: None)  # taken as idle
    real = DecodeLayersCall.__call__

    def slow(self, *args):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        return real(self, *args)

    monkeypatch.setattr(DecodeLayersCall, "__call__", slow)
    loaded = load_model(str(tiny_llama_dir), "float32")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64))
    model = loaded.model
    if not model.decode_layers_rows:
        pytest.skip("no op of this model chose its kernel here: nothing to bind")
    regimes = model.decode_layers_regimes
    assert regimes.measured and not any(regimes.use_kernel), regimes
    assert not engine.kv.data.any()  # the timed steps' K/V are gone
    assert list(tmp_path.glob("kernels/autotune-*.json"))  # the decision is kept


def test_bad_bindings_are_refused(tiny_llama_dir: Path) -> None:
    native_kernel_or_skip()
    loaded, engine = _engine_with_every_kernel(tiny_llama_dir, "float32")
    call = loaded.model.decode_layers
    assert call is not None
    caches = [engine.kv.layer(i) for i in range(len(loaded.model.layers))]
    with pytest.raises(ValueError, match="cache pairs"):
        call.set_caches(caches[:-1], engine.kv)
    with pytest.raises(ValueError, match="float32 views"):
        call.set_caches([(k.double(), v) for k, v in caches], engine.kv)
    call.set_caches(caches, engine.kv)
    rope, hidden = loaded.model.rope, loaded.model.config.hidden_size
    meta = AttentionMetadata.build(is_prefill=False, query_lens=[1], context_lens=[3],
                                   block_tables=[[1]], block_size=engine.kv.layout.block_size)
    step = (meta.block_tables, meta.decode_context_lens(), meta.slot_blocks, meta.slot_offsets)
    with pytest.raises(ValueError, match="past the rotary tables"):  # refused before any work
        call(torch.zeros(1, hidden), torch.tensor([rope.cos.shape[0]]), (rope.cos, rope.sin), *step)
    with pytest.raises(ValueError, match="2 positions for 1 rows"):
        call(torch.zeros(1, hidden), torch.tensor([1, 2]), (rope.cos, rope.sin), *step)
    with pytest.raises(ValueError, match="rotary tables must be"):
        narrow = rope.cos[:, :4].contiguous()
        call(torch.zeros(1, hidden), torch.tensor([2]), (narrow, narrow), *step)
    unbound = DecodeLayersCall(call._fn, call._decode_shape, call._layers_py, call.isa, call.build)
    with pytest.raises(RuntimeError, match="set_caches"):
        unbound(torch.zeros(1, 64), torch.zeros(1, dtype=torch.long), (torch.zeros(8, 16),) * 2,
                *[torch.zeros(1, dtype=torch.long)] * 4)
