"""Continuous batching: which sequences run this step, and how many tokens each computes.

There is no separate "prefill phase": every sequence computes ``all_token_ids[num_computed:]``
up to the step's token budget (so long prompts are chunked), and is sampled when it reaches the
end. Policy per step:

  1. Running sequences first, oldest first (decode tokens and unfinished prompt chunks). If the
     block pool cannot grow a sequence, the newest running sequence is preempted (its blocks
     are freed and it goes back to the front of the queue to be recomputed) — never a crash.
  2. Then waiting sequences, in arrival order, while the token budget, the seat limit
     (``max_num_seqs``) and the free blocks allow. Their prompt blocks are allocated at
     admission, reusing cached prefix blocks (prefix caching).
  3. With a pacer (``step_pacer.py``), a step in which a running sequence decodes gives prompt
     chunks only the tokens that fit its time target, so a long prompt does not stall streams.

A sequence that arrives with its KV already filled (prefilled on another worker,
:meth:`Scheduler.add_prefilled`) waits in the same queue holding its blocks, and takes a seat
under the same limit without any allocation beyond room for its next token.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from services.engine.core.block_manager import BlockManager, NoFreeBlocksError
from services.engine.core.sequence import Sequence, SequenceStatus
from services.engine.core.step_pacer import StepPacer, StepRoom

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: ``num_new_tokens`` from ``num_computed_tokens`` on, the
    last ``num_draft_tokens`` of them its drafts (``seq.draft_token_ids``: speculative.py)."""

    seq: Sequence
    num_new_tokens: int
    sample: bool
    num_draft_tokens: int = 0


@dataclass(slots=True)
class ScheduledBatch:
    items: list[ScheduledSeq]

    @property
    def is_decode(self) -> bool:
        """True when every sequence computes exactly one token of its own, drafts aside (the fast
        batched path: a speculating sequence's last token and drafts run as one decode row each,
        ``model_runner``)."""
        return all(item.num_new_tokens - item.num_draft_tokens == 1 for item in self.items)

    def prompt_chunks(self) -> list[tuple[int, int]]:
        """``(tokens, tokens computed before)`` of each item that computes prompt tokens (more
        than one of its own): what ``step_pacer`` charges. Read it before the step runs."""
        return [(item.num_new_tokens, item.seq.num_computed_tokens) for item in self.items
                if item.num_new_tokens - item.num_draft_tokens > 1]  # fmt: skip

    @property
    def has_stream_rows(self) -> bool:
        """Whether a stream's next token is in this step (a decode row not of a prefill-only
        request)."""
        return any(item.num_new_tokens - item.num_draft_tokens == 1 and not item.seq.prefill_only
                   for item in self.items)  # fmt: skip


class Scheduler:
    """Owns the waiting queue and the running set; asks the BlockManager for blocks."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        pacer: StepPacer | None = None,
    ) -> None:
        """``pacer``: sizes prompt chunks in steps with decode rows to a time target
        (``step_pacer.py``); None: the token budget alone."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pacer = pacer
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (it holds no blocks yet)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """Queue a sequence whose blocks and KV already exist (received from a prefill worker)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None

    def schedule(self) -> ScheduledBatch | None:
        """Pick this step's work; None when nothing can run."""
        budget = self.max_num_batched_tokens
        room = self._room()
        items: list[ScheduledSeq] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            n = min(seq.num_uncomputed, budget)
            if room is not None and n > 1:  # a prompt chunk beside decode rows
                n = room.take(n, seq.num_computed_tokens)
                if n == 0:
                    index += 1
                    continue
            drafts = 0
            if seq.draft_token_ids and seq.num_uncomputed == 1:  # its last token and its drafts
                drafts = min(len(seq.draft_token_ids), budget - 1)
                del seq.draft_token_ids[drafts:]
            if not self._grow(seq, seq.num_computed_tokens + n + drafts):
                preempted = True
                if seq not in self.running:  # it preempted itself: nothing left to try
                    break
                continue  # a later sequence was preempted; retry growing this one
            sample = seq.num_computed_tokens + n == seq.num_tokens
            items.append(ScheduledSeq(seq, n + drafts, sample, drafts))
            budget -= n + drafts
            index += 1
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if room is not None and room.exhausted and not seq.block_ids:
                break  # a prompt to compute, and no time left in this step for it
            try:
                if seq.block_ids:  # prefilled elsewhere: its KV is in place; room for what's next
                    self.block_manager.ensure_capacity(seq.block_ids, seq.num_tokens)
                else:
                    alloc = self.block_manager.allocate_prompt(
                        seq.all_token_ids(), root=seq.cache_root,
                        match=seq.params.prompt_logprobs is None)  # fmt: skip
                    seq.block_ids = list(alloc.block_ids)
                    seq.num_computed_tokens = alloc.num_cached_tokens
                    seq.num_cached_tokens = max(seq.num_cached_tokens, alloc.num_cached_tokens)
            except NoFreeBlocksError:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            if room is not None and n > 1:
                n = room.take(n, seq.num_computed_tokens)
                if n == 0:
                    continue  # running now: its chunks start next step
            items.append(ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
            budget -= n
        return ScheduledBatch(items) if items else None

    def _room(self) -> StepRoom | None:
        """This step's prompt allowance: paced when a running sequence decodes (a stream's next
        token waits on the step), else None (the token budget alone)."""
        if self.pacer is None or not any(seq.num_uncomputed == 1 and not seq.prefill_only
                                         for seq in self.running):  # fmt: skip
            return None
        return self.pacer.room()

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` in ``seq``; preempt the newest sequence when short.

        Returns False when a preemption happened (the caller re-examines the running set).
        """
        try:
            self.block_manager.ensure_capacity(seq.block_ids, num_tokens)
            return True
        except NoFreeBlocksError:
            self.preempt(self.running[-1])
            return False

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it for recomputation at the front of the queue."""
        logger.info("preempting %s (%d tokens) for lack of KV blocks", seq.request_id, seq.num_tokens)
        self.running.remove(seq)
        seq.draft_token_ids.clear()
        self.block_manager.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, *, keep_blocks: bool = False) -> None:
        """Mark ``seq`` finished and free its blocks (unless the caller takes them over)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_ids and not keep_blocks:
            self.block_manager.free(seq.block_ids)
            seq.block_ids = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
