"""Constrained decoding: per-request grammar matchers and the token masks they allow.

A request with ``SamplingParams.grammar`` (an llguidance grammar: what the gateway compiles a
``response_format`` JSON schema, a regex, a choice list or a Lark/GBNF grammar into) gets an
``llguidance.LLMatcher`` on every worker that samples for it. The sampler masks every token the
matcher does not allow before temperature and top-p; the engine advances the matcher by each token
it appends, and ends the request (``"stop"``) once the grammar is complete.

Why llguidance rather than our own automaton: it is the library vLLM, SGLang and llama.cpp use, it
builds its token trie from the tokenizer we already have (any ``tokenizers`` JSON: Hugging Face
folders and GGUF files alike), computes a 49k-token mask in tens of microseconds, and supports JSON
Schema, regexes and Lark grammars with the same matcher.

The masks are computed off the critical path where the machine has a core to spare:
:meth:`GrammarMasks.prepare` starts them on a helper thread when a step is scheduled (the matchers
already hold every token appended so far), the model's forward pass runs meanwhile, and the sampler
collects them with :meth:`GrammarMasks.take`. Where the engine's threads already use every core
(a 2-core CPU worker), the helper thread would only preempt one of them mid-matmul and stall the
whole parallel region (measured: a 0.7 ms fill made a batch-16 step 4 ms slower), so the masks are
filled in :meth:`take` instead, between the forward pass and the sampling. A step with no
constrained row never touches this module.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from services.common.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

CACHED_GRAMMARS = 64
"""Compiled grammars kept per worker: a repeated schema (every request of one application sends
the same) is compiled once, and each request gets a cheap copy of the fresh matcher."""


class GrammarCompiler:
    """The served model's llguidance tokenizer and a cache of compiled grammars."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """``tokenizer_json``: the ``tokenizers`` library's JSON of the model's tokenizer;
        ``vocab_size``: the model's logits width (may exceed the tokenizer's)."""
        import llguidance

        self._llguidance = llguidance
        eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos or None)  # fmt: skip
        self.vocab_size = vocab_size
        self._fresh: OrderedDict[str, Any] = OrderedDict()

    @classmethod
    def create(cls, tokenizer_json: str | None, vocab_size: int,
               eos_token_ids: Sequence[int]) -> GrammarCompiler | None:  # fmt: skip
        """A compiler, or None (one log line) without a tokenizer or without llguidance."""
        if tokenizer_json is None:
            return None
        try:
            return cls(tokenizer_json, vocab_size, eos_token_ids)
        except ImportError:
            logger.warning("llguidance is not installed: structured outputs are refused")
        except Exception as err:  # noqa: BLE001 - a tokenizer llguidance cannot read
            logger.warning("structured outputs are off: llguidance cannot use this tokenizer "
                           "(%s)", err)  # fmt: skip
        return None

    def matcher(self, grammar: str) -> Any:
        """A fresh ``LLMatcher`` for ``grammar``; InvalidArgumentError naming the problem when
        the grammar does not compile against this tokenizer."""
        fresh = self._fresh.get(grammar)
        if fresh is None:
            fresh = self._llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if fresh.is_error():
                raise InvalidArgumentError(f"the output grammar is invalid: {fresh.get_error()}",
                                           param="response_format")  # fmt: skip
            self._fresh[grammar] = fresh
            if len(self._fresh) > CACHED_GRAMMARS:
                self._fresh.popitem(last=False)
        else:
            self._fresh.move_to_end(grammar)
        return fresh.deep_copy()


def advance(matcher: Any, tokens: Sequence[int]) -> None:
    """Feed tokens sampled elsewhere (prefill's first token, a migrated stream's output) to a
    matcher; InvalidArgumentError when the grammar does not allow them."""
    if tokens and not matcher.consume_tokens(list(tokens)):
        raise InvalidArgumentError(
            f"the tokens generated so far do not follow the output grammar: {matcher.get_error()}",
            param="output_token_ids",
        )


class GrammarMasks:
    """Token masks of the constrained rows of a step, computed on a helper thread."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int] = (),
                 overlap: bool | None = None) -> None:  # fmt: skip
        """``eos_token_ids``: what a row whose grammar allows nothing (a matcher in its error
        state) may still pick, so that it ends; ``overlap``: fill on a helper thread during the
        forward pass; None decides by the machine (only when a core is left over by the engine's
        intra-op threads)."""
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        self.words = -(-vocab_size // 32)
        self.overlap = overlap
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[list[Any], Future[torch.Tensor]] | None = None

    def prepare(self, matchers: Sequence[Any | None]) -> None:
        """Start the masks of a step whose sampled rows have these matchers (None: row
        unconstrained). Nothing happens when no row is constrained, or where no core is spare."""
        self._pending = None
        if all(m is None for m in matchers):
            return
        if self.overlap is None:
            self.overlap = (os.cpu_count() or 1) > torch.get_num_threads()
        if not self.overlap:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        rows = list(matchers)
        self._pending = (rows, self._pool.submit(self._fill, rows))

    def take(self, matchers: Sequence[Any | None]) -> torch.Tensor:
        """``[rows, vocab]`` bool: True where the row's grammar allows the token (all True for an
        unconstrained row). Uses the prepared masks when they are for these matchers."""
        pending, self._pending = self._pending, None
        if pending is not None and len(pending[0]) == len(matchers) and all(
            a is b for a, b in zip(pending[0], matchers)
        ):
            return pending[1].result()
        return self._fill(list(matchers))

    def _fill(self, matchers: list[Any | None]) -> torch.Tensor:
        words = np.full((len(matchers), self.words), -1, dtype=np.int32)
        for row, matcher in enumerate(matchers):
            if matcher is not None:
                matcher.unsafe_compute_mask_ptr(words[row].ctypes.data, self.words * 4)
        dead = ~words.any(axis=1)  # a matcher in its error state allows nothing: let it end
        unsigned = words.view(np.uint32)
        for token in self.eos_token_ids:
            unsigned[dead, token // 32] |= np.uint32(1 << (token % 32))
        # bit i of word w is token 32 w + i: little-endian words, least significant bit first
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, : self.vocab_size].view(np.bool_))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
