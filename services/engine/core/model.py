"""The Llama-family transformer in plain PyTorch, reading and writing a paged KV cache.

Reads top to bottom: embedding → N × (RMSNorm → attention → residual → RMSNorm → SwiGLU →
residual) → RMSNorm → LM head. Tokens of all sequences in a step are flattened into one
``[T]`` batch (vLLM style); :class:`AttentionMetadata` tells attention which token belongs where.
Q/K/V and gate/up projections are fused into one matmul each (the loaders concatenate the
checkpoint's weights), and the per-token path calls submodules' ``forward`` directly (skipping
``nn.Module.__call__``'s hook bookkeeping): on CPU, decode time not spent streaming weights is
per-op Python overhead. For the same reason, decode-sized float32 batches on CPU run the residual
add + RMSNorm, ``silu(gate) * up`` and the rotary embedding as one fused C call each when the
native kernels are here (:mod:`services.engine.core.kernels.cpu_fused`, set by the model runner with
:meth:`LlamaForCausalLM.use_fused`); the PyTorch ops below stay the reference. Going one step
further, a decode step of up to 32 sequences whose every op has a native kernel can run all its
decoder layers as one C call (:meth:`LlamaForCausalLM.use_decode_layers`,
:mod:`services.engine.core.kernels.cpu_decode_layers`): the same kernels in the same order, so the same
bits, without ~10 Python-level calls per layer.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.core.attention import AttentionMetadata, PagedAttention, TorchPagedAttention
from services.engine.core.embedding import Embedding
from services.engine.core.kernels.autotune import KernelRegimes
from services.engine.core.kernels.cpu_decode_layers import (
    CpuDecodeLayers,
    DecodeLayersCall,
    DecodeShape,
    LayerWeights,
)
from services.engine.core.kernels.cpu_fused import DECODE_LAYER_ROWS, MAX_ROWS
from services.engine.core.kv_cache import KVPool
from services.engine.core.linear import Linear
from services.common.model_config import ModelConfig
from services.engine.core.rope import RotaryEmbedding, apply_rotary


class FusedOps(Protocol):
    """Fused element-wise ops a layer may run instead of its PyTorch ones: the CPU's C kernels
    (``cpu_fused.CpuFused``) or the GPU's Triton kernels (``gpu_fused.GpuFused``)."""

    def applies(self, x: torch.Tensor) -> bool: ...
    def add_rmsnorm(self, x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor,
                    eps: float, out_sum: torch.Tensor | None = None) -> torch.Tensor: ...
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None: ...


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


