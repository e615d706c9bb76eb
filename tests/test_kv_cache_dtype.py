"""A 16-bit KV cache under a float32 model (``--kv-cache-dtype``): the C attention kernels read
bfloat16 and float16 caches within those types' rounding of the float32 result, on every
instruction set the machine runs; the decode kernel stores K/V with the bits PyTorch's casts give
(special values included), so the one-call decode layers stay bit for bit the per-op path; greedy
tokens of a tiny model mostly match float32's; and the flag travels from the CLIs to the pool.
(The hand-off of a 16-bit pool: tests/test_kv_transfer.py.)"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any
from pathlib import Path

import pytest
import torch

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingParams
from services.engine.core.attention import AttentionMetadata, TorchPagedAttention
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.kernels import cpu_paged_attention
from services.engine.core.kernels.autotune import KernelRegimes
from services.engine.core.kernels.cpu_decode_layers import load_cpu_decode_layers
from services.engine.core.kernels.cpu_fused import DECODE_LAYER_ROWS, MAX_ROWS
from services.engine.core.kernels.cpu_paged_attention import (
    CpuPagedAttention,
    auto_cache_dtype,
    cpu_paged_decode_attention,
)
from services.engine.core.kernels.loaded import forget_loaded_kernels
from services.engine.core.kernels.native_build import selected_isa, supported_isas, vector_isa
from services.engine.core.kv_cache import kv_cache_dtype
from services.engine.core.linear import Linear
from services.engine.core.loaders import load_model
from services.engine.runtime.worker_options import add_worker_arguments, options_from_args
from services.launch_plan import LaunchConfig, plan
from tests.conftest import native_kernel_or_skip
from tests.paged_tables import reversed_tables
from tests.tls_identities import tls_flags

HALF = [torch.bfloat16, torch.float16]
# the largest difference from the float32 cache's output, for unit-variance K/V: the values'
# relative rounding (2^-9 bfloat16, 2^-12 float16) passed through a weighted average
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.fixture(params=supported_isas())
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    native_kernel_or_skip()
    monkeypatch.setenv("TANDEM_CPU_ISA", request.param)
    forget_loaded_kernels()
    yield request.param
    monkeypatch.delenv("TANDEM_CPU_ISA")
    forget_loaded_kernels()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block", "query_lens", "context_lens"),
    [
        (9, 3, 64, 16, [1, 1, 1], [1, 40, 100]),  # decode: SmolLM2's shape
        (4, 2, 128, 16, [1, 1], [33, 5]),  # decode: head_dim 128
        (8, 8, 24, 4, [1, 1], [5, 9]),  # decode: head_dim not whole vectors
        (9, 3, 64, 16, [37], [150]),  # prefill: a cached prefix
        (4, 2, 16, 4, [5, 70, 1], [5, 170, 9]),  # prefill: several prompts and a decode row
    ],
)
def test_16bit_cache_attention_is_float32_within_rounding(
    isa: str, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, block: int,
    query_lens: list[int], context_lens: list[int],
) -> None:  # fmt: skip
    torch.manual_seed(dim + sum(context_lens))
    pool = torch.randn(64, 2, 2, block, kv_heads, dim)  # the KVPool layout: strided layer views
    half = pool.to(dtype)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, dim)
    k, v = torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    meta = AttentionMetadata.build(
        is_prefill=query_lens != [1] * len(query_lens), query_lens=query_lens,
        context_lens=context_lens, block_tables=reversed_tables(context_lens, block), block_size=block,
    )  # fmt: skip
    scale = dim**-0.5
    exact = TorchPagedAttention().forward(q, k, v, pool[:, 1, 0], pool[:, 1, 1], meta, scale)
    ref_k, ref_v = half[:, 1, 0].clone(), half[:, 1, 1].clone()
    reference = TorchPagedAttention().forward(q, k, v, ref_k, ref_v, meta, scale)
    got = CpuPagedAttention().forward(q, k, v, half[:, 1, 0], half[:, 1, 1], meta, scale)
    assert (got - exact).abs().max() < TOLERANCE[dtype]
    # over the same 16-bit values, the kernel is the reference up to float32 rounding
    assert torch.allclose(got, reference, atol=2e-6), (got - reference).abs().max()
    assert torch.equal(half[:, 1, 0].view(torch.int16), ref_k.view(torch.int16))  # stored alike
    assert torch.equal(half[:, 1, 1].view(torch.int16), ref_v.view(torch.int16))


@pytest.mark.parametrize("dtype", HALF)
def test_the_decode_kernel_rounds_as_pytorch_does(isa: str, dtype: torch.dtype) -> None:
    """Stored K/V: the bits ``tensor.to(dtype)`` gives, for normal, subnormal, overflowing, signed
    zero and infinite values (float16 rounds in C without F16C on generic builds)."""
    torch.manual_seed(1)
    values = torch.cat([
        torch.randn(1024), torch.randn(1024) * 1e-5, torch.randn(1024) * 1e4,
        torch.tensor([65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.9e-8, 1e-40, 0.0, -0.0,
                      float("inf"), -float("inf"), 1.00390625, 1.01171875]),  # bf16 ties to even
    ])  # fmt: skip
    dim = 16
    rows = -(-values.numel() // dim)
    values = torch.cat([values, torch.zeros(rows * dim - values.numel())]).view(rows, 1, dim)
    k_cache = torch.zeros(rows + 1, 1, 1, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(1, rows + 1)
    cpu_paged_decode_attention(
        torch.zeros(rows, 1, dim), k_cache, v_cache, slots.view(rows, 1),
        torch.ones(rows, dtype=torch.long), 1.0, new_kv=(values, -values, slots, torch.zeros(rows, dtype=torch.long)),
    )  # fmt: skip
    assert torch.equal(k_cache[1:, 0].view(torch.int16), values.to(dtype).view(torch.int16))
    assert torch.equal(v_cache[1:, 0].view(torch.int16), (-values).to(dtype).view(torch.int16))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_call_decode_layers_equal_the_per_op_path_over_a_16bit_cache(
    isa: str, dtype: str, tiny_llama_dir: Path
) -> None:
    loaded = load_model(str(tiny_llama_dir), "float32")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=160, kv_cache_dtype=dtype))
    assert engine.kv.data.dtype == getattr(torch, dtype) and engine.layout.dtype == dtype
    model = loaded.model
    for module in model.modules():  # every op on its kernel, whatever this machine's timings
        if isinstance(module, Linear):
            module.regimes = KernelRegimes()
    for layer in model.layers:
        layer.self_attn.backend.regimes = KernelRegimes()
    assert model.use_decode_layers(load_cpu_decode_layers()) == MAX_ROWS
    torch.manual_seed(0)
    pool = engine.kv.data
    with torch.inference_mode():
        pool.copy_(torch.randn(pool.shape))
    start = pool.clone()
    one_call_equals_per_op(model, engine, start, lambda a, b: torch.equal(a.view(torch.int16),
                                                                          b.view(torch.int16)))  # fmt: skip
    assert not torch.equal(pool, start)  # the steps wrote K/V


def test_greedy_tokens_with_a_16bit_cache_mostly_match_float32(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir), "float32")
    prompts = [[(13 * i + 7 * j) % 250 + 3 for j in range(20 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for dtype in ("float32", "bfloat16", "float16"):
        engine = LLMEngine(loaded, EngineConfig(num_blocks=64, kv_cache_dtype=dtype))
        tokens[dtype] = [out.new_token_ids for out in engine.generate(prompts, params)]
    total = sum(len(t) for t in tokens["float32"])
    for dtype in ("bfloat16", "float16"):
        same = sum(a == b for ours, ref in zip(tokens[dtype], tokens["float32"], strict=True)
                   for a, b in zip(ours, ref, strict=True))  # fmt: skip
        assert same >= 0.9 * total, (dtype, same, total)


def test_the_cache_dtype_a_flag_means() -> None:
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert kv_cache_dtype(None, bf16) == bf16  # the library's default: the model's own
    assert kv_cache_dtype("auto", bf16) == bf16
    assert kv_cache_dtype("auto", f32, lambda: f16) == f16
    assert kv_cache_dtype("bfloat16", f32) == bf16
    assert kv_cache_dtype("bfloat16", bf16) == bf16
    with pytest.raises(InvalidArgumentError, match="computes in bfloat16"):
        kv_cache_dtype("float16", bf16)
    with pytest.raises(InvalidArgumentError, match="computes in float16"):
        kv_cache_dtype("float32", f16)
    with pytest.raises(InvalidArgumentError, match="unknown KV cache dtype"):
        kv_cache_dtype("int8", f32)


def test_auto_follows_the_instruction_set_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    native_kernel_or_skip()
    loaded = load_model("dummy:tiny")
    expected = cpu_paged_attention.AUTO_CACHE_DTYPES.get(vector_isa(selected_isa()), torch.float32)
    assert auto_cache_dtype() == expected
    engine = LLMEngine(loaded, EngineConfig(num_blocks=8, kv_cache_dtype="auto"))
    assert engine.kv.data.dtype == expected
    assert LLMEngine(loaded, EngineConfig(num_blocks=8)).kv.data.dtype == torch.float32
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")  # no kernel reads a 16-bit cache: float32
    cpu_paged_attention.load_cpu_attention.cache_clear()
    try:
        assert auto_cache_dtype() == torch.float32
    finally:
        cpu_paged_attention.load_cpu_attention.cache_clear()


def test_the_flag_reaches_workers_and_their_engines() -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, port=0, metrics_port=0)
    args = parser.parse_args(["--device", "cpu", "--kv-cache-dtype", "bfloat16",
                              *tls_flags("decode")])
    options = options_from_args(args, "decode")
    assert options.engine_config().kv_cache_dtype == "bfloat16"
    assert parser.parse_args(["--device", "cpu"]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])
    specs = plan(LaunchConfig(num_prefill=1, num_decode=1, kv_cache_dtype="float16"))
    workers = [spec for spec in specs if spec.service in ("prefill", "decode")]
    assert len(workers) == 2
    for spec in workers:
        at = spec.argv.index("--kv-cache-dtype")
        assert spec.argv[at + 1] == "float16"
    assert all("--kv-cache-dtype" not in spec.argv for spec in plan(LaunchConfig()))


def one_call_equals_per_op(model: Any, engine: Any, start: torch.Tensor,
                           same_pool: Callable[[torch.Tensor, torch.Tensor], bool]) -> None:  # fmt: skip
    """Decode steps of 1, 3 and 8 rows from the pool ``start`` give the same hidden states and
    the same pool (``same_pool``) with every layer in one C call as op by op."""
    pool = engine.kv.data
    contexts = [5, 17, 33, 2, 40, 16, 9, 64]
    for rows in (1, 3, 8):
        outs = []
        for native in (False, True):
            pool.copy_(start)
            model.decode_layers_regimes = KernelRegimes(
                rows=DECODE_LAYER_ROWS, use_kernel=(native,) * len(DECODE_LAYER_ROWS)
            )
            meta = AttentionMetadata.build(
                is_prefill=False, query_lens=[1] * rows, context_lens=contexts[:rows],
                block_tables=[[1 + 4 * i + j for j in range(-(-n // 16))] for i, n in
                              enumerate(contexts[:rows])],
                block_size=16,
            )  # fmt: skip
            with torch.inference_mode():
                outs.append((model(torch.arange(rows) * 7 + 3, torch.tensor(contexts[:rows]) - 1,
                                   engine.kv, meta), pool.clone()))  # fmt: skip
        (per_op, per_op_pool), (one_call, one_call_pool) = outs
        assert torch.equal(one_call, per_op), rows
        assert same_pool(one_call_pool, per_op_pool), rows

