"""The GPU's fused Triton element-wise ops equal the model's PyTorch ops (run on CPU through
Triton's interpreter; on a GPU the same script runs natively): add + RMSNorm, SwiGLU and the
rotary embedding, in float32 and bfloat16, and the one-kernel K/V store."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from services.engine.core.kernels.gpu_fused import GpuFused
    from services.engine.core.kernels.paged_decode_attention import store_kv
    from services.engine.core.models.blocks import RMSNorm
    from services.engine.core.rope import RotaryEmbedding, apply_rotary

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)

    def close(got, want, dtype):
        # float32: the reference's own arithmetic; bfloat16: within two ulps of the tensor's
        # largest value (each side rounds every intermediate; Triton's CPU interpreter
        # truncates float32 -> bfloat16 where a GPU, like PyTorch, rounds to nearest even)
        error = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        return error <= (1e-5 * max(1.0, scale) if dtype == torch.float32 else 2.0**-6 * scale)

    ops = GpuFused()
    for dtype in (torch.float32, torch.bfloat16):
        rows, n = 5, 96
        x = torch.randn(rows, n, device=device).to(dtype)
        h = torch.randn(rows, n, device=device).to(dtype)
        norm = RMSNorm(n, 1e-5).to(device, dtype)
        norm.weight.data = torch.randn(n, device=device).to(dtype)
        with torch.no_grad():
            total = torch.empty_like(x)
            got = ops.add_rmsnorm(x, h, norm.weight, norm.eps, total)
            # one bfloat16 ulp: Triton's CPU interpreter truncates float32 -> bfloat16 where a GPU
            # (and PyTorch) round to nearest even; float32, and anything on a GPU, is exact
            ulp = 0.0 if dtype == torch.float32 or device == "cuda" else 2.0**-7
            assert ((total.float() - (x + h).float()).abs() <= (x + h).float().abs() * ulp).all(), dtype
            want = norm(x + h)
            assert close(got, want, dtype), dtype
            assert close(ops.add_rmsnorm(x, None, norm.weight, norm.eps), norm(x), dtype), dtype
        gate_up = torch.randn(rows, 2 * n, device=device).to(dtype)
        gate, up = gate_up.split(n, dim=-1)
        assert close(ops.silu_mul(gate_up), F.silu(gate) * up, dtype), dtype
        rope = RotaryEmbedding(16, 64, 10000.0, None).to(device)
        positions = torch.tensor([0, 3, 9, 17, 63], device=device)
        cos, sin = rope.lookup(positions, dtype)
        qkv = torch.randn(rows, 7 * 16, device=device).to(dtype)
        qk = qkv[:, : 6 * 16].view(rows, 6, 16)  # strided rows, as in the model
        want = apply_rotary(qk, cos, sin)
        ops.rope_(qk, cos, sin)
        assert close(qk, want, dtype), dtype
        k, v = torch.randn(2, rows, 2, 16, device=device).to(dtype)
        pool = torch.zeros(8, 2, 4, 2, 16, device=device, dtype=dtype)
        blocks = torch.tensor([1, 1, 5, 7, 2], device=device)
        offsets = torch.tensor([0, 3, 2, 1, 0], device=device)
        store_kv(k, v, pool[:, 0], pool[:, 1], blocks, offsets)
        assert torch.equal(pool[blocks, 0, offsets], k) and torch.equal(pool[blocks, 1, offsets], v)
        assert pool.count_nonzero() == k.numel() + v.numel()
    print("OK")
    """
)


def test_fused_triton_ops_match_the_model_ops() -> None:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
