"""Draft-model proposals (``--speculative draft --draft-model PATH``): a smaller model with the
target's vocabulary guesses each speculating sequence's next tokens, greedily, in the same worker.

The draft has its own paged KV pool and block manager (as many blocks as the target's pool: the
same tokens fit), and keeps one *mirror* per speculating request: a sequence whose tokens follow
the target sequence's. Before each step :meth:`DraftProposer.propose` brings every mirror up to
its target (the tokens the target emitted since; drafts the target rejected are dropped from the
mirror, and their KV positions count as not computed), then runs the draft: one pass computing
each mirror's missing tokens and sampling its first guess, then one decode step per further
guess. A mirror far behind — a new one, whose whole prompt the draft has not seen (a request
prefilled on another worker gets its draft KV built here, on decode) — catches up first, at most
``CATCH_UP_TOKENS`` a step, and proposes nothing meanwhile: a long prompt's draft prefill in one
pass would stall every request of the step for as long as it takes (seconds for a 500-token
prompt on a small CPU), where slices of it cost each step a little. Guesses are the draft's argmax: a proposal that draws nothing, which is
what keeps verification exact (``speculative.py``).

A mirror lives while its request runs: the engine forgets it when the request finishes, is
aborted or preempted (:meth:`DraftProposer.forget`), and every mirror of a request no longer
running is dropped before each proposal, so the draft pool returns to empty.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence as Seq

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingParams
from services.engine.core.block_manager import BlockManager, NoFreeBlocksError
from services.engine.core.kv_cache import KVLayout, KVPool
from services.engine.core.kv_dtype import dtype_name
from services.engine.core.loaders import LoadedModel
from services.engine.core.model_runner import ModelRunner
from services.engine.core.sampler import Sampler, SamplingState
from services.engine.core.scheduler import ScheduledBatch, ScheduledSeq
from services.engine.core.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0, max_tokens=1 << 30, ignore_eos=True)


class DraftProposer:
    """A draft model, its KV pool and the mirrors of the sequences it drafts for."""

    def __init__(self, draft: LoadedModel, target: LoadedModel, *, block_size: int, num_blocks: int,
                 eos_token_ids: Seq[int]) -> None:  # fmt: skip
        if draft.config.vocab_size != target.config.vocab_size:
            raise InvalidArgumentError(
                f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is not the "
                f"target's ({target.config.vocab_size}): a draft must share the tokenizer",
                param="draft_model",
            )
        device = next(draft.model.parameters()).device
        config = draft.config
        layout = KVLayout(num_layers=config.num_layers, block_size=block_size,
                          num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                          dtype=dtype_name(draft.dtype))  # fmt: skip
        self.kv = KVPool(num_blocks, layout, device=device)
        self.blocks = BlockManager(num_blocks, block_size, False)
        self.runner = ModelRunner(draft, self.kv, Sampler(config.vocab_size, tuple(eos_token_ids)))
        self._mirrors: dict[str, Sequence] = {}
        self.seconds = 0.0  # time spent drafting, for the worker's logs and benchmarks

    @property
    def num_blocks_in_use(self) -> int:
        return self.blocks.num_blocks_in_use

    def propose(self, wanted: Seq[tuple[Sequence, int]]) -> dict[str, list[int]]:
        """Up to ``k`` greedy guesses for each ``(sequence, k)``; a sequence whose mirror finds
        no KV room gets none."""
        start = time.perf_counter()
        mirrors: list[tuple[Sequence, int]] = []
        behind: list[Sequence] = []
        for seq, k in wanted:
            mirror = self._sync(seq)
            if mirror is None or k <= 0:
                continue
            if mirror.num_uncomputed > self.CATCH_UP_TOKENS:
                behind.append(mirror)
            else:
                mirrors.append((mirror, k))
        if behind:
            self._catch_up(behind)
        drafts: dict[str, list[int]] = {m.request_id: [] for m, _ in mirrors}
        while mirrors:
            items = []
            for mirror, _ in mirrors:
                try:
                    self.blocks.ensure_capacity(mirror.block_ids, mirror.num_tokens)
                except NoFreeBlocksError:
                    continue
                items.append(self._item(mirror))
            if not items:
                break
            result = self.runner.execute(ScheduledBatch(items))
            assert result.sampled is not None
            row = 0  # the caught-up tails' rows in result.draft_logits, item by item
            for item, token in zip(items, result.sampled.token_ids, strict=True):
                mirror = item.seq
                if item.num_draft_tokens:  # the guess comes from the tail's last row
                    row += item.num_draft_tokens
                    assert result.draft_logits is not None
                    token = int(result.draft_logits[row - 1].argmax())
                    mirror.draft_token_ids = []
                mirror.num_computed_tokens += item.num_new_tokens
                mirror.sampling.output_token_ids.append(token)
                drafts[mirror.request_id].append(token)
            scheduled = {id(item.seq) for item in items}
            mirrors = [(m, k) for m, k in mirrors
                       if id(m) in scheduled and len(drafts[m.request_id]) < k]  # fmt: skip
        self.seconds += time.perf_counter() - start
        return drafts

    CATCH_UP_TOKENS = 64
    """Most tokens a mirror far behind computes in one step (see the module docstring)."""

    def _catch_up(self, behind: list[Sequence]) -> None:
        """One pass computing the next ``CATCH_UP_TOKENS`` of each mirror far behind, sampling
        nothing (a mirror without KV room waits)."""
        items = []
        for mirror in behind:
            try:
                self.blocks.ensure_capacity(mirror.block_ids, mirror.num_tokens)
            except NoFreeBlocksError:
                continue
            items.append(ScheduledSeq(mirror, self.CATCH_UP_TOKENS, False))
        if items:
            self.runner.execute(ScheduledBatch(items))
            for item in items:
                item.seq.num_computed_tokens += item.num_new_tokens

    TAIL_ROWS = 16
    """A mirror this few tokens behind catches up as decode rows (the engine's verify rows):
    one decode pass, not a prompt-like slice through the per-op path."""

    def _item(self, mirror: Sequence) -> ScheduledSeq:
        """This pass of ``mirror``: its missing tokens, a short tail as decode rows (the first
        row sampled as usual is not the one wanted: the tail's last row is, by argmax)."""
        missing = mirror.num_uncomputed
        if 1 < missing <= self.TAIL_ROWS:
            mirror.draft_token_ids = mirror.all_token_ids()[-(missing - 1):]
            return ScheduledSeq(mirror, missing, True, missing - 1)
        return ScheduledSeq(mirror, missing, True)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop these requests' mirrors and free their blocks."""
        for request_id in request_ids:
            mirror = self._mirrors.pop(request_id, None)
            if mirror is not None and mirror.block_ids:
                self.blocks.free(mirror.block_ids)
                mirror.block_ids = []

    def keep_only(self, request_ids: set[str]) -> None:
        """Drop every mirror of a request not in ``request_ids`` (finished, aborted, preempted)."""
        self.forget([rid for rid in self._mirrors if rid not in request_ids])

    def _sync(self, seq: Sequence) -> Sequence | None:
        """``seq``'s mirror with ``seq``'s tokens: made on first use, else its drafts the target
        rejected dropped and the target's new tokens appended (KV past the common prefix counts
        as not computed, and blocks past the tokens are returned)."""
        tokens = seq.all_token_ids()
        mirror = self._mirrors.get(seq.request_id)
        if mirror is not None and tokens[: len(mirror.prompt_token_ids)] != mirror.prompt_token_ids:
            self.forget([seq.request_id])  # another request under a reused id
            mirror = None
        if mirror is None:
            mirror = Sequence(request_id=seq.request_id, prompt_token_ids=tokens, params=_GREEDY,
                              sampling=SamplingState(_GREEDY, tokens, [], None),
                              status=SequenceStatus.RUNNING)  # fmt: skip
            self._mirrors[seq.request_id] = mirror
            return mirror
        prompt_len = len(mirror.prompt_token_ids)
        outputs = mirror.sampling.output_token_ids
        target = tokens[prompt_len:]
        common = 0
        limit = min(len(outputs), len(target))
        while common < limit and outputs[common] == target[common]:
            common += 1
        outputs[:] = target
        # at least the last token is computed again (its KV is rewritten with the same values)
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, prompt_len + common,
                                         mirror.num_tokens - 1)  # fmt: skip
        keep = self.blocks.blocks_needed(mirror.num_tokens)
        if len(mirror.block_ids) > keep:
            self.blocks.free(mirror.block_ids[keep:])
            del mirror.block_ids[keep:]
        return mirror
