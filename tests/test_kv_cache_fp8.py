"""The ``fp8`` KV cache (``--kv-cache-dtype fp8``, float8 e4m3 on CUDA), what a CPU can check of
it: the flag is CUDA's alone and says so elsewhere; the stored form saturates at +-448 and rounds
to nearest even as the GPU's conversion does; attention over an fp8 pool is attention over the
values it holds (the torch reference reads it on any device); its blocks and hand-off payloads
move as bytes, half a 16-bit pool's, and a worker of another cache dtype is refused. The Triton
kernels over an fp8 pool and the engine's greedy paths with one need the GPU:
tests/test_gpu_fp8_kv.py. (Triton's CPU interpreter converts to float8 wrongly near powers of
two — 125.4 becomes 64 — so it cannot stand in for the GPU here.)"""

from __future__ import annotations

import argparse

import pytest
import torch

from services.common.errors import FailedPreconditionError, InvalidArgumentError
from services.engine.core import kv_quant
from services.engine.core.attention import AttentionMetadata, TorchPagedAttention
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.kv_cache import KVLayout, KVPool, kv_cache_dtype
from services.engine.core.loaders import load_model
from services.engine.kv_transfer.cuda_ipc import copy_blocks
from services.engine.kv_transfer.layout import check_layout
from services.engine.kv_transfer.payload import read_payload, write_payload
from services.engine.runtime.worker_options import add_worker_arguments, options_from_args
from services.common.pb import common_pb2
from tests.paged_tables import reversed_tables
from tests.tls_identities import tls_flags

FP8 = torch.float8_e4m3fn


def test_fp8_is_the_cuda_cache() -> None:
    for compute in (torch.float32, torch.bfloat16, torch.float16):
        assert kv_cache_dtype("fp8", compute, device_type="cuda") == FP8
    with pytest.raises(InvalidArgumentError, match="fp8 runs on CUDA only, not cpu.*use q8_0"):
        kv_cache_dtype("fp8", torch.float32, device_type="cpu")
    with pytest.raises(InvalidArgumentError, match="fp8 runs on CUDA only"):
        LLMEngine(load_model("dummy:tiny"), EngineConfig(num_blocks=8, kv_cache_dtype="fp8"))


def test_the_stored_form_saturates_and_rounds_to_nearest_even() -> None:
    # e4m3 between 1 and 2 steps by 1/8: 1.0625 is a tie (to 1.0, even), 1.1875 a tie (to 1.25);
    # past 448 (the largest value) the cast saturates instead of making NaN
    x = torch.tensor([1.0625, 1.1875, -1.0625, 448.0, 464.0, 1e4, -1e4, 2.0**-9, 0.0, float("nan")])
    expected = [1.0, 1.25, -1.0, 448.0, 448.0, 448.0, -448.0, 2.0**-9, 0.0]
    for dtype in (torch.float32, torch.bfloat16):
        stored = kv_quant.store_form(x.to(dtype), FP8)
        assert stored.dtype == FP8
        assert stored[:-1].float().tolist() == expected
        assert stored[-1].float().isnan()
        back = kv_quant.as_stored(x.to(dtype), FP8)
        assert back.dtype == dtype and back[:-1].float().tolist() == expected
    assert torch.finfo(FP8).max == kv_quant.FP8_MAX


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [([1, 1, 1], [1, 40, 100]), ([37], [37]), ([37], [150]), ([5, 70, 1], [5, 170, 9])],
)
def test_attention_over_an_fp8_pool_is_attention_over_its_values(
    dtype: torch.dtype, query_lens: list[int], context_lens: list[int]
) -> None:
    """The torch reference (every prefill on CUDA, and decode under the torch backend) over an
    fp8 pool gives the bits it gives over a pool of the model's dtype holding the same values,
    this step's K/V included: reading an fp8 value into float32 or bfloat16 is exact."""
    torch.manual_seed(sum(context_lens))
    heads, kv_heads, dim, block = 8, 2, 64, 16
    values = torch.randn(32, 2, 2, block, kv_heads, dim) * 30  # some past +-448: saturated
    fp8 = kv_quant.store_form(values, FP8)
    wide = fp8.to(dtype)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, dim, dtype=dtype)
    k, v = (torch.randn(tokens, kv_heads, dim, dtype=dtype) * 30 for _ in range(2))
    meta = AttentionMetadata.build(
        is_prefill=query_lens != [1] * len(query_lens), query_lens=query_lens,
        context_lens=context_lens, block_tables=reversed_tables(context_lens, block), block_size=block,
    )  # fmt: skip
    attention, scale = TorchPagedAttention(), dim**-0.5
    got = attention.forward(q, k, v, fp8[:, 1, 0], fp8[:, 1, 1], meta, scale)
    # the same step over the wide pool, its new K/V given as the fp8 cache holds them
    k_held, v_held = kv_quant.as_stored(k, FP8), kv_quant.as_stored(v, FP8)
    want = attention.forward(q, k_held, v_held, wide[:, 1, 0], wide[:, 1, 1], meta, scale)
    assert torch.equal(got, want)
    assert torch.equal(fp8.to(dtype)[:, 1, 0], wide[:, 1, 0])  # the step stored alike


