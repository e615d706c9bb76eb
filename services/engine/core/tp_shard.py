"""What one tensor-parallel rank holds of a model, and the layers that combine the ranks' parts.

Megatron's split, on the model Tandem already has (every family's code runs unchanged on a
rank; only sizes and four kinds of layers differ):

* attention: query heads split evenly by rank (``num_heads / N`` each), KV heads too
  (``num_kv_heads / N``), or, where ``N`` exceeds the KV heads, each KV head replicated on the
  ``N / num_kv_heads`` ranks whose query heads read it. The fused ``qkv_proj`` holds the rank's
  q, k and v rows (column-parallel); ``o_proj`` its heads' input columns (row-parallel: its
  partial sums are all-reduced, :class:`RowParallelLinear`). Each rank's paged KV pool holds its
  KV heads only.
* the dense gated MLP: ``gate_up_proj`` the rank's ``intermediate / N`` gate rows and the same
  up rows (column-parallel), ``down_proj`` those columns (row-parallel, one all-reduce).
* the embedding: vocab-parallel (:class:`VocabParallelEmbedding`): each rank a run of
  ``ceil(vocab / N)`` rows (the last run padded with zero rows), a token outside the rank's run
  looks up zeros, and one all-reduce sums the ranks' lookups.
* the LM head: vocab-parallel too (:class:`VocabParallelHead`), tied to the embedding's shard
  where the checkpoint ties them; the ranks' logits are all-gathered and the padding cut off.
* norms, rope tables, the router and the MoE experts: replicated. **Qwen3-MoE runs its experts
  replicated on every rank** (attention split as above): each rank computes the whole MoE block on
  the same (all-reduced) input, so no collective is needed there and the result is the same on
  every rank; it costs each rank the experts' memory. Splitting experts by rank (expert
  parallelism) is not done yet.

The weights are split as they stream from the checkpoint (:meth:`RankShard.shard_weights`, under
Hugging Face names, Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` split into their parts first),
so a rank never holds more than its shard plus one tensor. Quantized weights (a GGUF's blocks as
stored, or float ones quantized to Q8_0 at load) split the same way, on block boundaries:
column-parallel ones by output rows (whole rows: every block stays intact), row-parallel ones by
input columns (:meth:`QuantizedWeight.columns`), which must start and end on the format's blocks —
32 values, 256 for the K formats — or the width is refused naming the weight. Split on a block
boundary, a rank's blocks are bit for bit the unsplit weight's, and so are the int8 rows of the
8-bit-activation dtypes (rounded per group of 32 inputs, the same groups at every width): only the
order in which the row-parallel partial sums are added differs from width 1 (float32 throughout).

A tensor-parallel model does not take the one-call C decode layers (they cannot all-reduce
between layers) or CUDA graphs (the plan is sent from the host each step); the per-op fused
kernels still run. Nothing here changes a width-1 model: it is built and run as before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch

from services.common.errors import InvalidArgumentError
from services.common.model_config import ModelConfig
from services.engine.core.embedding import Embedding
from services.engine.core.linear import Linear
from services.engine.core.models.base import CausalLM
from services.engine.core.models.blocks import GatedMLP
from services.engine.core.quant.quantized_weight import GROUP, QuantizedWeight
from services.engine.core.tp_group import LOGITS, TensorParallelGroup

Weight = torch.Tensor | QuantizedWeight
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


class RowParallelLinear(Linear):
    """A row-parallel linear layer: this rank's input columns; the ranks' partial outputs are
    summed by one all-reduce. (A :class:`Linear` whose class :meth:`RankShard.prepare` switched,
    so its packing and kernels are a Linear's.)"""

    tp: TensorParallelGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(Linear.forward(self, x))


class VocabParallelEmbedding(Embedding):
    """This rank's run of the vocabulary's rows (``start`` .. ``start + num_embeddings``); tokens
    outside it look up zeros, and one all-reduce sums the ranks' lookups."""

    tp: TensorParallelGroup
    start: int

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = Embedding.forward(self, local.masked_fill(outside, 0))
        return self.tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))


class VocabParallelHead(Linear):
    """This rank's run of the LM head's rows. Rank 0 (which samples) tells the followers how many
    rows to project and broadcasts them; every rank projects them onto its run and the runs are
    all-gathered, rank 0 keeping the full ``[rows, vocab]`` logits (padding cut off)."""

    tp: TensorParallelGroup
    vocab: int

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        hidden = hidden.contiguous()
        if tp.rank == 0:
            tp.send(LOGITS, tuple(hidden.shape), str(hidden.dtype).removeprefix("torch."))
        tp.broadcast(hidden)
        logits = tp.all_gather_last(Linear.forward(self, hidden))
        if logits.shape[-1] != self.vocab:
            logits = logits[..., : self.vocab].contiguous()
        return logits


