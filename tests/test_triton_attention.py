"""The Triton paged decode kernels equal the torch reference, for short contexts and for ones split
over many partitions (run on CPU through Triton's interpreter; on a GPU the same test runs
natively)."""

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
    from services.engine.core.attention import AttentionMetadata, TorchPagedAttention
    from services.engine.core.kernels.paged_decode_attention import TritonPagedAttention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    # the last case spans many partitions and more than one chunk of the reduce kernel; 96 and
    # 48 are head sizes that are not powers of two (Phi-3-mini's 96), padded inside the kernel
    for heads, kv_heads, dim, bs, lens in [(4, 2, 16, 4, [1, 7, 13, 4]), (6, 6, 32, 8, [20, 3]),
                                           (9, 3, 64, 16, [40]), (8, 2, 32, 16, [1100, 5000, 1]),
                                           (4, 2, 96, 8, [30, 300]), (2, 1, 48, 4, [9])]:
        nb = 2 + sum(-(-n // bs) for n in lens)
        pool = torch.randn(nb, 2, bs, kv_heads, dim, device=device)
        kc, vc = pool[:, 0], pool[:, 1]
        tables, next_id = [], 1
        for n in lens:
            need = -(-n // bs)
            tables.append(list(range(next_id, next_id + need))[::-1])
            next_id += need
        q = torch.randn(len(lens), heads, dim, device=device)
        k = torch.randn(len(lens), kv_heads, dim, device=device)
        v = torch.randn(len(lens), kv_heads, dim, device=device)
        outs = []
        for backend in (TorchPagedAttention(), TritonPagedAttention()):
            kcc, vcc = kc.clone(), vc.clone()
            meta = AttentionMetadata.build(is_prefill=False, query_lens=[1] * len(lens),
                context_lens=lens, block_tables=tables, block_size=bs, device=device)
            outs.append(backend.forward(q, k, v, kcc, vcc, meta, dim ** -0.5))
        err = (outs[0] - outs[1]).abs().max().item()
        assert err < 1e-4, (heads, kv_heads, dim, err)
    print("OK")
    """
)


def test_triton_decode_kernel_matches_torch_reference() -> None:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


_WINDOW_SCRIPT = textwrap.dedent(
    """
    import torch
    from services.engine.core import attention
    from services.engine.core.attention import AttentionMetadata, TorchPagedAttention
    from services.engine.core.kernels import paged_decode_attention as triton_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    reference_calls = []
    real = attention._windowed_forward

    def counted(q, k, v, kc, vc, meta, *rest):
        reference_calls.append(meta.is_prefill)
        return real(q, k, v, kc, vc, meta, *rest)

    triton_attention._windowed_forward = counted
    heads, kv_heads, dim, bs = 8, 2, 32, 16
    # decode steps (contexts shorter and longer than the window, one past several partitions)
    # and a mixed step (prompt chunks next to decode rows), float32 and 16-bit caches
    steps = [(False, [1, 1, 1, 1], [1, 9, 700, 300]), (True, [1, 20, 1], [40, 150, 600])]
    for cache_dtype in (torch.float32, torch.bfloat16, torch.float16):
        for window, softcap in [(8, None), (None, 3.0), (260, 2.0), (5000, None)]:
            for is_prefill, query_lens, context_lens in steps:
                nb = 2 + sum(-(-n // bs) for n in context_lens)
                pool = torch.randn(nb, 2, bs, kv_heads, dim, device=device).to(cache_dtype)
                tables, next_id = [], 1
                for n in context_lens:
                    need = -(-n // bs)
                    tables.append(list(range(next_id, next_id + need))[::-1])
                    next_id += need
                tokens = sum(query_lens)
                q = torch.randn(tokens, heads, dim, device=device) * 3
                k = torch.randn(tokens, kv_heads, dim, device=device)
                v = torch.randn(tokens, kv_heads, dim, device=device)
                outs = []
                for backend in (TorchPagedAttention(), triton_attention.TritonPagedAttention()):
                    p = pool.clone()
                    meta = AttentionMetadata.build(is_prefill=is_prefill, query_lens=query_lens,
                        context_lens=context_lens, block_tables=tables, block_size=bs, device=device)
                    reference_calls.clear()
                    outs.append((backend.forward(q, k, v, p[:, 0], p[:, 1], meta, dim ** -0.5,
                                                 window, softcap), p))
                # the kernel took every decode row: the reference saw prompts only
                assert not any(call is False for call in reference_calls), reference_calls
                err = (outs[0][0] - outs[1][0]).abs().max().item()
                assert err < 1e-4, (cache_dtype, window, softcap, is_prefill, err)
                stored = [p.view(torch.int16) if p.dtype != torch.float32 else p for _, p in outs]
                assert torch.equal(*stored), (cache_dtype, "the same K/V bits stored")
    print("OK")
    """
)


def test_triton_decode_kernel_takes_windows_softcaps_and_16bit_caches() -> None:
    """Sliding windows and soft-capping in the decode kernel (decode rows of mixed steps too)
    equal attention.py's reference, over float32, bfloat16 and float16 caches under float32
    queries; the K/V store rounds as PyTorch does."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", _WINDOW_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
