"""What a request becomes on entering the engine: its checks, and the :class:`Sequence` built.

Kept apart from the engine's step: every entry point (a new request, a prompt prefilled
elsewhere, a stream migrated with the tokens it already produced) passes the same checks here —
token ids in the vocabulary, a non-empty prompt that leaves room in the context, sampling
parameters valid, a grammar matcher when one is asked for — and a bad request fails with an
:class:`InvalidArgumentError` before it holds anything.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

from services.common.errors import InvalidArgumentError
from services.common.grammar_cache import grammar_key
from services.common.prefix_hash import prefix_root
from services.common.sampling_params import SamplingParams
from services.engine.core.grammar import CompiledGrammar, GrammarCompiler, OwnedMatcher, advance
from services.engine.core.sampler import SamplingState, make_generator
from services.engine.core.sampling_filters import skip_draws
from services.engine.core.sequence import Sequence


class SequenceIntake:
    """Builds checked sequences for one engine: its vocabulary, context length, grammar compiler
    (None: constrained requests are refused) and prefix-cache salt."""

    def __init__(self, vocab_size: int, max_model_len: int, grammars: GrammarCompiler | None,
                 prefix_salt: bytes) -> None:  # fmt: skip
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammars = grammars
        self.prefix_salt = prefix_salt

    def token_ids(self, ids: Seq[int], param: str) -> list[int]:
        """``ids`` as ints, each checked to be in the vocabulary (InvalidArgumentError naming
        ``param`` otherwise)."""
        out = [int(t) for t in ids]
        if any(t < 0 or t >= self.vocab_size for t in out):
            raise InvalidArgumentError(f"token ids must be in [0, {self.vocab_size})", param=param)
        return out

    def new_sequence(self, request_id: str, prompt: Seq[int], params: SamplingParams,
                     prefill_only: bool, grammar: CompiledGrammar | None = None) -> Sequence:  # fmt: skip
        """A waiting sequence for the request (``grammar``: ``params.grammar`` compiled already,
        or None to compile it here)."""
        params.validate()
        prompt_ids = self.token_ids(prompt, "prompt")
        if not prompt_ids:
            raise InvalidArgumentError("the prompt is empty", param="prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidArgumentError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens",
                param="prompt",
            )
        state = SamplingState(
            params=params,
            prompt_token_ids=prompt_ids,
            output_token_ids=[],
            generator=make_generator(params.seed) if not params.greedy else None,
            matcher=self.matcher(params, grammar),
        )
        return Sequence(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            sampling=state,
            prefill_only=prefill_only,
            arrival_time=time.monotonic(),
            cache_root=prefix_root(self.prefix_salt, params.cache_salt),
        )

    def resume(self, seq: Sequence, output_ids: Seq[int]) -> None:
        """Give ``seq`` the tokens it already generated elsewhere (a migrated stream): they count
        as its output, its grammar replays them and a seeded generator skips their draws."""
        outputs = self.token_ids(output_ids, "output_token_ids")
        if len(outputs) >= seq.params.max_tokens:
            raise InvalidArgumentError("the resumed output already has max_tokens tokens",
                                       param="output_token_ids")  # fmt: skip
        if seq.num_tokens + len(outputs) >= self.max_model_len:
            raise InvalidArgumentError("the prompt and the resumed output fill the context",
                                       param="output_token_ids")  # fmt: skip
        if seq.sampling.matcher is not None:
            advance(seq.sampling.matcher, outputs)
        seq.output_token_ids.extend(outputs)
        seq.logprobs.extend([None] * len(outputs))
        if seq.sampling.generator is not None:
            skip_draws(seq.sampling.generator, self.vocab_size, len(outputs))

    def matcher(self, params: SamplingParams, grammar: CompiledGrammar | None) -> object | None:
        """The request's grammar matcher (None when unconstrained): a copy of ``grammar``'s
        start state, or compiled here when the caller did not compile it."""
        if params.grammar is None:
            return None
        if self.grammars is None:
            raise InvalidArgumentError("structured outputs need the model's tokenizer and "
                                       "llguidance on the worker", param="response_format")  # fmt: skip
        if grammar is not None and grammar.key == grammar_key(params.grammar):
            return OwnedMatcher(grammar.matcher())  # owned by this thread
        return OwnedMatcher(self.grammars.matcher(params.grammar))