def test_fp8_blocks_move_as_bytes_half_a_16bit_pool() -> None:
    shape = dict(num_layers=2, block_size=4, num_kv_heads=2, head_dim=16)
    layout, half = KVLayout(**shape, dtype="float8_e4m3fn"), KVLayout(**shape, dtype="bfloat16")
    assert layout.storage_dtype == FP8
    assert layout.bytes_per_token * 2 == half.bytes_per_token
    source, dest = KVPool(6, layout), KVPool(6, layout)
    source.data.copy_(kv_quant.store_form(torch.randn(source.data.shape) * 10, FP8))
    dest.write_blocks([5, 1], source.read_blocks([2, 3]))  # PyTorch's index_copy_ has no float8
    assert torch.equal(dest.data[5].view(torch.uint8), source.data[2].view(torch.uint8))
    assert torch.equal(dest.data[1].view(torch.uint8), source.data[3].view(torch.uint8))
    copy_blocks(source.data, dest.data, [4], [0])  # the CUDA IPC path's copy, on CPU tensors
    assert torch.equal(dest.data[0].view(torch.uint8), source.data[4].view(torch.uint8))
    payload = read_payload(source, [1, 2, 3], 0, 3 * layout.block_bytes)
    assert len(payload) == 3 * layout.block_bytes
    received = KVPool(6, layout)
    write_payload(received, [3, 4, 5], 0, payload[:10])  # a chunk that ends mid-block
    write_payload(received, [3, 4, 5], 10, payload[10:])
    for got, sent in ((3, 1), (4, 2), (5, 3)):
        assert torch.equal(received.data[got].view(torch.uint8),
                           source.data[sent].view(torch.uint8))  # fmt: skip


def test_a_peer_of_another_cache_dtype_is_refused() -> None:
    def proto(dtype: str) -> common_pb2.KVLayout:
        return common_pb2.KVLayout(model_fingerprint="m", dtype=dtype, block_size=16, num_layers=2,
                                   num_kv_heads=2, head_dim=64)  # fmt: skip

    check_layout(proto("float8_e4m3fn"), proto("float8_e4m3fn"))
    with pytest.raises(FailedPreconditionError,
                       match="dtype 'float8_e4m3fn'.*same --kv-cache-dtype"):  # fmt: skip
        check_layout(proto("float8_e4m3fn"), proto("bfloat16"))


def test_the_flag_reaches_a_cuda_worker() -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, port=0, metrics_port=0)
    args = parser.parse_args(["--device", "cuda", "--kv-cache-dtype", "fp8", *tls_flags("decode")])
    assert options_from_args(args, "decode").engine_config().kv_cache_dtype == "fp8"
