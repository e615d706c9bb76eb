"""Owns the device side of a step: builds the flattened batch, runs the model over the paged KV
pool, and samples the sequences that reached their end.

The scheduler decides *what* runs; this file decides *how*: token ids and positions for every
scheduled slice, one :class:`AttentionMetadata` shared by all layers, logits only for the last
token of each sampled sequence. On CPU it first lays the weights out for the native kernels and
has each matmul kernel prove itself against PyTorch on this model's shapes
(``linear.pack_linears``), then times decode steps with every layer in one C call against the
per-op path (:meth:`ModelRunner._tune_decode_layers`) and keeps the faster per batch size. Every
choice it makes on CPU is among paths that give a row the same bits (a token's numbers never
depend on its step, its batch or whether it is a prompt token: see ``linear.py``). On
CUDA, decode steps replay captured graphs (:mod:`services.engine.core.cuda_graphs`) when the
engine asks for them (:meth:`ModelRunner.capture_decode_graphs`).

A tensor-parallel rank 0 (``loaded.sharding``) first hands each step's plan (token ids,
positions, lengths, block tables) to its followers, which run the same forward on their shards
(``tp_follower.py``); such a model takes neither the one-call C decode layers nor CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.core.attention import AttentionMetadata
from services.engine.core.cuda_graphs import DecodeGraphs
from services.engine.core.kernels.autotune import KernelRegimes, choose_regimes
from services.engine.core.kernels.cpu_decode_layers import load_cpu_decode_layers
from services.engine.core.kernels.cpu_fused import DECODE_LAYER_ROWS, load_cpu_fused
from services.engine.core.kernels.cpu_qgemv import load_cpu_qgemv
from services.engine.core.kernels.huge_pages import return_free_heap
from services.engine.core.kv_cache import KVPool
from services.engine.core.linear import pack_linears, pack_plan
from services.engine.core.loaders import LoadedModel
from services.engine.core.models import CausalLM
from services.engine.core.prompt_logprobs import PromptRows, rows_to_score, score_rows
from services.engine.core.sampler import Sampler, SamplerOutput
from services.engine.core.scheduler import ScheduledBatch
from services.engine.core.sequence import Sequence
from services.engine.core.step_phases import StepPhases
from services.engine.core.tp_group import POOL, STEP, TensorParallelGroup


@dataclass(frozen=True, slots=True)
class StepResult:
    """What :meth:`ModelRunner.execute` produced: a token per sampled sequence (None when no
    sequence reached its end), and the logits of every draft position of the speculating ones,
    in the batch's order (``[total drafts, vocab]``; None without drafts), for the engine to
    verify (``speculative.py``)."""

    sampled: SamplerOutput | None
    draft_logits: torch.Tensor | None = None


class ModelRunner:
    """Runs scheduled batches of a loaded model against a KV pool."""

    def __init__(
        self, loaded: LoadedModel, kv: KVPool, sampler: Sampler, phases: StepPhases | None = None
    ) -> None:
        self.model = loaded.model
        self.config = loaded.config
        self.kv = kv
        self.sampler = sampler
        self.phases = phases or StepPhases()  # on a GPU "forward" is the launch, "sample" syncs
        self.block_size = kv.layout.block_size
        self.device = next(self.model.parameters()).device
        self.graphs: DecodeGraphs | None = None
        # rank 0 of a tensor-parallel group: hands every step's plan to the followers
        self.tp: TensorParallelGroup | None = None
        if loaded.sharding is not None and loaded.sharding.group.rank == 0:
            self.tp = loaded.sharding.group
            self.tp.send(POOL, kv.num_blocks, kv.layout)
        plan = pack_plan(self.device, loaded.dtype, int8_activations=loaded.int8_activations,
                         int8_decode=loaded.int8_decode)  # fmt: skip
        if plan is not None:
            pack_linears(self.model, plan, free_dense=True)
            fused = load_cpu_fused()
            self.model.use_fused(fused)
            if fused is not None:
                sampler.use_argmax(fused.argmax)
            _embedding_from_tiles(self.model, sharded=loaded.sharding is not None)
            # the one-call layers cannot all-reduce between layers: per op at tensor-parallel
            rows = 0 if loaded.sharding else self.model.use_decode_layers(load_cpu_decode_layers())
            if rows and plan.autotune:
                self._tune_decode_layers(rows)
            return_free_heap()  # the packing's freed scratch and originals, out of the RSS
        elif self.device.type == "cuda" and _graph_safe(self.model):
            from services.engine.core.kernels.gpu_fused import load_gpu_fused

            self.model.use_fused(load_gpu_fused())

    MAX_GRAPH_TOKENS = 32768
    """Longest context a captured decode step covers (its block tables are this wide; a longer
    sequence's steps run eagerly)."""

    def capture_decode_graphs(self, *, max_batch: int, max_blocks: int, scratch_block: int) -> bool:
        """Capture decode steps of up to ``max_batch`` sequences as CUDA graphs, their padding
        rows writing to ``scratch_block`` (a pool block the block manager never hands out).
        False (eager decode) when the attention backend reads host values in decode."""
        if self.device.type != "cuda" or not _graph_safe(self.model) or self.tp is not None:
            return False
        width = min(max_blocks, -(-self.MAX_GRAPH_TOKENS // self.block_size))
        self.graphs = DecodeGraphs(self.model, self.kv, max_batch=max_batch, max_blocks=width,
                                   scratch_block=scratch_block)  # fmt: skip
        self.graphs.capture()
        return True

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Compute every scheduled slice; sample rows whose sequence reached its end (a
        speculating sequence's first position; its drafts' logits come back unsampled).

        A speculating sequence's last token and its ``d`` drafts run as ``d + 1`` decode rows of
        its own table, at consecutive positions, each attending to the context up to itself: what
        ``d + 1`` one-token steps would compute, in one pass (the K/V of a layer's rows are stored
        before any of them attends), so a batch of decodes and drafts stays a decode batch (the
        one-call C layers on CPU, the captured graphs on CUDA)."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        draft_rows: list[int] = []  # every draft position's row, item by item
        prompt_counts: list[int] = []
        to_score: list[PromptRows] = []  # prompt_logprobs.py
        for item in batch.items:
            seq, start, drafts = item.seq, item.seq.num_computed_tokens, item.num_draft_tokens
            n = item.num_new_tokens - drafts
            prompt_counts.append(max(0, min(n, len(seq.prompt_token_ids) - start)))
            scored = rows_to_score(seq, start, n, len(input_ids))
            if scored is not None:
                to_score.append(scored)
            input_ids.extend(token_slice(seq, start, start + n))
            positions.extend(range(start, start + n))
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(seq.block_ids)
            if item.sample:
                sample_rows.append(len(input_ids) - 1)
            for offset, token in enumerate(seq.draft_token_ids[:drafts], start=start + n):
                draft_rows.append(len(input_ids))
                input_ids.append(token)
                positions.append(offset)
                query_lens.append(1)
                context_lens.append(offset + 1)
                tables.append(seq.block_ids)
                prompt_counts.append(0)
        phases = self.phases
        hidden = None
        if batch.is_decode and self.graphs is not None:
            hidden = self.graphs.run(input_ids, positions, tables)
            if hidden is not None:
                phases.lap("forward")  # a replay's inputs are copied inside the graph's run
        if hidden is None:
            if self.tp is not None:
                self.tp.send(STEP, not batch.is_decode, input_ids, positions, query_lens,
                             context_lens, tables, prompt_counts)  # fmt: skip
            meta = AttentionMetadata.build(
                is_prefill=not batch.is_decode,
                query_lens=query_lens,
                context_lens=context_lens,
                block_tables=tables,
                block_size=self.block_size,
                device=self.device,
                prompt_counts=prompt_counts,
            )
            ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            phases.lap("inputs")
            hidden = self.model(ids, pos, self.kv, meta)
        if to_score:
            score_rows(hidden, to_score, self.model.compute_logits, self.sampler.vocab_size)
        if not sample_rows:
            phases.lap("forward")
            return StepResult(None)
        rows = sample_rows + draft_rows
        if len(rows) < hidden.shape[0] or draft_rows:
            hidden = hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(hidden)
        phases.lap("forward")
        states = [item.seq.sampling for item in batch.items if item.sample]
        sampled = self.sampler(logits[: len(sample_rows)], states)
        phases.lap("sample")
        return StepResult(sampled, logits[len(sample_rows) :] if draft_rows else None)

    TUNE_CONTEXT = 128  # tokens each timed sequence attends to
    # The one call and the per-op path run the same kernels (same bits); the one call only saves
    # Python dispatch, so it cannot be badly slower the way a kernel against PyTorch's BLAS can,
    # and a smaller win than autotune's default margin is still a win (a batch-32 step measured
    # 1.10x, which that margin sent to the per-op path).
    DECODE_LAYERS_MARGIN = 0.03

    def _tune_decode_layers(self, max_rows: int) -> None:
        """Time decode steps of 1, 8 and ``max_rows`` sequences (as far as ``max_rows``) with all
        layers in one C call against the per-op path (same kernels, same bits) and keep, per
        batch size, the faster; cached per build and model shape like every kernel decision. The
        timed steps write K/V into free blocks of the still-empty pool, which are zeroed again
        afterwards."""
        model, call = self.model, self.model.decode_layers
        batches = sorted({rows for rows in DECODE_LAYER_ROWS if rows < max_rows} | {max_rows})
        # a small pool gets shorter timed contexts (block 0 is left alone)
        per_seq = min(-(-self.TUNE_CONTEXT // self.block_size), (self.kv.num_blocks - 1) // max_rows)
        context, used = min(self.TUNE_CONTEXT, per_seq * self.block_size), per_seq * max_rows
        if call is None or per_seq < 1:
            return  # no room to measure: keep the default (one call everywhere)
        metas = {
            b: AttentionMetadata.build(
                is_prefill=False, query_lens=[1] * b, context_lens=[context] * b,
                block_tables=[[1 + i * per_seq + j for j in range(per_seq)] for i in range(b)],
                block_size=self.block_size, device=self.device,
            )  # fmt: skip
            for b in batches
        }
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(self.config.vocab_size, (max_rows,), generator=generator)
        positions = torch.full((max_rows,), context - 1, dtype=torch.long)
        on = KernelRegimes(rows=DECODE_LAYER_ROWS, use_kernel=(True,) * len(DECODE_LAYER_ROWS))
        off = KernelRegimes(rows=DECODE_LAYER_ROWS, use_kernel=(False,) * len(DECODE_LAYER_ROWS))

        def runner(native: bool):  # type: ignore[no-untyped-def]
            def run(batch: int) -> None:
                model.decode_layers_regimes = on if native else off
                with torch.inference_mode():
                    model(ids[:batch], positions[:batch], self.kv, metas[batch])

            return run

        config = self.config
        formats = "/".join(sorted({t.format for t in call.tiles()}))
        try:
            regimes = choose_regimes(
                f"decode-layers ({formats})", isa=call.isa, build=call.build,
                shapes=[(config.num_layers, config.hidden_size, config.num_heads,
                         config.num_kv_heads, config.head_dim, config.intermediate_size)],
                run_kernel=runner(True), run_torch=runner(False), rows=batches,
                margin=self.DECODE_LAYERS_MARGIN, fixed=True,  # untimed: one call everywhere
            )  # fmt: skip
        finally:
            with torch.inference_mode():
                self.kv.data[1 : used + 1].zero_()
        model.decode_layers_regimes = regimes


def _graph_safe(model: CausalLM) -> bool:
    """Whether the model's attention decodes from tensors alone (``graph_safe``: the Triton
    backend), so its steps can be captured, and the fused Triton ops run with it."""
    backend = model.layers[0].self_attn.backend if model.layers else None
    graph_safe = getattr(backend, "graph_safe", None)
    return graph_safe is not None and graph_safe() and model.graph_safe()


def _embedding_from_tiles(model: CausalLM, sharded: bool) -> None:
    """A quantized embedding table is looked up by the C kernel from tiles: a tied one reads the
    head's (the table held once), an untied one its own, tiled here (not at tensor parallelism,
    whose ranks split the vocabulary)."""
    embed, head = model.embed_tokens, model.lm_head
    if embed.quant is None:
        return
    if model.config.tie_word_embeddings:
        if head.has_quantized_tiles:
            embed.read_from(head.gather_rows)
        return
    kernel = load_cpu_qgemv()
    if kernel is not None and not sharded:
        embed.read_tiles(kernel)


def token_slice(seq: Sequence, start: int, end: int) -> list[int]:
    """``seq.all_token_ids()[start:end]`` without concatenating the whole history."""
    prompt = seq.prompt_token_ids
    if end <= len(prompt):
        return prompt[start:end]
    output = seq.output_token_ids
    if start >= len(prompt):
        return output[start - len(prompt) : end - len(prompt)]
    return prompt[start:] + output[: end - len(prompt)]
