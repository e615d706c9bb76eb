"""Draft-model proposals (``--speculative draft --draft-model PATH``): a smaller model with the
target's vocabulary guesses each speculating sequence's next tokens, greedily, in the same worker.

The draft has its own paged KV pool and block manager (as many blocks as the target's pool: the
same tokens fit), and keeps one *mirror* per speculating request: a sequence whose tokens follow
the target sequence's. Before each step :meth:`DraftProposer.propose` brings every mirror up to
its target (the tokens the target emitted since; drafts the target rejected are dropped from the
mirror, and their KV positions count as not computed), then runs the draft: one pass computing
each mirror's missing tokens and sampling its first guess, then one decode step per further
guess. A mirror far behind — a new one, whose whole prompt the draft has not seen (a request
prefilled on another worker) — gets the prompt's draft KV one of two ways:

* *adopted* (``draft_kv="auto"`` when the draft is the target's own shape: a quantized form of
  the same model, the self-draft): the target's KV of every computed position is copied into the
  mirror's blocks, a memory copy instead of the draft's prompt forward. The draft then proposes
  from the target's prompt KV and its own KV of the tokens after it. Its guesses change, never
  the output: verification does not care where a guess came from (``speculative.py``), and the
  adopted KV of a quantized self-draft is the better estimate of the same model's.
* *built* (``draft_kv="build"``, or a draft of another shape): the mirror catches up through the
  draft's own forward, at most ``CATCH_UP_TOKENS`` a step, proposing nothing meanwhile: a long
  prompt's draft prefill in one pass would stall every request of the step for as long as it
  takes (seconds for a 500-token prompt on a small CPU), where slices of it cost each step a
  little. The total is still the draft's prefill of the whole prompt, on the decode worker.

(Shipping the draft's KV from the prefill worker, the third way, moves that prefill there without
making it smaller: on one CPU machine both workers share the cores, so it is not built.) Guesses are the draft's argmax: a proposal that draws nothing, which is
what keeps verification exact (``speculative.py``).

A mirror lives while its request runs: the engine forgets it when the request finishes, is
aborted or preempted (:meth:`DraftProposer.forget`), and every mirror of a request no longer
running is dropped before each proposal, so the draft pool returns to empty.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence as Seq
from dataclasses import replace

from services.common.errors import InvalidArgumentError
from services.common.model_config import ModelConfig
from services.common.sampling_params import SamplingParams
from services.engine.core.block_manager import BlockManager, NoFreeBlocksError
from services.engine.core.kv_cache import Q8_0, KVLayout, KVPool
from services.engine.core.kv_dtype import dtype_name
from services.engine.core.loaders import LoadedModel
from services.engine.core.model_runner import ModelRunner
from services.engine.core.sampler import Sampler, SamplingState
from services.engine.core.scheduler import ScheduledBatch, ScheduledSeq
from services.engine.core.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0, max_tokens=1 << 30, ignore_eos=True)

DRAFT_KV_CHOICES = ("auto", "build")
"""How a mirror gets a prompt's draft KV (``--draft-kv``): ``auto`` adopts the target's where
:func:`same_kv_shape` holds, else builds it; ``build`` always runs the draft's forward."""

_SHAPE_FIELDS = ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "rope_theta", "rope_scaling", "local_rope_theta", "qk_norm",
                 "sliding_window", "layer_types", "partial_rotary_factor")  # fmt: skip


def same_kv_shape(draft: ModelConfig, target: ModelConfig, draft_layout: KVLayout,
                  target_layout: KVLayout) -> bool:  # fmt: skip
    """Whether the draft is the target's shape (one family, the same layers, heads, rotary
    embedding and attention windows: the same model in another weight format) and its KV blocks
    hold what the target's do, so the target's KV may stand in for the draft's own: both pools'
    blocks alike, or both float and differing only in the float type (a converting copy)."""
    if any(getattr(draft, f) != getattr(target, f) for f in _SHAPE_FIELDS):
        return False
    if draft_layout == target_layout:
        return True
    quantized = Q8_0 in (draft_layout.dtype, target_layout.dtype)
    return not quantized and replace(draft_layout, dtype=target_layout.dtype) == target_layout


class DraftProposer:
    """A draft model, its KV pool and the mirrors of the sequences it drafts for."""

    def __init__(self, draft: LoadedModel, target: LoadedModel, *, block_size: int, num_blocks: int,
                 eos_token_ids: Seq[int], target_kv: KVPool | None = None,
                 draft_kv: str = "auto") -> None:  # fmt: skip
        """``target_kv``: the target's KV pool, whose prompt KV a draft of its own shape adopts
        (``draft_kv="auto"``; ``"build"`` always runs the draft's forward)."""
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
        if draft_kv not in DRAFT_KV_CHOICES:
            raise InvalidArgumentError(f"--draft-kv must be one of {', '.join(DRAFT_KV_CHOICES)}",
                                       param="draft_kv")  # fmt: skip
        self._target_kv = (target_kv if draft_kv == "auto" and target_kv is not None
                           and same_kv_shape(draft.config, target.config, self.kv.layout,
                                             target_kv.layout) else None)  # fmt: skip
        self.adopted_tokens = 0  # prompt positions whose KV came from the target's

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
            if self._target_kv is not None and mirror.num_uncomputed > self.TAIL_ROWS:
                self._adopt(seq, mirror)
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

    def _adopt(self, seq: Sequence, mirror: Sequence) -> None:
        """Copy the target's KV of ``seq``'s computed positions into ``mirror``'s blocks (all but
        the last token, which the next pass computes as usual); without KV room, nothing."""
        assert self._target_kv is not None
        n = min(seq.num_computed_tokens, mirror.num_tokens - 1)
        if n <= mirror.num_computed_tokens:
            return
        try:
            self.blocks.ensure_capacity(mirror.block_ids, mirror.num_tokens)
        except NoFreeBlocksError:
            return
        count = self.blocks.blocks_needed(n)
        self.kv.write_blocks(mirror.block_ids[:count],
                             self._target_kv.read_blocks(seq.block_ids[:count]))  # fmt: skip
        self.adopted_tokens += n - mirror.num_computed_tokens
        mirror.num_computed_tokens = n

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
