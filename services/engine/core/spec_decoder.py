"""The engine's side of speculative decoding: drafts before a step, verification after it.

:class:`SpecDecoder` holds what ``speculative.py`` describes: :meth:`SpecDecoder.propose` gives
each running sequence that may speculate its drafts for the coming step (prompt lookup, cut at
the first token a grammar forbids), and :meth:`SpecDecoder.verify`, once the step's forward pass
has logits for every draft position, emits what those positions allow, position by position,
through the engine's own ``emit`` (the path any sampled token takes: grammar matcher, stop
conditions, a request's failure alone) and counts the KV of every accepted draft as computed
through the engine's ``computed``; then it returns the blocks that hold only rejected drafts.

Kept apart from ``engine.py`` so that the engine's step stays one screen and everything that is
speculation — eligibility, the draft limits, the row order, the KV roll-back, the counters — is
in one place. It runs on the engine thread only; grammar masks for draft positions are computed
there (``GrammarMasks.take`` without a prepared job), never on the mask helper.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from services.common.errors import InvalidArgumentError
from services.engine.core.block_manager import BlockManager
from services.engine.core.draft_proposer import DraftProposer
from services.engine.core.sampler import Sampler, TokenLogprobs
from services.engine.core.sequence import Sequence
from services.engine.core.speculative import PromptLookup, SpecDecodeStats, SpeculativeConfig

Emit = Callable[[Sequence, Any, int, TokenLogprobs | None, str | None], None]
"""The engine's ``_emit(seq, out, token, logprob, failure)``: append one sampled token."""
Computed = Callable[[Sequence, int], None]
"""The engine's ``_computed(seq, n)``: ``n`` more tokens of ``seq`` have their KV written."""


@dataclass(slots=True)
class Verification:
    """A speculating sequence's drafts in this step: its output so far (a ``RequestOutput``),
    the row of its first draft position in the step's draft logits, and how many drafts were
    accepted."""

    seq: Sequence
    out: Any
    drafts: list[int]
    first_row: int
    accepted: int = 0


class SpecDecoder:
    """Drafts and their verification for one engine (a no-op without a configuration)."""

    def __init__(
        self,
        config: SpeculativeConfig | None,
        sampler: Sampler,
        block_manager: BlockManager,
        max_model_len: int,
        draft: DraftProposer | None = None,
    ) -> None:
        """``draft``: the draft model's proposer, which the ``draft`` method needs."""
        self.config = config.validate() if config is not None else None
        if self.config is not None and self.config.method == "draft" and draft is None:
            raise InvalidArgumentError("--speculative draft needs a draft model (--draft-model)",
                                       param="draft_model")  # fmt: skip
        self.sampler = sampler
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.draft = draft
        self.stats = SpecDecodeStats()

    def forget(self, request_id: str) -> None:
        """A request ended: its draft model mirror (if any) goes."""
        if self.draft is not None:
            self.draft.forget([request_id])

    def propose(self, running: Seq[Sequence]) -> None:
        """Set this step's drafts of every running sequence that speculates: in pure decode,
        not prefill-only, its request not opted out, while the batch is small enough; never more
        than the request's ``max_tokens`` or the context leave room for."""
        if self.config is None:  # nothing ever sets drafts: no per-step work
            return
        for seq in running:
            seq.draft_token_ids = []
        if self.draft is not None:
            self.draft.keep_only({seq.request_id for seq in running})
        spec = self.config
        if spec is None or not running or len(running) > spec.max_batch:
            return
        k = spec.num_speculative_tokens
        wanted: list[tuple[Sequence, int]] = []
        for seq in running:
            if seq.prefill_only or not seq.params.speculative or seq.num_uncomputed != 1:
                continue
            # a step emits at most drafts + 1 tokens: never past max_tokens or the context
            room = min(seq.params.max_tokens - len(seq.output_token_ids),
                       self.max_model_len - seq.num_tokens) - 1  # fmt: skip
            if room < 1:
                continue
            if seq.lookup is None:  # (the draft method uses only its adaptive draft length)
                seq.lookup = PromptLookup(k)
            if not seq.lookup.ready():  # resting after repeated misses
                continue
            wanted.append((seq, min(room, seq.lookup.draft_len)))
        if self.draft is not None:
            proposed = self.draft.propose(wanted)
        else:
            proposed = {seq.request_id: seq.lookup.propose(seq.all_token_ids(), n, spec.ngram_max,
                                                           spec.ngram_min)  # type: ignore[union-attr]
                        for seq, n in wanted}  # fmt: skip
        for seq, _ in wanted:
            drafts = proposed.get(seq.request_id, [])
            matcher = seq.sampling.matcher
            if drafts and matcher is not None:  # what the grammar forbids is never scored
                drafts = drafts[: matcher.validate_tokens(drafts)]
            seq.draft_token_ids = drafts

    def verify(self, pending: list[Verification], logits: torch.Tensor, emit: Emit,
               computed: Computed) -> None:  # fmt: skip
        """Emit what each speculating sequence's draft positions allow: the row after draft
        ``j`` is sampled only when the token sampled before it equalled draft ``j`` (rows of all
        sequences at one position in one sampler call); every accepted draft's KV is kept, blocks
        past the sequence's tokens are returned."""
        active = [v for v in pending if self._accepts(v, 0, computed)]
        position = 0
        while active:
            rows = torch.tensor([v.first_row + position for v in active], device=logits.device)
            sampled = self.sampler(logits.index_select(0, rows), [v.seq.sampling for v in active])
            still: list[Verification] = []
            for i, v in enumerate(active):
                emit(v.seq, v.out, sampled.token_ids[i], sampled.logprobs[i], sampled.failures.get(i))
                if self._accepts(v, position + 1, computed):
                    still.append(v)
            active = still
            position += 1
        k = self.config.num_speculative_tokens if self.config is not None else 1
        for v in pending:
            self.stats.record(len(v.drafts), v.accepted)
            seq = v.seq
            if seq.lookup is not None:
                seq.lookup.adapt(v.accepted, k)
            if seq.finished:
                self.forget(seq.request_id)
            else:  # blocks that hold only rejected drafts go back at once
                keep = self.block_manager.blocks_needed(seq.num_tokens)
                if len(seq.block_ids) > keep:
                    self.block_manager.free(seq.block_ids[keep:])
                    del seq.block_ids[keep:]

    @staticmethod
    def _accepts(v: Verification, position: int, computed: Computed) -> bool:
        """Whether the token just emitted for ``v`` equals draft ``position`` (its KV, written by
        this step, is then the sequence's): counted, and its row may be sampled."""
        if v.seq.finished or position >= len(v.drafts) or v.out.new_token_ids[-1:] != [v.drafts[position]]:
            return False
        v.accepted += 1
        computed(v.seq, 1)
        return True
