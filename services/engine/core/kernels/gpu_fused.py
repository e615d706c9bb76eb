"""Triton kernels for the element-wise ops around a GPU decode layer's matmuls, one launch each.

A decoder layer's matmuls stream its weights; what else it does per token (residual add +
RMSNorm, the rotary embedding, SwiGLU's ``silu(gate) * up``) touches a few kilobytes but costs
3-8 PyTorch kernels each. Inside a CUDA graph a kernel still costs its few microseconds, and a
32-layer model runs hundreds of them per step: at batch 1 that is a third of the step. Each op
here is one kernel, with the same roundings as the PyTorch reference ops in
:mod:`services.engine.core.models.blocks` (float32 arithmetic, each intermediate the reference rounds to
the model's dtype rounded here too), so the two agree to the last bit but for the order of the
norm's sum.

:class:`GpuFused` has the interface of
:class:`~services.engine.core.kernels.cpu_fused.CpuFused`, so the model's fused hooks take either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(x_ptr, h_ptr, sum_ptr, w_ptr, y_ptr, n, eps,
                        HAS_H: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
    if HAS_H:
        x = (x.to(tl.float32) + tl.load(h_ptr + row * n + cols, mask=mask, other=0.0)
             .to(tl.float32)).to(x.dtype)  # fmt: skip
        tl.store(sum_ptr + row * n + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n + eps)
    normed = (x32 * scale).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, y_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up_ptr + row * 2 * n + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (silu * up).to(gate.dtype), mask=mask)


@triton.jit
def _rope_kernel(x_ptr, stride_row, cos_ptr, sin_ptr, heads, HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, 2 * HALF)
    rotated = (dims + HALF) % (2 * HALF)  # x.roll(d / 2)
    base = x_ptr + row * stride_row + head * 2 * HALF
    x = tl.load(base + dims)
    xr = tl.load(base + rotated).to(tl.float32)
    cos = tl.load(cos_ptr + row * 2 * HALF + dims).to(tl.float32)
    sin = tl.load(sin_ptr + row * 2 * HALF + dims).to(tl.float32)
    a = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
    b = (xr * sin).to(x.dtype).to(tl.float32)
    tl.store(base + dims, (a + b).to(x.dtype))


class GpuFused:
    """Fused ops over CUDA rows of any float dtype (see the module docstring)."""

    @staticmethod
    def applies(x: torch.Tensor) -> bool:
        """Whether ``x`` (``[rows, n]``) is a batch these ops take: CUDA, 2-D, contiguous."""
        return x.device.type == "cuda" and x.dim() == 2 and x.is_contiguous()

    def add_rmsnorm(
        self,
        x: torch.Tensor,
        h: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        out_sum: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``RMSNorm(x + h) * weight`` (``h`` may be None); with ``h``, ``x + h`` is written to
        ``out_sum`` (contiguous, ``x``'s shape)."""
        rows, n = x.shape
        if h is not None:
            if out_sum is None or out_sum.shape != x.shape or not out_sum.is_contiguous():
                raise ValueError("add_rmsnorm with h needs a contiguous out_sum of x's shape")
            h = h.reshape(rows, n).contiguous()
        y = torch.empty_like(x, dtype=torch.promote_types(weight.dtype, x.dtype))
        _add_rmsnorm_kernel[(rows,)](
            x, h if h is not None else x, out_sum if out_sum is not None else x, weight, y, n, eps,
            HAS_H=h is not None, BLOCK=triton.next_power_of_2(n),
        )  # fmt: skip
        return y

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate_up[:, :n]) * gate_up[:, n:]`` for contiguous ``[rows, 2n]``."""
        rows, width = gate_up.shape
        n = width // 2
        y = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, y, n, BLOCK=block)
        return y

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """No GeGLU kernel here: ``None`` (the caller keeps its PyTorch ops)."""
        return None

    def qk_norm_rope_(
        self, qkv: torch.Tensor, heads: int, kv_heads: int, q_weight: torch.Tensor,
        k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
    ) -> bool:  # fmt: skip
        """No q/k-norm kernel here: False (the caller keeps its PyTorch ops)."""
        return False

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate ``x`` ``[rows, heads, d]`` (rows may be strided, heads contiguous) in place with
        ``cos``/``sin`` of ``rows × d`` contiguous values (``RotaryEmbedding.lookup``)."""
        rows, heads, d = x.shape
        if x.stride(2) != 1 or x.stride(1) != d or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rope_ needs contiguous heads and contiguous cos/sin tables")
        _rope_kernel[(rows, heads)](x, x.stride(0), cos, sin, heads, HALF=d // 2)


def load_gpu_fused() -> GpuFused:
    """The fused ops (one stateless object: Triton compiles each kernel at its first call)."""
    return GpuFused()