@dataclass(frozen=True, slots=True)
class ShardSizes:
    """The sizes of rank ``rank``'s shard of a ``world``-wide split of ``config``."""

    rank: int
    world: int
    heads: int  # query heads per rank
    kv_heads: int  # KV heads each rank holds
    kv_start: int  # the first of them
    intermediate: int  # dense MLP columns per rank
    vocab: int  # vocabulary rows per rank (the last rank's run padded)

    @classmethod
    def of(cls, config: ModelConfig, rank: int, world: int) -> ShardSizes:
        """Check that ``config`` splits ``world`` ways (InvalidArgumentError naming the flag where
        not) and say how."""
        def refuse(why: str) -> InvalidArgumentError:
            return InvalidArgumentError(
                f"--tensor-parallel-size {world} does not split this model: {why}",
                param="tensor_parallel_size",
            )

        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a group of {world}")
        heads, kv = config.num_heads, config.num_kv_heads
        if heads % world:
            raise refuse(f"{heads} attention heads are not a multiple of {world}")
        if kv >= world:
            if kv % world:
                raise refuse(f"{kv} KV heads are not a multiple of {world}")
            kv_heads, kv_start = kv // world, rank * (kv // world)
        else:  # each KV head replicated on the world / kv ranks whose query heads read it
            if world % kv:
                raise refuse(f"{world} ranks are not a multiple of the {kv} KV heads")
            kv_heads, kv_start = 1, rank // (world // kv)
        dense = config.intermediate_size
        if dense % world and any(not config.is_moe_layer(i) for i in range(config.num_layers)):
            raise refuse(f"the MLP's {dense} columns are not a multiple of {world}")
        # (an all-MoE model's dense size is unused: its experts are replicated)
        intermediate = dense // world if dense % world == 0 else dense
        return cls(rank, world, heads // world, kv_heads, kv_start, intermediate,
                   -(-config.vocab_size // world))  # fmt: skip


@dataclass(eq=False)
class RankShard:
    """How rank ``group.rank`` builds and fills its part of a model (the loader's sharding
    hook: :func:`services.engine.core.loaders.load_model`'s ``sharding``)."""

    group: TensorParallelGroup

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """The shape this rank's model is built with (its heads, KV heads, MLP columns and
        vocabulary rows); the engine keeps the whole model's config for everything else."""
        sizes = ShardSizes.of(config, self.group.rank, self.group.world)
        self._config, self._sizes = config, sizes
        return replace(
            config, num_heads=sizes.heads, num_kv_heads=sizes.kv_heads,
            intermediate_size=sizes.intermediate, vocab_size=sizes.vocab,
        )  # fmt: skip

    def prepare(self, model: CausalLM) -> None:
        """Switch the layers that combine ranks to their tensor-parallel classes (before the
        weights are loaded; parameter names and shapes stay)."""
        tp, sizes = self.group, self._sizes
        for layer in model.layers:
            _row_parallel(layer.self_attn.o_proj, tp)
            mlp = getattr(layer, "mlp", None)
            if isinstance(mlp, GatedMLP):  # a dense MLP; routed experts stay replicated
                _row_parallel(mlp.down_proj, tp)
        embed = model.embed_tokens
        embed.__class__ = VocabParallelEmbedding
        embed.tp, embed.start = tp, sizes.rank * sizes.vocab  # type: ignore[attr-defined]
        if isinstance(model.lm_head, Linear):
            head = model.lm_head
            head.__class__ = VocabParallelHead
            head.tp, head.vocab = tp, self._config.vocab_size  # type: ignore[attr-defined]

    def shard_weights(
        self, weights: Iterable[tuple[str, Weight]], *, quantize: str | None = None
    ) -> Iterator[tuple[str, Weight]]:
        """This rank's slice of each Hugging Face-named weight, as the checkpoint streams.
        ``quantize``: the loader's compact format (``q8_0`` / ``q4`` quantize float matrices to
        Q8_0 after this split, so a row-parallel slice of one must be whole 32-value groups)."""
        blocks = GROUP if quantize in ("q8_0", "q4") else 1
        for name, tensor in weights:
            yield name, self.shard_weight(name, tensor, float_block=blocks)

    def shard_weight(self, name: str, tensor: Weight, *, float_block: int = 1) -> Weight:
        """This rank's slice of one weight (replicated weights as they are). ``float_block``: the
        block a float matrix is quantized in after the split (1: it is not)."""
        config, sizes = self._config, self._sizes
        d = config.head_dim
        q_rows = (sizes.rank * sizes.heads * d, sizes.heads * d)
        kv_rows = (sizes.kv_start * d, sizes.kv_heads * d)
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            return _vocab_rows(tensor, sizes)
        match = _LAYER.match(name)
        if match is None:
            return tensor
        layer, rest = int(match.group(1)), match.group(2)
        dense = not config.is_moe_layer(layer)
        inter = (sizes.rank * sizes.intermediate, sizes.intermediate)

        def columns(start: int, count: int) -> Weight:
            return self._columns(name, tensor, start, count, float_block)

        if rest.startswith("self_attn.q_proj."):
            return _rows(tensor, *q_rows)
        if rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
            return _rows(tensor, *kv_rows)
        if rest.startswith("self_attn.qkv_proj."):  # Phi-3: q, k and v stored fused
            q, k, v = _split_rows(tensor, [config.num_heads * d, config.num_kv_heads * d,
                                           config.num_kv_heads * d])  # fmt: skip
            return _cat([_rows(q, *q_rows), _rows(k, *kv_rows), _rows(v, *kv_rows)])
        if rest == "self_attn.o_proj.weight":
            return columns(*q_rows)
        if dense and rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            return _rows(tensor, *inter)
        if dense and rest == "mlp.gate_up_proj.weight":  # Phi-3: gate and up stored fused
            gate, up = _split_rows(tensor, [config.intermediate_size] * 2)
            return _cat([_rows(gate, *inter), _rows(up, *inter)])
        if dense and rest == "mlp.down_proj.weight":
            return columns(*inter)
        return tensor

    def _columns(self, name: str, tensor: Weight, start: int, count: int,
                 float_block: int) -> Weight:  # fmt: skip
        """A row-parallel weight's input columns for this rank, refused (naming the weight and
        the flag) where they do not start and end on the weight's quantization blocks."""
        if isinstance(tensor, QuantizedWeight):
            block, what = tensor.block, f"{tensor.format} blocks"
        else:  # a float matrix quantized to Q8_0 after the split, if it is quantized whole
            quantized_whole = float_block > 1 and tensor.shape[1] % float_block == 0
            block, what = (float_block, "q8_0 groups") if quantized_whole else (1, "")
        if start % block or count % block:
            raise InvalidArgumentError(
                f"--tensor-parallel-size {self._sizes.world} does not split {name} on its "
                f"quantization blocks: each rank's {count} input columns are not a whole number "
                f"of {block}-value {what} (use another width, or --dtype float32)",
                param="tensor_parallel_size",
            )
        if isinstance(tensor, QuantizedWeight):
            return tensor.columns(start, count)
        return tensor[:, start : start + count].contiguous()


def _row_parallel(linear: Linear, tp: TensorParallelGroup) -> None:
    if linear.bias is not None:
        raise InvalidArgumentError("a row-parallel layer with a bias is not split yet",
                                   param="tensor_parallel_size")  # fmt: skip
    linear.__class__ = RowParallelLinear
    linear.tp = tp  # type: ignore[attr-defined]


def _rows(tensor: Weight, start: int, count: int) -> Weight:
    """Output rows ``start .. start + count`` (of a quantized weight: its whole rows of blocks)."""
    if isinstance(tensor, QuantizedWeight):
        return tensor.map_rows(lambda t: t[start : start + count].contiguous())
    return tensor[start : start + count].contiguous()


def _split_rows(tensor: Weight, counts: list[int]) -> list[Weight]:
    """A fused weight's parts, ``counts`` rows each."""
    if isinstance(tensor, QuantizedWeight):
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return [_rows(tensor, s, n) for s, n in zip(starts, counts, strict=True)]
    return list(tensor.split(counts))


def _cat(parts: list[Weight]) -> Weight:
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedWeight.cat(parts)  # type: ignore[arg-type]
    return torch.cat(parts)  # type: ignore[arg-type]


def _vocab_rows(tensor: Weight, sizes: ShardSizes) -> Weight:
    """Rows ``rank * vocab`` onward, ``vocab`` of them, zero-padded past the vocabulary's end (a
    quantized table's padding is all-zero blocks: zero scales, so zero values)."""
    start = sizes.rank * sizes.vocab
    rows = _rows(tensor, start, sizes.vocab)
    have = rows.shape[0]
    if have < sizes.vocab:
        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(sizes.vocab - have, *t.shape[1:])])

        rows = rows.map_rows(pad) if isinstance(rows, QuantizedWeight) else pad(rows)
    return rows
