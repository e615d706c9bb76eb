"""The fused CPU ops equal the PyTorch ops they replace, for decode batches and for prompts split
between threads, and the model uses them for contiguous float32 rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.core.kernels.cpu_fused import CpuFused, load_cpu_fused
from services.engine.core.models.blocks import GemmaRMSNorm, RMSNorm
from services.engine.core.rope import RotaryEmbedding, apply_rotary
from tests.conftest import native_kernel_or_skip


@pytest.fixture
def fused() -> CpuFused:
    native_kernel_or_skip()
    ops = load_cpu_fused()
    if ops is None:
        pytest.fail("the matmul kernel builds here but the fused ops do not")
    return ops


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n", [576, 70])  # 70: not a multiple of the vector width
def test_add_rmsnorm_matches_reference(fused: CpuFused, rows: int, n: int) -> None:
    torch.manual_seed(rows + n)
    norm = RMSNorm(n, 1e-5)
    norm.weight.data = torch.randn(n)
    x, h = torch.randn(rows, n), torch.randn(rows, n)
    with torch.no_grad():
        assert torch.allclose(fused.add_rmsnorm(x, None, norm.weight, norm.eps), norm(x), atol=2e-6)
        total = torch.empty_like(x)
        y = fused.add_rmsnorm(x, h, norm.weight, norm.eps, total)
        assert torch.equal(total, x + h)
        assert torch.allclose(y, norm(x + h), atol=2e-6)
    with pytest.raises(ValueError, match="out_sum"):
        fused.add_rmsnorm(x, h, norm.weight, norm.eps)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_silu_mul_and_rope_match_reference(fused: CpuFused, rows: int) -> None:
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 96)
    gate, up = gate_up.split(96, dim=-1)
    assert torch.allclose(fused.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6)

    rope = RotaryEmbedding(64, 256, 10000.0, None)
    rope.reset_tables()
    cos, sin = rope.lookup(torch.arange(rows) + 7, torch.float32)
    qkv = torch.randn(rows, (4 + 2 + 2) * 64)
    qk = qkv[:, : 6 * 64].view(rows, 6, 64)  # strided rows, as in the model
    expected = apply_rotary(qk, cos, sin)
    untouched = qkv[:, 6 * 64 :].clone()
    fused.rope_(qk, cos, sin)
    assert torch.allclose(qk, expected, atol=1e-6)
    assert torch.equal(qkv[:, 6 * 64 :], untouched)


@pytest.mark.parametrize("rows", [1, 5, 100])  # 100: split between the threads
def test_gelu_tanh_mul_matches_reference(fused: CpuFused, rows: int) -> None:
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 70) * 4  # 70: a tail past the vector width; tails of both signs
    gate, up = gate_up.split(70, dim=-1)
    got = fused.gelu_tanh_mul(gate_up)
    assert got is not None
    torch.testing.assert_close(got, F.gelu(gate, approximate="tanh") * up, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 80])
def test_qk_norm_rope_matches_norms_then_rotary(fused: CpuFused, rows: int, gemma: bool) -> None:
    """Qwen3's (``w``) and Gemma 3's (``1 + w``, folded) per-head norms, then the rotation, in
    place in the q and k heads of a fused projection's rows; v untouched."""
    torch.manual_seed(rows)
    heads, kv_heads, d = 4, 2, 48  # 48: not a multiple of AVX-512's width
    norm_type = GemmaRMSNorm if gemma else RMSNorm
    q_norm, k_norm = norm_type(d, 1e-6), norm_type(d, 1e-6)
    q_norm.weight.data, k_norm.weight.data = torch.randn(d) * 0.3, torch.randn(d) * 0.3
    rope = RotaryEmbedding(d, 256, 10000.0, None)
    rope.reset_tables()
    cos, sin = rope.lookup(torch.arange(rows) + 3, torch.float32)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d) * 3
    q_end, k_end = heads * d, (heads + kv_heads) * d
    with torch.no_grad():
        q = apply_rotary(q_norm(qkv[:, :q_end].view(rows, heads, d)), cos, sin)
        k = apply_rotary(k_norm(qkv[:, q_end:k_end].view(rows, kv_heads, d)), cos, sin)
    v = qkv[:, k_end:].clone()
    assert fused.qk_norm_rope_(qkv, heads, kv_heads, q_norm.kernel_weight(), k_norm.kernel_weight(),
                               1e-6, cos, sin)  # fmt: skip
    torch.testing.assert_close(qkv[:, :q_end].view(rows, heads, d), q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, q_end:k_end].view(rows, kv_heads, d), k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, k_end:], v)


