"""What every family's causal LM shares: the embedding, the rotary tables, the stack of decoder
layers over a paged KV cache, the final norm and the LM head, and the switches of the CPU and
GPU fast paths.

Tokens of all sequences in a step are flattened into one ``[T]`` batch (vLLM style);
:class:`~services.engine.core.attention.AttentionMetadata` tells attention which token belongs
where. A family subclass says how one decoder layer is built (:meth:`CausalLM.make_layer`) and
what it adds around the stack (Gemma's embedding scale, Gemma 2's final soft-cap).

Fast paths: decode-sized float32 batches on CPU run the residual add + RMSNorm (Gemma's ``1 + w``
folded into the weight), ``silu(gate) * up`` or GeGLU, the rotary embedding and the per-head q/k
norms as one fused C call each (:meth:`CausalLM.use_fused`), and the final norm too on every CPU
float32 batch (:meth:`CausalLM.final_norm`); a decode step of up to 32 sequences
whose every layer the C step computes (:meth:`DecoderLayer.one_call_norms`: Llama's, Qwen3's,
Gemma 2/3's) and every op has a native kernel runs all layers as one C call
(:meth:`CausalLM.use_decode_layers`): the same kernels in the same order, so the same bits.
:meth:`CausalLM.fast_path_gaps` says which of them a family does not take yet, for the worker's
start-up line.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from services.common.errors import FailedPreconditionError
from services.common.model_config import ModelConfig
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
from services.engine.core.models.blocks import Attention, FusedOps, GatedMLP, RMSNorm, Rope, make_norm
from services.engine.core.rope import RotaryEmbedding

# a layer's norms as the one-call decode layers take them (DecoderLayer.one_call_norms)
LayerNorms = tuple[RMSNorm, RMSNorm, RMSNorm | None, RMSNorm | None]


class DecoderLayer(nn.Module, ABC):
    """One layer: ``forward(x, rope, k_cache, v_cache, meta) -> x``. Families subclass it."""

    self_attn: Attention
    fused: FusedOps | None = None

    @abstractmethod
    def forward(
        self, x: torch.Tensor, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """Run the layer over the step's flattened tokens ``x`` ``[T, hidden]``."""

    def one_call_norms(self) -> LayerNorms | None:
        """The layer's norms in the one-call C decode layers' order — before attention, before the
        MLP, on attention's output and on the MLP's output (Gemma's; ``None``: not there) — or
        ``None`` where that C step can't compute the layer (its attention and MLP are checked
        apart: :func:`_one_call_shape`)."""
        return None