class Attention(nn.Module):
    """Grouped-query attention with fused QKV projection (optional bias, as in Qwen2)."""

    def __init__(self, config: ModelConfig, backend: PagedAttention) -> None:
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
        self.backend = backend
        self.scale = self.head_dim**-0.5
        self.fused: FusedOps | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        # q and k are adjacent in the fused output: rotate both heads' sets in one go
        qk = qkv[:, : self.q_size + self.kv_size].view(
            tokens, self.num_heads + self.num_kv_heads, self.head_dim
        )
        if self.fused is not None and self.fused.applies(qkv):
            self.fused.rope_(qk, *rope)  # in place in the projection's output
        else:
            qk = apply_rotary(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj.forward(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.fused: FusedOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if self.fused is not None and self.fused.applies(gate_up):
            return self.down_proj.forward(self.fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: PagedAttention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.fused: FusedOps | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        fused = self.fused
        if fused is not None and fused.applies(x):
            norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
            h = self.self_attn.forward(
                fused.add_rmsnorm(x, None, norm1.weight, norm1.eps), rope, k_cache, v_cache, meta
            )
            residual = torch.empty_like(x)  # x + h, written by the fused norm
            h = self.mlp.forward(fused.add_rmsnorm(x, h, norm2.weight, norm2.eps, residual))
            return residual.add_(h)
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), rope, k_cache, v_cache, meta)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / SmolLM2 / Qwen2 causal LM over a paged KV cache."""

    def __init__(self, config: ModelConfig, backend: PagedAttention | None = None) -> None:
        super().__init__()
        self.config = config
        backend = backend or TorchPagedAttention()
        self.rope = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.decode_layers: DecodeLayersCall | None = None
        self.decode_layers_rows = 0  # decode batches of up to this many sequences may use it
        # per batch size, whether the one-call layers beat the per-op path (the runner measures)
        self.decode_layers_regimes = KernelRegimes(
            rows=DECODE_LAYER_ROWS, use_kernel=(True,) * len(DECODE_LAYER_ROWS)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run ``[T]`` flattened tokens; return final hidden states ``[T, hidden]``."""
        x = self.embed_tokens(input_ids)
        rope = self.rope.lookup(positions, x.dtype)
        rows = x.shape[0]
        call = self.decode_layers
        if (
            call is not None
            and not meta.is_prefill
            and rows <= self.decode_layers_rows
            and self.decode_layers_regimes.kernel_for(rows)
        ):
            if call.caches_of is not kv:
                call.set_caches([kv.layer(i) for i in range(len(self.layers))], kv)
            x = call(
                x.contiguous(), rope[0].view(rows, -1), rope[1].view(rows, -1), meta.block_tables,
                meta.decode_context_lens(), meta.slot_blocks, meta.slot_offsets,
            )  # fmt: skip
            return self.norm(x)
        for index, layer in enumerate(self.layers):
            k_cache, v_cache = kv.layer(index)
            x = layer.forward(x, rope, k_cache, v_cache, meta)
        return self.norm(x)

    def use_fused(self, fused: FusedOps | None) -> None:
        """Run the batches ``fused.applies`` to through ``fused`` ops: the CPU's for
        decode-sized float32 ones, the GPU's for all (``None``: PyTorch ops only, which also
        turns the one-call decode layers off: they compute the fused ops)."""
        for layer in self.layers:
            layer.fused = layer.self_attn.fused = layer.mlp.fused = fused
        if fused is None:
            self.use_decode_layers(None)

    def use_decode_layers(self, kernel: CpuDecodeLayers | None) -> int:
        """Run float32 decode steps of up to N sequences through ``kernel``, all layers in one
        call, where every op of a layer has chosen its native kernel for that batch size (the
        fused ops too: :meth:`use_fused` first). Returns N (0: never; ``None`` turns it off)."""
        self.decode_layers, self.decode_layers_rows = None, 0
        if kernel is None or not self.layers:
            return 0
        rows = 0
        while rows < MAX_ROWS and all(_all_native(layer, rows + 1) for layer in self.layers):
            rows += 1
        if not rows:
            return 0
        weights = [_layer_weights(layer) for layer in self.layers]
        config = self.config
        shape = DecodeShape(
            hidden=config.hidden_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, intermediate=config.intermediate_size,
            eps=self.layers[0].input_layernorm.eps, scale=self.layers[0].self_attn.scale,
        )  # fmt: skip
        self.decode_layers, self.decode_layers_rows = kernel.bind(shape, weights), rows
        return rows

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project selected hidden states ``[N, hidden]`` to float32 logits ``[N, vocab]``."""
        return self.lm_head(hidden).float()


def _all_native(layer: DecoderLayer, rows: int) -> bool:
    """Whether every op of ``layer`` runs its native kernel for ``rows`` rows."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    return (
        layer.fused is not None and attn.fused is not None and mlp.fused is not None
        and rows <= MAX_ROWS and attn.backend.native_decode(rows)
        and all(linear.kernel_tiles(rows) is not None for linear in linears)
        and all(norm.dtype == torch.float32 for norm in norms)
    )  # fmt: skip


def _layer_weights(layer: DecoderLayer) -> LayerWeights:
    """What the one-call decode layers read of ``layer`` (checked by :func:`_all_native`)."""
    attn, mlp = layer.self_attn, layer.mlp
    tiles = [linear.kernel_tiles(1) for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                   mlp.down_proj)]  # fmt: skip
    qkv, o, gate_up, down = (t for t in tiles if t is not None)
    norms = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach())
    return LayerWeights(norms[0].contiguous(), norms[1].contiguous(), qkv, o, gate_up, down)
