"""The engine loop: ``step()`` = schedule, run the model, post-process.

Requests enter with token ids and :class:`SamplingParams`; each step returns per-request deltas
(new token ids, logprobs, finish reason). The engine knows no text: EOS, stop token ids and
length limits end a request here; detokenization and stop strings are an :class:`OutputFilter`
the worker runtime applies to outputs as they leave (``services.engine.runtime.output_text``).
Three entry points cover the disaggregated pipeline:

  1. :meth:`LLMEngine.add_request` — normal request; the engine prefills and decodes it.
  2. ``add_request(..., prefill_only=True)`` — a prefill worker: the sequence finishes right
     after its first token with reason ``"prefilled"`` and its blocks are *kept*; the caller
     ships them and later calls :meth:`LLMEngine.release_blocks`.
  3. :meth:`LLMEngine.add_prefilled` — a decode worker: KV already sits in blocks the caller
     allocated (see :attr:`LLMEngine.block_manager`); the sequence joins the running batch.

The engine is single-threaded; services drive it from one thread and post work through queues.
Its grammar matchers are owned by that thread and lent to the sampler's mask helper only within
a step, joined before the step returns (``grammar.py`` says who owns what, when).

An error that belongs to one request (its grammar's matcher failing, sampling its row, its output's
post-processing) ends that request alone: its output carries the error (:attr:`RequestOutput.error`, finish reason
``"error"``) and the step goes on for the others. Only a failure of the step itself (the forward
pass, the KV) propagates out of :meth:`LLMEngine.step`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.common.errors import InvalidArgumentError, TandemError
from services.common.sampling_params import SamplingParams
from services.engine.core.block_manager import BlockManager
from services.engine.core.draft_proposer import DraftProposer
from services.engine.core.grammar import CompiledGrammar, GrammarCompiler
from services.engine.core.kv_cache import KVLayout, KVPool
from services.engine.core.kv_dtype import dtype_name, engine_kv_dtype
from services.engine.core.loaders import LoadedModel
from services.engine.core.model_runner import ModelRunner
from services.engine.core.sampler import Sampler, TokenLogprobs
from services.engine.core.sampling_filters import skip_draws
from services.engine.core.scheduler import Scheduler
from services.engine.core.sequence import Sequence
from services.engine.core.sequence_intake import SequenceIntake
from services.engine.core.spec_decoder import SpecDecoder, Verification
from services.engine.core.speculative import SpeculativeConfig
from services.engine.core.step_pacer import ChunkCost, StepPacer
from services.engine.core.step_phases import StepPhases

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Cache and batching limits. ``num_blocks`` wins over ``kv_cache_bytes`` when set.
    ``kv_cache_dtype``: one of :data:`~services.engine.core.kv_cache.KV_CACHE_DTYPES` (the
    workers' ``--kv-cache-dtype``, ``auto`` by default), or None for the model's own dtype: the
    parity reference, so the library's default."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    kv_cache_dtype: str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    cuda_graphs: bool = True  # decode steps on CUDA replay captured graphs (cuda_graphs.py)
    prefix_salt: bytes = b""  # the deployment's prefix-cache salt (prefix_hash.prefix_root)
    speculative: SpeculativeConfig | None = None  # speculative decoding (speculative.py); None: off
    # a step with decode rows takes prompt tokens for about this long at most (step_pacer.py);
    # None: the token budget alone
    max_step_ms: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    text: str = ""  # filled by an OutputFilter (the runtime's detokenizer), never by the engine
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    error: TandemError | None = None  # this request failed alone (finish reason "error")
    # with params.prompt_logprobs, on the output of the first sampled token: prompt token i + 1's
    # logprob given tokens 0..i, for every i (prompt_logprobs.py)
    prompt_logprobs: list[TokenLogprobs] | None = None


GRAMMAR_FAILED = "grammar_failed"
"""The error code of a request whose output grammar failed mid-stream."""
SAMPLING_FAILED = "sampling_failed"
"""The error code of a request whose row failed in the sampler (its logits finite)."""


class OutputFilter(Protocol):
    """Post-processing of outputs outside the engine step: the worker runtime's text
    (``services.engine.runtime.output_text.OutputText``). ``start`` sees each request that will
    produce tokens (with the outputs it resumes after, for a migrated request); ``apply`` sees each
    of its outputs and may end it with :meth:`LLMEngine.finish`."""

    def start(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        resume_output_ids: Seq[int] = (),
    ) -> None: ...
    def apply(self, out: RequestOutput, engine: LLMEngine) -> None: ...


class LLMEngine:
    """Owns the model runner, the KV pool, the block manager and the scheduler."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        *,
        eos_token_ids: Seq[int] | None = None,
        grammars: GrammarCompiler | None = None,
        draft: LoadedModel | None = None,
    ) -> None:
        """``eos_token_ids`` (default: the model config's) end a request unless ``ignore_eos``;
        workers pass the tokenizer's, which may list more (e.g. a chat end-of-turn token).
        ``grammars``: the tokenizer's grammar compiler (requests with a ``grammar`` are refused
        without one). ``draft``: the draft model of ``--speculative draft`` (its own KV pool,
        as many blocks as this engine's)."""
        self.config = config or EngineConfig()
        self.grammars = grammars
        self.loaded = loaded
        model_cfg = loaded.config
        device = next(loaded.model.parameters()).device
        kv_dtype = engine_kv_dtype(loaded, device, self.config.kv_cache_dtype)
        self.layout = KVLayout(
            num_layers=model_cfg.num_layers,
            block_size=self.config.block_size,
            num_kv_heads=loaded.model.config.num_kv_heads,  # a tensor-parallel rank's own
            head_dim=model_cfg.head_dim,
            dtype=dtype_name(kv_dtype),
        )
        num_blocks = self.config.num_blocks or max(2, self.config.kv_cache_bytes // self.layout.block_bytes)
        graphs = self.config.cuda_graphs and device.type == "cuda"
        # a CUDA graph's padding rows write into one more block, which no sequence ever owns
        self.kv = KVPool(num_blocks + int(graphs), self.layout, device=device)
        self.block_manager = BlockManager(
            num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.pacer = (
            StepPacer(ChunkCost.of(model_cfg), self.config.max_step_ms / 1000,
                      torch.get_num_threads if device.type == "cpu" else lambda: 1)
            if self.config.max_step_ms else None
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            pacer=self.pacer,
        )
        self.eos_token_ids = frozenset(
            model_cfg.eos_token_ids if eos_token_ids is None else eos_token_ids
        )
        self.sampler = Sampler(model_cfg.vocab_size, tuple(self.eos_token_ids))
        self.max_model_len = self.config.max_model_len or model_cfg.max_position_embeddings
        self.intake = SequenceIntake(model_cfg.vocab_size, self.max_model_len, grammars,
                                     self.config.prefix_salt)  # fmt: skip
        self.phases = StepPhases()  # the engine thread's time per phase (see step_phases)
        self.runner = ModelRunner(loaded, self.kv, self.sampler, self.phases)
        if graphs:
            self.runner.capture_decode_graphs(
                max_batch=self.config.max_num_seqs,
                max_blocks=-(-self.max_model_len // self.config.block_size),
                scratch_block=num_blocks,
            )
        self._finished: list[RequestOutput] = []
        drafter = None
        if draft is not None:
            spec = self.config.speculative
            drafter = DraftProposer(draft, loaded, block_size=self.config.block_size,
                                    num_blocks=num_blocks, eos_token_ids=tuple(self.eos_token_ids),
                                    target_kv=self.kv,
                                    draft_kv=spec.draft_kv if spec is not None else "auto")  # fmt: skip
        self.spec = SpecDecoder(self.config.speculative, self.sampler, self.block_manager,
                                self.max_model_len, drafter)  # fmt: skip
        self.spec_stats = self.spec.stats

    # ---- entry points -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        resume_output_ids: Seq[int] = (),
        grammar: CompiledGrammar | None = None,
    ) -> None:
        """Queue a request (validated: non-empty prompt that leaves room for one token).

        ``grammar``: ``params.grammar`` already compiled (``GrammarCompiler.compile``, off this
        thread); without it a constrained request's grammar is compiled here, on this thread.

        ``resume_output_ids``: tokens this request already generated elsewhere (a stream migrated
        from a decode worker that died). They count as its output (``max_tokens``, penalties,
        stop conditions); their KV is recomputed with the prompt's, as after a preemption, and
        a seeded request's generator skips their draws, so it goes on drawing what it would have
        drawn had it never moved.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params, prefill_only, grammar)
        if resume_output_ids:
            self.intake.resume(seq, resume_output_ids)
        self.scheduler.add(seq)

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        block_ids: list[int],
        first_token_id: int,
        first_logprob: TokenLogprobs | None = None,
        num_cached_tokens: int = 0,
        grammar: CompiledGrammar | None = None,
    ) -> list[RequestOutput]:
        """Queue a sequence whose prompt KV already fills ``block_ids`` (the engine takes them
        over); it decodes once a seat is free (``max_num_seqs``). ``grammar``: as for
        :meth:`add_request`.

        Returns the output for the first token (it may already finish the request).
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params, False, grammar)
        if seq.sampling.generator is not None:  # prefill drew the first token from this seed
            skip_draws(seq.sampling.generator, self.loaded.config.vocab_size, 1)
        seq.block_ids = list(block_ids)
        seq.num_computed_tokens = len(seq.prompt_token_ids)
        seq.num_cached_tokens = num_cached_tokens
        self.scheduler.add_prefilled(seq)
        out = RequestOutput(
            request_id,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
        )
        self._append_token(seq, first_token_id, first_logprob, out)
        return [out]

    def abort(self, request_id: str) -> bool:
        """Finish a request at once and free its blocks; False if it is unknown or done."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self.spec.forget(request_id)
        self._finished.append(
            RequestOutput(request_id, finished=True, finish_reason="abort",
                          num_prompt_tokens=len(seq.prompt_token_ids))
        )
        return True

    def fail(self, request_id: str, error: TandemError) -> bool:
        """End a request alone with ``error`` (its next output carries it, finish reason
        ``"error"``) and free its blocks; False if it is unknown or done."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        out = RequestOutput(request_id, num_prompt_tokens=len(seq.prompt_token_ids))
        self._fail_request(seq, out, error)
        self._finished.append(out)
        return True

    def finish(self, request_id: str, reason: str) -> bool:
        """End a running request now with ``reason`` and free its blocks, without an output of
        its own (the caller is finishing the output it holds: a stop string matched in the
        runtime's text). False if it is unknown or done."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, reason)
        self.spec.forget(request_id)
        return True

    def release_blocks(self, block_ids: Seq[int]) -> None:
        """Give back blocks a prefill-only request kept for its KV hand-off."""
        self.block_manager.free(list(block_ids))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._finished)

    # ---- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, post-process. Returns outputs of requests that moved."""
        phases = self.phases
        phases.start()
        started = time.perf_counter()
        outputs, self._finished = self._finished, []
        self.spec.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if batch is None:
            outputs.extend(self._fail_unschedulable())
            phases.lap("schedule")
            return outputs
        chunks = batch.prompt_chunks() if self.pacer is not None else []
        self.sampler.prepare([item.seq.sampling for item in batch.items if item.sample])
        phases.steps += 1
        phases.lap("schedule")
        try:
            result = self.runner.execute(batch)  # laps inputs, forward, sample
        finally:  # the matchers come home from the mask helper on every path, a failure's too
            self.sampler.grammar_masks.join()
        sampled = result.sampled
        row = 0
        draft_row = 0
        verify: list[Verification] = []
        for item in batch.items:
            seq = item.seq
            self._computed(seq, item.num_new_tokens - item.num_draft_tokens)
            if not item.sample or sampled is None:
                continue
            out = RequestOutput(
                seq.request_id,
                num_prompt_tokens=len(seq.prompt_token_ids),
                num_cached_tokens=seq.num_cached_tokens,
            )
            if seq.params.prompt_logprobs is not None and not seq.output_token_ids:
                out.prompt_logprobs = list(seq.prompt_logprobs)
            failure = sampled.failures.get(row)
            self._emit(seq, out, sampled.token_ids[row], sampled.logprobs[row], failure)
            if item.num_draft_tokens:
                verify.append(Verification(seq, out, list(seq.draft_token_ids), draft_row))
                draft_row += item.num_draft_tokens
            row += 1
            outputs.append(out)
        if verify:
            assert result.draft_logits is not None
            self.spec.verify(verify, result.draft_logits, self._emit, self._computed)
        for item in batch.items:
            item.seq.draft_token_ids.clear()
            if item.seq.finished:
                self.spec.forget(item.seq.request_id)
        phases.lap("postprocess")
        if self.pacer is not None:
            self.pacer.observe(chunks, batch.has_stream_rows, time.perf_counter() - started)
        return outputs

    def generate(
        self,
        prompts: Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams],
        *,
        output_filter: OutputFilter | None = None,
    ) -> list[RequestOutput]:
        """Run prompts as one batch to completion; one aggregated output per prompt, in order.
        ``output_filter`` (e.g. the runtime's text) sees every output, as a worker's would."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"gen-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        results = {rid: RequestOutput(rid, num_prompt_tokens=len(p)) for rid, p in zip(ids, prompts)}
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
            if output_filter is not None:
                output_filter.start(rid, prompt, p)
        while self.has_unfinished():
            for out in self.step():
                if output_filter is not None:
                    output_filter.apply(out, self)
                agg = results[out.request_id]
                agg.new_token_ids.extend(out.new_token_ids)
                agg.new_logprobs.extend(out.new_logprobs)
                agg.text += out.text
                agg.num_cached_tokens = max(agg.num_cached_tokens, out.num_cached_tokens)
                if out.prompt_logprobs is not None:
                    agg.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    agg.finished, agg.finish_reason = True, out.finish_reason
        return [results[rid] for rid in ids]

    # ---- internals ----------------------------------------------------------------------
    def _computed(self, seq: Sequence, n: int) -> None:
        """``n`` more of ``seq``'s tokens have their KV written; cache the blocks that filled."""
        before = seq.num_computed_tokens // self.config.block_size
        seq.num_computed_tokens += n
        if self.config.enable_prefix_caching and seq.num_computed_tokens // self.config.block_size > before:
            self.block_manager.cache_full_blocks(
                seq.block_ids, seq.all_token_ids()[: seq.num_computed_tokens], seq.cache_root
            )

    def _emit(
        self,
        seq: Sequence,
        out: RequestOutput,
        token: int,
        logprob: TokenLogprobs | None,
        failure: str | None,
    ) -> None:
        """Append a sampled token to ``seq`` and ``out``, or end the request alone when its row
        failed in the sampler or appending raised."""
        try:
            if failure is not None:
                self._fail_request(seq, out, TandemError(
                    f"sampling the next token failed: {failure}", code=SAMPLING_FAILED))
            else:
                self._append_token(seq, token, logprob, out)
        except Exception as err:  # noqa: BLE001 - this request's failure, not the step's
            self._fail_request(seq, out, TandemError(
                f"request {seq.request_id} failed while appending its token: {err}"))

    def _new_sequence(self, request_id: str, prompt: Seq[int], params: SamplingParams,
                      prefill_only: bool, grammar: CompiledGrammar | None) -> Sequence:  # fmt: skip
        if self.scheduler.find(request_id) is not None:
            raise InvalidArgumentError(f"request id {request_id!r} is already running", param="request_id")
        return self.intake.new_sequence(request_id, prompt, params, prefill_only, grammar)

    def _append_token(
        self, seq: Sequence, token: int, logprob: TokenLogprobs | None, out: RequestOutput
    ) -> None:
        matcher = seq.sampling.matcher
        broke = matcher is not None and (not matcher.consume_token(token) or matcher.is_error())
        seq.output_token_ids.append(token)
        seq.logprobs.append(logprob)
        out.new_token_ids.append(token)
        out.new_logprobs.append(logprob)
        if broke:
            message = f"the output grammar failed mid-stream at token {token}: {matcher.get_error()}"
            # the Rust side raising is ours (500); llguidance refusing the grammar's own
            # continuation (e.g. a regex forcing bytes no token sequence spells) is the request's
            error_type = TandemError if getattr(matcher, "failure", None) is not None else InvalidArgumentError
            self._fail_request(seq, out, error_type(message, param="response_format",
                                                    code=GRAMMAR_FAILED))  # fmt: skip
            return
        if seq.prefill_only:
            self.scheduler.finish(seq, "prefilled", keep_blocks=True)
            out.finished, out.finish_reason, out.block_ids = True, "prefilled", list(seq.block_ids)
            return
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            out.finished, out.finish_reason = True, reason

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        produced = len(seq.output_token_ids)
        matcher = seq.sampling.matcher
        if matcher is not None and matcher.is_stopped():
            return "stop"  # the grammar is complete
        if produced >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return "stop"
            if token in params.stop_token_ids:
                return "stop"
        if produced >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _fail_request(self, seq: Sequence, out: RequestOutput, error: TandemError) -> None:
        """End ``seq`` alone with ``error`` (on ``out``); the rest of the step goes on."""
        logger.warning("request %s failed alone: %s", seq.request_id, error.message)
        if self.scheduler.find(seq.request_id) is seq:
            self.scheduler.finish(seq, "error")
            self.spec.forget(seq.request_id)
        out.finished, out.finish_reason, out.error = True, "error", error
        out.block_ids = []

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """Nothing could run: a waiting sequence larger than the whole pool can never fit."""
        outputs = []
        capacity = self.block_manager.num_blocks * self.config.block_size
        for seq in list(self.scheduler.waiting):
            if not self.scheduler.running and seq.num_tokens + 1 > capacity:
                logger.warning("request %s needs more KV than the pool holds", seq.request_id)
                self.scheduler.finish(seq, "length")
                outputs.append(RequestOutput(seq.request_id, finished=True, finish_reason="length",
                                             num_prompt_tokens=len(seq.prompt_token_ids)))
        return outputs
