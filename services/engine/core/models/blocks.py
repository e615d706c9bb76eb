"""The building blocks every model family is made of: norms, attention over the paged KV cache,
gated MLPs, and the fused-op interface the fast paths plug into.

Each block takes its shape from :class:`~services.common.model_config.ModelConfig` and keeps
one plain PyTorch ``forward`` as the reference; a family module (``llama.py``, ``gemma3.py``, ...)
stacks them top to bottom. Per-token paths call submodules' ``forward`` directly (skipping
``nn.Module.__call__``'s hook bookkeeping): on CPU, decode time not spent streaming weights is
per-op Python overhead.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from services.common.model_config import ModelConfig
from services.engine.core.attention import AttentionMetadata, PagedAttention
from services.engine.core.linear import Linear
from services.engine.core.rope import apply_rotary

Rope = tuple[torch.Tensor, torch.Tensor]


class FusedOps(Protocol):
    """Fused element-wise ops a layer may run instead of its PyTorch ones: the CPU's C kernels
    (``cpu_fused.CpuFused``) or the GPU's Triton kernels (``gpu_fused.GpuFused``)."""

    def applies(self, x: torch.Tensor) -> bool: ...
    def add_rmsnorm(self, x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor,
                    eps: float, out_sum: torch.Tensor | None = None) -> torch.Tensor: ...
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None: ...
    # where these two return None / False, the caller keeps its PyTorch ops
    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None: ...
    def qk_norm_rope_(self, qkv: torch.Tensor, heads: int, kv_heads: int, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor) -> bool: ...


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, exactly as Hugging Face's LlamaRMSNorm.

    Written out rather than ``F.rms_norm`` so that it matches the reference bit for bit in every
    dtype (the two measured the same speed for CPU decode).
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x32.to(x.dtype)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def kernel_weight(self) -> torch.Tensor:
        """What a fused RMSNorm kernel (``y = w * normed``) multiplies by: the weight itself."""
        return self.weight


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores ``w``, the norm scales by ``1 + w``, and it rounds
    to the activation dtype after the scaling, not before (as Hugging Face's Gemma3RMSNorm).

    The fused kernels take the scale folded: :meth:`kernel_weight` is ``1 + w`` in float32 (the
    reference's own rounding of it), computed once per weight tensor."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        self._folded: torch.Tensor | None = None
        self._folded_of: tuple[int, int] = (0, -1)  # (data_ptr, version) of the weight folded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def kernel_weight(self) -> torch.Tensor:
        w = self.weight.detach()
        key = (w.data_ptr(), w._version)
        if self._folded is None or key != self._folded_of:
            self._folded, self._folded_of = (1.0 + w.float()).contiguous(), key
        return self._folded


def make_norm(config: ModelConfig, size: int) -> RMSNorm:
    """The family's norm over ``size`` features."""
    gemma = config.architecture in ("gemma2", "gemma3")
    return (GemmaRMSNorm if gemma else RMSNorm)(size, config.rms_norm_eps)


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache: fused QKV projection (optional bias, as
    in Qwen2), optional per-head q/k RMSNorm before the rotation (Qwen3, Gemma 3), partial
    rotation (Phi-4-mini), a sliding window and score soft-capping where the layer has them."""

    def __init__(self, config: ModelConfig, backend: PagedAttention, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = make_norm(config, config.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, config.head_dim) if config.qk_norm else None
        self.backend = backend
        self.scale = config.query_scale or self.head_dim**-0.5
        self.window = config.sliding_window if config.is_sliding(layer) else None
        self.softcap = config.attn_softcap
        self.partial_rotary = config.rotary_dim != config.head_dim
        self.fused: FusedOps | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        heads = self.num_heads
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        q_norm, k_norm, fused = self.q_norm, self.k_norm, self.fused
        if (
            q_norm is not None and k_norm is not None and fused is not None
            and not self.partial_rotary and fused.applies(qkv)
            and fused.qk_norm_rope_(qkv, heads, self.num_kv_heads, q_norm.kernel_weight(),
                                    k_norm.kernel_weight(), q_norm.eps, *rope)
        ):  # fmt: skip
            # normed and rotated in place in the projection's output, as the one-call layers do
            qk = qkv[:, : self.q_size + self.kv_size].view(
                tokens, heads + self.num_kv_heads, self.head_dim
            )
            q, k = qk[:, :heads], qk[:, heads:]
        elif q_norm is not None and k_norm is not None:
            q = q_norm.forward(qkv[:, : self.q_size].view(tokens, heads, self.head_dim))
            k = k_norm.forward(
                qkv[:, self.q_size : self.q_size + self.kv_size].view(tokens, -1, self.head_dim)
            )
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        else:
            # q and k are adjacent in the fused output: rotate both heads' sets in one go
            qk = qkv[:, : self.q_size + self.kv_size].view(
                tokens, heads + self.num_kv_heads, self.head_dim
            )
            if fused is not None and not self.partial_rotary and fused.applies(qkv):
                fused.rope_(qk, *rope)  # in place in the projection's output
            else:
                qk = apply_rotary(qk, *rope)
            q, k = qk[:, :heads], qk[:, heads:]
        out = self.backend.forward(
            q, k, v, k_cache, v_cache, meta, self.scale, self.window, self.softcap
        )
        return self.o_proj.forward(out.reshape(tokens, self.q_size))


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with fused gate/up projection: SwiGLU (``silu``) or
    GeGLU with the tanh GELU (``gelu_tanh``, Gemma)."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.act = act
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.fused: FusedOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        fused = self.fused
        if fused is not None and fused.applies(gate_up):
            act = fused.silu_mul(gate_up) if self.act == "silu" else fused.gelu_tanh_mul(gate_up)
            if act is not None:
                return self.down_proj.forward(act)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        if self.act == "silu":
            return self.down_proj.forward(F.silu(gate) * up)
        return self.down_proj.forward(F.gelu(gate, approximate="tanh") * up)