class NoLMHead(nn.Module):
    """The LM head of a base checkpoint that stores none (``ModelConfig.has_lm_head`` false): the
    model computes hidden states (embeddings) only."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise FailedPreconditionError(
            "this model is a base checkpoint without an LM head: it serves embeddings only",
            code="no_lm_head",
        )


class CausalLM(nn.Module, ABC):
    """A decoder-only causal LM over a paged KV cache; families subclass :meth:`make_layer`."""

    def __init__(self, config: ModelConfig, backend: PagedAttention | None = None) -> None:
        super().__init__()
        self.config = config
        backend = backend or TorchPagedAttention()
        self.rope = RotaryEmbedding(
            config.rotary_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling,
        )  # fmt: skip
        # sliding layers with their own rope base (Gemma 3: 10k local, 1M global)
        self.local_rope = (
            RotaryEmbedding(config.rotary_dim, config.max_position_embeddings,
                            config.local_rope_theta, None)
            if config.local_rope_theta is not None and config.local_rope_theta != config.rope_theta
            else None
        )  # fmt: skip
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
        self.layers = nn.ModuleList(
            self.make_layer(config, backend, i) for i in range(config.num_layers)
        )
        self.norm: RMSNorm = make_norm(config, config.hidden_size)
        # a base checkpoint without a tied head (an embedding model) has none: no vocab-sized
        # matrix is allocated, and asking for logits is an error (NoLMHead)
        self.lm_head: Linear | NoLMHead = (
            Linear(config.hidden_size, config.vocab_size, bias=False)
            if config.has_lm_head else NoLMHead()
        )  # fmt: skip
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.decode_layers: DecodeLayersCall | None = None
        self.decode_layers_rows = 0  # decode batches of up to this many sequences may use it
        # per batch size, whether the one-call layers beat the per-op path (the runner measures)
        self.decode_layers_regimes = KernelRegimes(
            rows=DECODE_LAYER_ROWS, use_kernel=(True,) * len(DECODE_LAYER_ROWS)
        )

    @abstractmethod
    def make_layer(self, config: ModelConfig, backend: PagedAttention, index: int) -> DecoderLayer:
        """Layer ``index`` of the family's stack."""

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        """Every rope table of the model (the loader computes them after building on ``meta``)."""
        return [self.rope] + ([self.local_rope] if self.local_rope is not None else [])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run ``[T]`` flattened tokens; return final hidden states ``[T, hidden]``."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # as Hugging Face: the scale rounded to the dtype
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
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
            # the rotary rows and the final norm are the C step's too (no PyTorch op per step)
            norm = self.final_norm_kernel(x)
            local = self.local_rope
            return call(
                x.contiguous(), positions, (self.rope.cos, self.rope.sin), meta.block_tables,
                meta.decode_context_lens(), meta.slot_blocks, meta.slot_offsets,
                (local.cos, local.sin) if local is not None else None,
                (norm, self.norm.eps) if norm is not None else None,
            )  # fmt: skip
        rope = self.rope.lookup(positions, x.dtype)
        local = self.local_rope.lookup(positions, x.dtype) if self.local_rope is not None else rope
        for index, layer in enumerate(self.layers):
            k_cache, v_cache = kv.layer(index)
            layer_rope = local if layer.self_attn.window is not None else rope
            x = layer.forward(x, layer_rope, k_cache, v_cache, meta)
        return self.final_norm(x)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The norm after the last layer: on CPU the fused C kernel where the layers use it (one
        call instead of PyTorch's six small ops, each slow in a decode step that has just streamed
        the weights through the caches), else PyTorch's. Every path — prefill, decode, the
        one-call layers (:meth:`final_norm_kernel`) — takes the same one, so a position's bits
        never depend on the path."""
        fused = self._final_norm_fused(x)
        if fused is not None:
            return fused.add_rmsnorm(x, None, self.norm.kernel_weight(), self.norm.eps)
        return self.norm.forward(x)

    def final_norm_kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        """The final norm's weights as the fused CPU kernel multiplies by, where it runs for
        ``x``'s batch; ``None`` where PyTorch's norm does."""
        return self.norm.kernel_weight() if self._final_norm_fused(x) is not None else None

    def _final_norm_fused(self, x: torch.Tensor) -> FusedOps | None:
        """The CPU fused ops the final norm runs on for ``x``, or ``None`` (PyTorch's norm)."""
        fused = self.layers[0].fused if len(self.layers) else None
        return fused if fused is not None and x.device.type == "cpu" and fused.applies(x) else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project selected hidden states ``[N, hidden]`` to float32 logits ``[N, vocab]``."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def use_fused(self, fused: FusedOps | None) -> None:
        """Run the batches ``fused.applies`` to through ``fused`` ops: the CPU's for
        decode-sized float32 ones, the GPU's for all (``None``: PyTorch ops only, which also
        turns the one-call decode layers off: they compute the fused ops). Each block takes the
        ops it has a use for."""
        for module in self.modules():
            if hasattr(module, "fused"):
                module.fused = fused  # type: ignore[assignment]
        if fused is None:
            self.use_decode_layers(None)

    def use_decode_layers(self, kernel: CpuDecodeLayers | None) -> int:
        """Run float32 decode steps of up to N sequences through ``kernel``, all layers in one
        call, where the C step computes every layer (:func:`_one_call_shape`) and every op of it
        has chosen its native kernel for that batch size (the fused ops too: :meth:`use_fused`
        first). Returns N (0: never; ``None`` turns it off). The embedding scale (Gemma) is
        applied before the call, the final soft-cap (Gemma 2) after it."""
        self.decode_layers, self.decode_layers_rows = None, 0
        if kernel is None or not self.layers or not self.one_call_shape():
            return 0
        rows = 0
        while rows < MAX_ROWS and all(_all_native(layer, rows + 1) for layer in self.layers):
            rows += 1
        if not rows:
            return 0
        weights = [_layer_weights(layer, self.local_rope is not None) for layer in self.layers]
        config = self.config
        first = self.layers[0]
        shape = DecodeShape(
            hidden=config.hidden_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, intermediate=config.intermediate_size,
            eps=_norms(first)[0].eps, act=config.hidden_act,
        )  # fmt: skip
        self.decode_layers, self.decode_layers_rows = kernel.bind(shape, weights), rows
        return rows

    def graph_safe(self) -> bool:
        """Whether a decode step is tensors alone (no per-step Python masks), so CUDA graphs can
        capture it. Dense families' are: sliding windows and soft-caps are per-layer constants the
        Triton decode kernel takes as arguments (the backend says whether it is graph-safe); a
        family whose step reads values on the host overrides this."""
        return True

    def one_call_shape(self) -> bool:
        """Whether the one-call C decode layers compute every layer of this model (whatever the
        kernels chose): Llama / Mistral / Qwen2, Qwen3, Gemma 2 / 3 do; routed experts (Qwen3-MoE)
        and partial rotation (Phi-4-mini) don't yet."""
        if not all(_one_call_shape(layer) for layer in self.layers):
            return False
        eps = {norm.eps for layer in self.layers for norm in _norms(layer)}  # one eps in the C step
        return len(eps) == 1 and self.config.hidden_act in ("silu", "gelu_tanh")

    def fast_path_gaps(self) -> list[str]:
        """The fast paths this model does not take yet on its device, in words (empty for Llama,
        Qwen3 and Gemma 2/3 on CPU)."""
        gaps = []
        if not self.one_call_shape():
            gaps.append("the one-call C decode layers (no routed experts or partial rotation)")
        if not self.graph_safe():
            gaps.append("CUDA graphs (a decode step reads values on the host)")
        on_gpu = self.embed_tokens.weight.device.type == "cuda"
        if on_gpu and any(layer.self_attn.q_norm is not None for layer in self.layers):
            gaps.append("the fused rope (q/k norms rotate in PyTorch on GPU)")
        if on_gpu and self.config.hidden_act != "silu":
            gaps.append("the fused GeGLU (PyTorch on GPU)")
        return gaps


def _one_call_shape(layer: DecoderLayer) -> bool:
    """Whether the one-call C step computes ``layer``: norms it knows, a gated MLP, attention
    with full rotation and q and k norms together or neither."""
    attn, mlp = layer.self_attn, getattr(layer, "mlp", None)
    return (
        layer.one_call_norms() is not None and isinstance(mlp, GatedMLP)
        and not attn.partial_rotary and (attn.q_norm is None) == (attn.k_norm is None)
    )  # fmt: skip


def _all_native(layer: DecoderLayer, rows: int) -> bool:
    """Whether every op of ``layer`` (:func:`_one_call_shape`) runs its native kernel for ``rows``
    rows."""
    attn, mlp = layer.self_attn, layer.mlp
    assert isinstance(mlp, GatedMLP)
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return (
        layer.fused is not None and attn.fused is not None and mlp.fused is not None
        and rows <= MAX_ROWS and attn.backend.native_decode(rows)
        and all(linear.kernel_tiles(rows) is not None for linear in linears)
        and all(norm.kernel_weight().dtype == torch.float32 for norm in _norms(layer))
    )  # fmt: skip


def _norms(layer: DecoderLayer) -> list[RMSNorm]:
    """Every norm of a layer the one-call step computes, the q/k head norms included."""
    attn = layer.self_attn
    found = [*(layer.one_call_norms() or ()), attn.q_norm, attn.k_norm]
    return [norm for norm in found if norm is not None]


def _layer_weights(layer: DecoderLayer, local_rope: bool) -> LayerWeights:
    """What the one-call decode layers read of ``layer`` (checked by :func:`_all_native`);
    ``local_rope``: the model has local rope tables for its sliding layers."""
    attn, mlp = layer.self_attn, layer.mlp
    tiles = [linear.kernel_tiles(1) for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                   mlp.down_proj)]  # fmt: skip
    qkv, o, gate_up, down = (t for t in tiles if t is not None)  # one entry per part
    norms = layer.one_call_norms()
    assert norms is not None

    def weight(norm: RMSNorm | None) -> torch.Tensor | None:
        return None if norm is None else norm.kernel_weight().detach().contiguous()

    first, before_mlp, attn_out, mlp_out = (weight(n) for n in norms)
    assert first is not None and before_mlp is not None
    return LayerWeights(
        first, before_mlp, qkv, o, gate_up, down, scale=attn.scale, attn_out_norm=attn_out,
        mlp_out_norm=mlp_out, q_norm=weight(attn.q_norm), k_norm=weight(attn.k_norm),
        window=attn.window, local_rope=local_rope and attn.window is not None,
        softcap=attn.softcap,
    )  # fmt: skip
