"""Python side of the fused element-wise CPU ops (``cpu_fused.c``) that the model uses.

:class:`CpuFused` replaces, for float32 batches, the residual add + RMSNorm, SwiGLU's
``silu(gate) * up``, GeGLU's ``gelu_tanh(gate) * up``, the rotary embedding and Qwen3's / Gemma 3's
per-head q/k RMSNorm + rotary with one C call each (3-12 PyTorch ops each otherwise): at decode
sizes that saves per-op dispatch, at prompt sizes whole passes over memory (a prompt's rows are
split between the threads). :func:`load_cpu_fused` builds it once per
process for the selected instruction set or returns ``None`` (``TANDEM_CPU_KERNELS=0``, no
compiler); the model then keeps its PyTorch ops, which stay the reference the fused ones are
tested against.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from services.engine.core.kernels.native_build import load_kernel

SOURCE = Path(__file__).with_name("cpu_fused.c")
# the largest decode batch a whole-layer C step (cpu_decode_layers) takes
MAX_ROWS = 32
# the batch sizes at which the one-call decode layers are timed against the per-op path
DECODE_LAYER_ROWS = (1, 8, MAX_ROWS)
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


class CpuFused:
    """Fused float32 ops over contiguous rows."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._add_rmsnorm = library.tandem_add_rmsnorm
        self._add_rmsnorm.restype = None
        self._add_rmsnorm.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float]
        self._silu_mul = library.tandem_silu_mul
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [_PTR, _PTR, _I64, _I64]
        self._gelu_mul = library.tandem_gelu_tanh_mul
        self._gelu_mul.restype = None
        self._gelu_mul.argtypes = [_PTR, _PTR, _I64, _I64]
        self._rope = library.tandem_rope
        self._rope.restype = None
        self._rope.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64]
        self._qk_norm_rope = library.tandem_qk_norm_rope
        self._qk_norm_rope.restype = None
        self._qk_norm_rope.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64,
                                       ctypes.c_float]  # fmt: skip
        self._argmax = library.tandem_argmax_rows
        self._argmax.restype = None
        self._argmax.argtypes = [_PTR, _I64, _I64, _I64, _PTR]

    @staticmethod
    def applies(x: torch.Tensor) -> bool:
        """Whether ``x`` (``[rows, n]``) is a batch these ops take: float32, CPU, contiguous."""
        return x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous()

    def add_rmsnorm(
        self,
        x: torch.Tensor,
        h: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        out_sum: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``RMSNorm(x + h) * weight`` (``h`` may be None); with ``h``, ``x + h`` is written to
        ``out_sum`` (the next residual stream; a new contiguous tensor the caller owns)."""
        rows, n = x.shape
        if h is not None:
            if out_sum is None or out_sum.shape != x.shape or not out_sum.is_contiguous():
                raise ValueError("add_rmsnorm with h needs a contiguous out_sum of x's shape")
            if h.shape != x.shape or not h.is_contiguous():
                h = h.reshape(rows, n).contiguous()
        y = torch.empty_like(x)
        self._add_rmsnorm(
            x.data_ptr(), None if h is None else h.data_ptr(),
            None if out_sum is None else out_sum.data_ptr(), weight.data_ptr(), y.data_ptr(),
            rows, n, eps,
        )  # fmt: skip
        return y

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate_up[:, :n]) * gate_up[:, n:]`` for contiguous ``[rows, 2n]``."""
        rows, width = gate_up.shape
        y = torch.empty(rows, width // 2, dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), y.data_ptr(), rows, width // 2)
        return y

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``gelu(gate_up[:, :n], approximate="tanh") * gate_up[:, n:]`` for contiguous
        ``[rows, 2n]`` (Gemma's GeGLU)."""
        rows, width = gate_up.shape
        y = torch.empty(rows, width // 2, dtype=torch.float32)
        self._gelu_mul(gate_up.data_ptr(), y.data_ptr(), rows, width // 2)
        return y

    def qk_norm_rope_(
        self,
        qkv: torch.Tensor,
        heads: int,
        kv_heads: int,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> bool:
        """In place in a fused projection's output ``qkv`` ``[rows, (heads + 2 kv_heads) d]``
        (contiguous float32): RMSNorm each of the ``heads`` q heads with ``q_weight`` ``[d]`` and
        each k head with ``k_weight`` (what the kernel multiplies by: Gemma's ``1 + w``), then
        rotate them (``cos``/``sin``: ``rows × d`` contiguous). True: done."""
        rows, d = qkv.shape[0], q_weight.shape[0]
        if not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("qk_norm_rope_ needs contiguous cos/sin tables")
        self._qk_norm_rope(qkv.data_ptr(), qkv.stride(0), q_weight.data_ptr(), k_weight.data_ptr(),
                           cos.data_ptr(), sin.data_ptr(), rows, heads, kv_heads, d, eps)  # fmt: skip
        return True

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate ``x`` ``[rows, heads, d]`` (rows may be strided, heads contiguous) in place with
        ``cos``/``sin`` tables of ``rows × d`` contiguous floats (``RotaryEmbedding.lookup``)."""
        rows, heads, d = x.shape
        if x.stride(2) != 1 or x.stride(1) != d or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rope_ needs contiguous heads and contiguous cos/sin tables")
        self._rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), rows, heads, d)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """``logits.argmax(dim=-1)`` (same indices, NaN rule included) for float32 CPU rows with
        unit column stride, as int64; ``None`` for any other tensor (the caller keeps PyTorch's)."""
        if (
            logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2
            or logits.shape[1] == 0 or logits.stride(1) != 1
        ):  # fmt: skip
            return None
        rows, n = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax(logits.data_ptr(), logits.stride(0), rows, n, out.data_ptr())
        return out


@functools.cache
def load_cpu_fused() -> CpuFused | None:
    """The fused ops, built for this machine, or ``None`` when off or not buildable here."""
    return load_kernel(SOURCE, CpuFused, "fused CPU ops")
