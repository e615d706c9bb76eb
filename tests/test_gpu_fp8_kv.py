"""The ``fp8`` KV cache on the GPU (marked ``gpu``; skipped without CUDA): the Triton store gives
the bits of ``kv_quant.store_form`` (saturated, to nearest even) from float32 and bfloat16 K/V;
the Triton decode kernel over an fp8 pool is float64 attention over the values it holds; and a
bfloat16 model's greedy tokens with an fp8 cache are the same on every path a request takes
(cold, a full prefix hit, in a batch, prefilled on one engine and decoded on another). What a
CPU can check of the cache: tests/test_kv_cache_fp8.py; the CUDA IPC hand-off of an fp8 pool:
tests/test_cuda_ipc_gpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.core import kv_quant
from tests.paged_tables import reversed_tables
from tests.test_gpu import _reference_decode
from tests.tiny_stack import write_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_store_rounds_as_the_reference(dtype: torch.dtype) -> None:
    from services.engine.core.kernels.paged_decode_attention import store_kv

    generator = torch.Generator(device="cuda").manual_seed(3)
    tokens, kv_heads, dim, blocks, bs = 300, 8, 128, 40, 16
    k = torch.randn(tokens, kv_heads, dim, device="cuda", generator=generator) * 60
    v = torch.randn(tokens, kv_heads, dim, device="cuda", generator=generator) * 60
    k[0, 0, :4] = torch.tensor([1.0625, 1.1875, 464.0, -1e4])  # ties, and past +-448
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.randperm(blocks * bs, device="cuda", generator=generator)[:tokens]
    cache = torch.zeros(blocks, 2, bs, kv_heads, dim, device="cuda", dtype=FP8)
    store_kv(k, v, cache[:, 0], cache[:, 1], slots // bs, slots % bs)
    want = torch.zeros_like(cache).view(torch.uint8)
    for side, x in enumerate((k, v)):
        want[:, side][slots // bs, slots % bs] = kv_quant.store_form(x, FP8).view(torch.uint8)
    assert torch.equal(cache.view(torch.uint8), want)
    assert cache[0].float().abs().max().item() <= kv_quant.FP8_MAX


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_triton_decode_over_an_fp8_pool(dtype: torch.dtype, tolerance: float) -> None:
    from services.engine.core.kernels.paged_decode_attention import paged_decode_attention

    generator = torch.Generator(device="cuda").manual_seed(5)
    heads, kv_heads, dim, bs = 32, 8, 128, 16
    lens = [1, 17, 300, 4096]
    num_blocks = 2 + sum(-(-n // bs) for n in lens)
    values = torch.randn(num_blocks, 2, 2, bs, kv_heads, dim, device="cuda", generator=generator)
    pool = kv_quant.store_form(values, FP8)
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    tables = reversed_tables(lens, bs)
    width = max(map(len, tables))
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], device="cuda")
    q = torch.randn(len(lens), heads, dim, device="cuda", dtype=dtype, generator=generator)
    scale = dim**-0.5
    out = paged_decode_attention(q, kc, vc, table_tensor, torch.tensor(lens, device="cuda"), scale)
    ref = _reference_decode(q, kc.float(), vc.float(), tables, lens, scale)
    assert out.dtype == dtype and not out.isnan().any()
    error = ((out.double() - ref).norm() / ref.norm()).item()
    assert error < tolerance, error


def test_greedy_tokens_with_an_fp8_cache_are_the_same_on_every_path(tmp_path: Path) -> None:
    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model

    folder = write_tiny_model(tmp_path / "model", 4096, context=1024, hidden=256, layers=4, heads=8)
    loaded = load_model(str(folder), "bfloat16", "cuda")
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompt = [1 + (7 * j) % 4000 for j in range(45)]
    others = [[1 + (11 * i + 5 * j) % 4000 for j in range(9 + 13 * i)] for i in range(7)]

    def engine(**extra: object) -> LLMEngine:
        config = EngineConfig(num_blocks=256, kv_cache_dtype="fp8", **extra)  # type: ignore[arg-type]
        return LLMEngine(loaded, config)

    cold = engine(enable_prefix_caching=False)
    assert cold.kv.data.dtype == FP8 and cold.layout.dtype == "float8_e4m3fn"
    want = cold.generate([prompt], params)[0].new_token_ids
    cached = engine()
    cached.generate([prompt], params)
    assert cached.generate([prompt], params)[0].new_token_ids == want  # a full prefix hit
    assert cold.generate([prompt, *others], params)[0].new_token_ids == want  # in a batch
    prefill, decode = engine(), engine()
    prefill.add_request("r", prompt, params, prefill_only=True)
    done = None
    while prefill.has_unfinished():
        done = next((o for o in prefill.step() if o.finish_reason == "prefilled"), done)
    assert done is not None
    dest = decode.block_manager.allocate(len(done.block_ids))
    decode.kv.write_blocks(dest, prefill.kv.read_blocks(done.block_ids))
    decode.add_prefilled("r", prompt, params, block_ids=dest,
                         first_token_id=done.new_token_ids[0])  # fmt: skip
    rest: list[int] = []
    while decode.has_unfinished():
        rest.extend(t for o in decode.step() for t in o.new_token_ids)
    assert done.new_token_ids + rest == want  # prefilled here, decoded there
