"""A ``q8_0`` KV cache (``--kv-cache-dtype q8_0``: int8 with a float16 scale per 32 values).

The C attention kernels read it as exactly the float32 cache holding its values, so they are
checked bit for bit against themselves over that float32 cache (decode, prefill, a mixed step,
sliding window and soft-cap, every head size shape), on every instruction set this machine runs;
the decode kernel stores a row with the bits ``kv_quant.quantize`` (the PyTorch reference) gives;
the torch reference (``TANDEM_CPU_KERNELS=0``) attends over the same values; the one-call decode
layers stay the per-op path bit for bit; and the flag reaches the pool and is refused where it
cannot run. (The hand-off: tests/test_kv_transfer.py; every request path bit for bit:
tests/test_deterministic_greedy.py.)
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingParams
from services.engine.core import kv_quant
from services.engine.core.attention import AttentionMetadata, TorchPagedAttention
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.kernels.autotune import KernelRegimes
from services.engine.core.kernels.cpu_decode_layers import load_cpu_decode_layers
from services.engine.core.kernels.cpu_fused import MAX_ROWS
from services.engine.core.kernels.cpu_paged_attention import (
    CpuPagedAttention,
    cpu_paged_decode_attention,
    load_cpu_attention,
)
from services.engine.core.kernels.loaded import forget_loaded_kernels
from services.engine.core.kernels.native_build import supported_isas
from services.engine.core.kv_cache import Q8_0, KVLayout, KVPool, kv_cache_dtype
from services.engine.core.linear import Linear
from services.engine.core.loaders import load_model
from services.engine.runtime.worker_options import add_worker_arguments, options_from_args
from services.launch_plan import LaunchConfig, plan
from tests.conftest import native_kernel_or_skip
from tests.paged_tables import reversed_tables
from tests.test_kv_cache_dtype import one_call_equals_per_op
from tests.tls_identities import tls_flags


@pytest.fixture(params=supported_isas())
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    native_kernel_or_skip()
    monkeypatch.setenv("TANDEM_CPU_ISA", request.param)
    forget_loaded_kernels()
    yield request.param
    monkeypatch.delenv("TANDEM_CPU_ISA")
    forget_loaded_kernels()


def test_the_row_layout_and_its_arithmetic() -> None:
    assert [kv_quant.row_bytes(d) for d in (16, 24, 64, 96, 128, 256)] == [18, 26, 68, 102, 136, 272]
    layout = KVLayout(num_layers=16, block_size=16, num_kv_heads=8, head_dim=64, dtype="q8_0")
    half = KVLayout(num_layers=16, block_size=16, num_kv_heads=8, head_dim=64, dtype="float16")
    assert layout.bytes_per_token == 16 * 2 * 8 * 68 and half.bytes_per_token == 16 * 2 * 8 * 128
    pool = KVPool(3, layout)
    assert pool.data.dtype == torch.uint8 and pool.data.shape == (3, 16, 2, 16, 8, 68)
    assert pool.data[1].numel() == layout.block_bytes  # a block: one contiguous region of bytes
    torch.manual_seed(0)
    x = torch.randn(5, 3, 96) * (torch.rand(5, 3, 1) + 0.1) * 10
    x[0, 0, 32:64] = 0.0  # an all-zero group: scale 0, quants 0
    rows = kv_quant.quantize(x)
    quants = rows[..., :96].view(torch.int8).float()
    scales = rows[..., 96:].contiguous().view(torch.float16).float()
    assert quants.abs().max() == 127 and scales[0, 0, 1] == 0
    groups = x.unflatten(-1, (3, 32))
    expected = (groups.abs().amax(-1).numpy() / np.float32(127)).astype(np.float16)  # IEEE division
    assert torch.equal(scales, torch.from_numpy(expected).float())
    back = kv_quant.dequantize(rows, 96)
    assert torch.equal(back, quants * scales.repeat_interleave(32, -1))  # float(q) * scale
    # off by at most half a step (and the float16 rounding of the scale): 0.5% of the group's max
    assert ((back - x).abs().unflatten(-1, (3, 32)) <= groups.abs().amax(-1, keepdim=True) * 5e-3).all()
    assert torch.equal(kv_quant.quantize(back), rows)  # stored values store as themselves


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block", "query_lens", "context_lens", "window", "softcap"),
    [
        (9, 3, 64, 16, [1, 1, 1], [1, 40, 100], None, None),  # decode: SmolLM2's shape
        (4, 2, 128, 16, [1, 1], [33, 300], None, None),  # decode: head_dim 128
        (8, 8, 24, 4, [1, 1], [5, 9], None, None),  # decode: head_dim not whole vectors
        (2, 1, 96, 16, [1, 1], [70, 200], 50, 30.0),  # decode: Phi-3's 96, window, soft-cap
        (9, 3, 64, 16, [37], [150], None, None),  # prefill: a cached prefix
        (4, 2, 16, 4, [5, 70, 1], [5, 170, 9], None, None),  # prefill and a decode row
        (4, 2, 32, 16, [40, 1], [100, 77], 24, 20.0),  # prefill: window and soft-cap
    ],
)
def test_the_kernels_read_q8_0_as_the_float32_cache_of_its_values(
    isa: str, heads: int, kv_heads: int, dim: int, block: int, query_lens: list[int],
    context_lens: list[int], window: int | None, softcap: float | None,
) -> None:  # fmt: skip
    torch.manual_seed(dim + sum(context_lens))
    pool = kv_quant.quantize(torch.randn(64, 2, 2, block, kv_heads, dim))  # the KVPool layout
    values = kv_quant.dequantize(pool, dim)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, dim)
    k, v = torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    meta = AttentionMetadata.build(
        is_prefill=query_lens != [1] * len(query_lens), query_lens=query_lens,
        context_lens=context_lens, block_tables=reversed_tables(context_lens, block), block_size=block,
    )  # fmt: skip
    scale = dim**-0.5
    args = (meta, scale, window, softcap)
    ref_pool = pool.clone()
    got = CpuPagedAttention().forward(q, k, v, pool[:, 1, 0], pool[:, 1, 1], *args)
    k_stored, v_stored = kv_quant.as_stored(k, torch.uint8), kv_quant.as_stored(v, torch.uint8)
    over_values = CpuPagedAttention().forward(q, k_stored, v_stored, values[:, 1, 0], values[:, 1, 1], *args)
    assert torch.equal(got, over_values)
    reference = TorchPagedAttention().forward(q, k, v, ref_pool[:, 1, 0], ref_pool[:, 1, 1], *args)
    assert torch.allclose(got, reference, atol=1e-5), (got - reference).abs().max()
    assert torch.equal(pool, ref_pool)  # the step's K/V stored with the same bytes on both paths


def test_the_decode_kernel_quantizes_as_the_reference_does(isa: str) -> None:
    """Stored rows: the bytes ``kv_quant.quantize`` gives, for large, small, subnormal-scaled,
    tied and all-zero groups, and head sizes with a short last group."""
    torch.manual_seed(1)
    for dim in (16, 24, 64, 96):
        rows = 64
        values = torch.randn(rows, 1, dim) * torch.logspace(-6, 4, rows)[:, None, None]
        values[3] = 0.0
        values[4, 0, : min(dim, 32)] = torch.arange(min(dim, 32)) * 0.5 - 3.0  # ties at x.5
        values[5] = -values[5]
        k_cache = torch.zeros(rows + 1, 1, 1, kv_quant.row_bytes(dim), dtype=torch.uint8)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.arange(1, rows + 1)
        cpu_paged_decode_attention(
            torch.zeros(rows, 1, dim), k_cache, v_cache, slots.view(rows, 1),
            torch.ones(rows, dtype=torch.long), 1.0,
            new_kv=(values, -values, slots, torch.zeros(rows, dtype=torch.long)),
        )  # fmt: skip
        assert torch.equal(k_cache[1:, 0], kv_quant.quantize(values)), dim
        assert torch.equal(v_cache[1:, 0], kv_quant.quantize(-values)), dim


def test_one_call_decode_layers_equal_the_per_op_path_over_a_q8_0_cache(
    isa: str, tiny_llama_dir: Path
) -> None:
    """The one-call C decode step supports ``q8_0`` (it calls the same decode kernel)."""
    loaded = load_model(str(tiny_llama_dir), "float32")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=160, kv_cache_dtype="q8_0"))
    assert engine.kv.data.dtype == torch.uint8 and engine.layout.dtype == "q8_0"
    model = loaded.model
    for module in model.modules():  # every op on its kernel, whatever this machine's timings
        if isinstance(module, Linear):
            module.regimes = KernelRegimes()
    for layer in model.layers:
        layer.self_attn.backend.regimes = KernelRegimes()
    assert model.use_decode_layers(load_cpu_decode_layers()) == MAX_ROWS
    torch.manual_seed(0)
    pool = engine.kv.data
    head_dim = loaded.config.head_dim
    with torch.inference_mode():
        pool.copy_(kv_quant.quantize(torch.randn(*pool.shape[:-1], head_dim)))
    start = pool.clone()
    one_call_equals_per_op(model, engine, start, torch.equal)
    assert not torch.equal(pool, start)  # the steps wrote K/V


def _greedy(loaded: object, kv: str, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, kv_cache_dtype=kv))  # type: ignore[arg-type]
    return [out.new_token_ids for out in engine.generate(prompts, params)]


def test_greedy_tokens_with_a_q8_0_cache_mostly_match_float32(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir), "float32")
    prompts = [[(13 * i + 7 * j) % 250 + 3 for j in range(20 + 9 * i)] for i in range(4)]
    reference, q8 = _greedy(loaded, "float32", prompts), _greedy(loaded, "q8_0", prompts)
    total = sum(len(t) for t in reference)
    same = sum(a == b for ours, ref in zip(q8, reference, strict=True)
               for a, b in zip(ours, ref, strict=True))  # fmt: skip
    assert same >= 0.8 * total, (same, total)


def test_without_kernels_the_torch_reference_reads_q8_0(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TANDEM_CPU_KERNELS=0``: PyTorch dequantizes and attends; the cache's bytes are the
    kernels' and the logits agree with them to float32 rounding."""
    prompt = [[(5 * j) % 200 + 3 for j in range(45)]]
    outputs = {}
    for kernels in ("1", "0"):
        monkeypatch.setenv("TANDEM_CPU_KERNELS", kernels)
        forget_loaded_kernels()
        loaded = load_model(str(tiny_llama_dir), "float32")
        assert (load_cpu_attention() is None) == (kernels == "0")
        engine = LLMEngine(loaded, EngineConfig(num_blocks=16, kv_cache_dtype="q8_0"))
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
        out = engine.generate(prompt, params)[0]
        outputs[kernels] = (out.new_token_ids, [lp.logprob for lp in out.new_logprobs])
    forget_loaded_kernels()
    assert outputs["0"][0] == outputs["1"][0]
    assert max(abs(a - b) for a, b in zip(outputs["0"][1], outputs["1"][1], strict=True)) < 1e-4


