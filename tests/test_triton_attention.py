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
    # the last case spans many partitions and more than one chunk of the reduce kernel
    for heads, kv_heads, dim, bs, lens in [(4, 2, 16, 4, [1, 7, 13, 4]), (6, 6, 32, 8, [20, 3]),
                                           (9, 3, 64, 16, [40]), (8, 2, 32, 16, [1100, 5000, 1])]:
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