def test_applies_to_contiguous_float32_rows(fused: CpuFused) -> None:
    assert fused.applies(torch.zeros(1, 8)) and fused.applies(torch.zeros(4096, 8))
    assert not fused.applies(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert not fused.applies(torch.zeros(8, 4).T)


def test_prompt_sized_batches_split_between_threads_row_for_row(fused: CpuFused) -> None:
    """A prompt's rows (past the threading threshold) equal the reference, and each row comes
    out bit for bit as it does alone, on one thread or two."""
    torch.manual_seed(11)
    rows, n = 300, 576
    norm = RMSNorm(n, 1e-5)
    norm.weight.data = torch.randn(n)
    x, h, gate_up = torch.randn(rows, n), torch.randn(rows, n), torch.randn(rows, 2 * 96)
    rope = RotaryEmbedding(64, 512, 10000.0, None)
    rope.reset_tables()
    cos, sin = rope.lookup(torch.arange(rows), torch.float32)
    qkv = torch.randn(rows, 8 * 64)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            total = torch.empty_like(x)
            with torch.no_grad():
                y = fused.add_rmsnorm(x, h, norm.weight, norm.eps, total)
                assert torch.allclose(y, norm(x + h), atol=2e-6)
            act = fused.silu_mul(gate_up)
            assert torch.allclose(act, F.silu(gate_up[:, :96]) * gate_up[:, 96:], atol=1e-6)
            rotated = qkv.clone()
            qk = rotated[:, : 6 * 64].view(rows, 6, 64)
            expected = apply_rotary(qkv[:, : 6 * 64].view(rows, 6, 64), cos, sin)
            fused.rope_(qk, cos, sin)
            assert torch.allclose(qk, expected, atol=1e-6)
            for r in (0, 137, rows - 1):
                one = torch.empty(1, n)
                assert torch.equal(fused.add_rmsnorm(x[r : r + 1], h[r : r + 1], norm.weight, norm.eps, one), y[r : r + 1])
                assert torch.equal(fused.silu_mul(gate_up[r : r + 1]), act[r : r + 1])
                alone = qkv[r : r + 1].clone()
                fused.rope_(alone[:, : 6 * 64].view(1, 6, 64), cos[r : r + 1], sin[r : r + 1])
                assert torch.equal(alone, rotated[r : r + 1])
    finally:
        torch.set_num_threads(threads)


def test_model_tokens_equal_with_and_without_fused_ops(fused: CpuFused, tiny_llama_dir) -> None:  # type: ignore[no-untyped-def]
    from services.common.sampling_params import SamplingParams
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model

    loaded = load_model(str(tiny_llama_dir), torch.float32)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for name, ops in (("fused", fused), ("torch", None)):
        loaded.model.use_fused(ops)
        outs[name] = engine.generate([[1, 5, 9, 13], [1, 7]], params)
    for a, b in zip(outs["fused"], outs["torch"], strict=True):
        assert a.new_token_ids == b.new_token_ids and len(a.new_token_ids) == 12


@pytest.mark.parametrize("n", [49152, 70, 3])  # a vocabulary, not a multiple of the width, short
def test_argmax_matches_torch_argmax(fused: CpuFused, n: int) -> None:
    torch.manual_seed(n)
    x = torch.randn(9, n + 5)[:, :n]  # strided rows, as the sampler's vocabulary slice
    x[1] = 0.0  # all tied: the first index
    x[2, n // 2] = x[2, n - 1] = 100.0  # a tie across lanes: the lower index
    x[3] = float("-inf")
    x[4, n - 1] = float("nan")  # NaN is the maximum, as torch.argmax has it
    x[5, [n // 3, n - 1]] = float("nan")  # the first NaN
    x[6, 0], x[7, n - 1] = 1e9, 1e9  # the first and the last element
    x[8, 0] = -0.0
    got = fused.argmax(x)
    assert got is not None and got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=-1).tolist()
    assert fused.argmax(x.double()) is None and fused.argmax(x.T) is None  # not taken: torch's


def test_greedy_sampling_uses_it(fused: CpuFused) -> None:
    from services.common.sampling_params import SamplingParams
    from services.engine.core.sampler import Sampler, SamplingState

    sampler = Sampler(50, eos_token_ids=[0])
    logits = torch.randn(4, 64)
    states = [SamplingState.create(SamplingParams(temperature=0), [1, 2]) for _ in range(4)]
    expected = sampler(logits, states).token_ids
    calls = []
    sampler.use_argmax(lambda t: calls.append(t.shape) or fused.argmax(t))
    assert sampler(logits, states).token_ids == expected == logits[:, :50].argmax(-1).tolist()
    assert calls == [(4, 50)]