def test_the_cache_dtype_q8_0_means() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    assert kv_cache_dtype("q8_0", f32) == Q8_0
    with pytest.raises(InvalidArgumentError, match="q8_0 runs on CPU only, not cuda"):
        kv_cache_dtype("q8_0", f32, device_type="cuda")
    with pytest.raises(InvalidArgumentError, match="computes in bfloat16"):
        kv_cache_dtype("q8_0", bf16)
    assert kv_cache_dtype("auto", f32, lambda: torch.float16) == torch.float16  # auto unchanged


def test_the_q8_0_flag_reaches_workers_and_tandem_up() -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, port=0, metrics_port=0)
    args = parser.parse_args(["--device", "cpu", "--kv-cache-dtype", "q8_0", *tls_flags("decode")])
    assert options_from_args(args, "decode").engine_config().kv_cache_dtype == "q8_0"
    specs = plan(LaunchConfig(num_prefill=1, num_decode=1, kv_cache_dtype="q8_0"))
    workers = [spec for spec in specs if spec.service in ("prefill", "decode")]
    assert len(workers) == 2
    for spec in workers:
        assert spec.argv[spec.argv.index("--kv-cache-dtype") + 1] == "q8_0"


def test_tandem_generate_takes_q8_0() -> None:
    from services.engine.runtime.generate_cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--kv-cache-dtype", "q8_0", "--prompt", "hello"])
    assert args.kv_cache_dtype == "q8_0"
