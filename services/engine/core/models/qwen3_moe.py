"""Qwen3-MoE (e.g. Qwen3-30B-A3B): Qwen3's attention, and in place of the dense MLP a router
over ``num_experts`` SwiGLU experts of which each token takes the top ``num_experts_per_tok``.

Routing as Hugging Face does it: softmax over all experts' logits in float32, the top k kept
and (``norm_topk_prob``) renormalised to sum to one; each expert runs on just the rows routed to
it and adds its output, weighted, into the token's. Every expert is a
:class:`~services.engine.core.models.blocks.GatedMLP` of two :class:`~services.engine.core.linear.Linear`,
so quantized checkpoints run the experts' matmuls on the same CPU kernels as dense layers, and a
decode step reads only the chosen experts' weights: about 3B of Qwen3-30B-A3B's 30B parameters.
The router stays in float32 (a plain parameter, never quantized): a rounded router picks other
experts. On CPU its logits come from the native float32 kernel (its tiles built on first use),
which computes each row alone: PyTorch's GEMM does not give a row the same bits in every batch
size, and a last-bit change in a router logit can pick another expert. A token's experts' outputs
are summed in expert order on both the one-row and the grouped path, for the same reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.common.model_config import ModelConfig
from services.engine.core.attention import PagedAttention
from services.engine.core.kernels.cpu_gemv import load_cpu_gemv
from services.engine.core.models.base import CausalLM, DecoderLayer
from services.engine.core.models.blocks import GatedMLP
from services.engine.core.models.llama import LlamaDecoderLayer


class Router(nn.Module):
    """``weight`` ``[experts, hidden]``: each token's logits over the experts."""

    def __init__(self, experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self._tiles: torch.Tensor | None = None
        self._tiles_of: tuple[int, int] = (0, -1)  # (data_ptr, version) of the weight tiled

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T``: each row computed alone by the native kernel where it runs (CPU,
        float32), else PyTorch's ``F.linear``."""
        kernel = load_cpu_gemv() if x.device.type == "cpu" and x.dtype == torch.float32 else None
        if kernel is None or self.weight.dtype != torch.float32 or x.dim() != 2:
            return F.linear(x, self.weight.to(x.dtype))
        key = (self.weight.data_ptr(), self.weight._version)
        if self._tiles is None or self._tiles_of != key:
            self._tiles, self._tiles_of = kernel.tile_weight(self.weight.detach()), key
        return kernel(x.contiguous(), self._tiles, None, self.weight.shape[0])


class SparseMoeBlock(nn.Module):
    """Top-k routed SwiGLU experts (no shared expert: Qwen3's design)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.gate = Router(config.num_experts, config.hidden_size)
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, config.moe_intermediate_size, config.hidden_act)
            for _ in range(config.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate.logits(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # decode of one sequence: no grouping to do; the experts' outputs
            # summed in expert order, as the grouped path below sums every token's
            picks = sorted((expert, slot) for slot, expert in enumerate(chosen[0].tolist()))
            for expert, slot in picks:
                out += self.experts[expert].forward(x) * weights[0, slot]
            return out
        order = chosen.flatten().argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start : start + count]
            start += count
            tokens, slots = pairs // self.top_k, pairs % self.top_k
            y = self.experts[expert].forward(x[tokens]) * weights[tokens, slots, None]
            out.index_add_(0, tokens, y)
        return out


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE: Llama-shaped layers whose MLP is :class:`SparseMoeBlock` where
    ``config.is_moe_layer`` says so (every layer, in the released models)."""

    def make_layer(self, config: ModelConfig, backend: PagedAttention, index: int) -> DecoderLayer:
        mlp = SparseMoeBlock(config) if config.is_moe_layer(index) else None
        return LlamaDecoderLayer(config, backend, index, mlp)

    def graph_safe(self) -> bool:
        """No: each step reads the chosen experts' ids on the host (``tolist``) to run only their
        weights, which a CUDA graph cannot capture; MoE decode steps run eagerly."""
        return False
