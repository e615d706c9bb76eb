"""Per-request sampling parameters, shared by the gateway, the services and the engine.

One frozen dataclass with the knobs of vLLM/OpenAI (docs/engine.md). ``validate`` raises an
:class:`InvalidArgumentError` naming the offending field, so the gateway can answer 400 with
``param`` and the gRPC services INVALID_ARGUMENT, before any compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.common.errors import InvalidArgumentError

MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
# Temperatures below this sample greedily (vLLM's line too): at them the distribution is the argmax
# to float precision (a logit gap of 1e-3 becomes e^100), and far below it logits divided by the
# temperature overflow float32 to inf, whose softmax is NaN.
GREEDY_TEMPERATURE = 1e-5
MAX_REPETITION_PENALTY = 10.0
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # one stop string's length: each is searched in every new piece of text
MAX_STOP_TOKEN_IDS = 1024  # checked against every sampled token (a set) and banned under min_tokens
MAX_CACHE_SALT_CHARS = 256
MAX_N = 16
MAX_GRAMMAR_BYTES = 256 * 1024  # a compiled response_format / structured_outputs grammar
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]
SEED_MIN, SEED_END = -(2**63), 2**64  # a seed is 64 bits, signed or not: [SEED_MIN, SEED_END)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        temperature: 0 (or below ``GREEDY_TEMPERATURE``) means greedy.
        top_k: keep the k most likely tokens; 0 (or -1) disables.
        top_p: nucleus sampling mass; 1.0 disables.
        min_p: drop tokens whose probability is below ``min_p * p_max``; 0 disables.
        repetition_penalty: >1 discourages tokens already in prompt or output (HF semantics).
        presence_penalty / frequency_penalty: OpenAI semantics over generated tokens.
        seed: per-request seed; the same seed gives the same tokens whatever the batch holds.
        max_tokens: most tokens to generate.
        min_tokens: EOS and stop token ids are masked until this many tokens were generated.
        stop: strings that end generation (not included in the output).
        stop_token_ids: extra token ids that end generation.
        ignore_eos: keep going past EOS.
        logprobs: None = no logprobs; k >= 0 returns the chosen token's logprob and the top-k.
        n: number of completions per prompt (handled by the gateway / engine as n sequences).
        skip_special_tokens: drop special tokens from the detokenized text.
        grammar: constrained decoding, as an llguidance grammar (the gateway compiles
            ``response_format`` / ``structured_outputs`` into one); None = unconstrained.
        logit_bias: OpenAI's ``logit_bias`` as sorted ``(token id, bias)`` pairs, each bias in
            [-100, 100], added to the logits before sampling.
        cache_salt: vLLM's per-tenant prefix-cache salt: prompts share cached KV blocks only
            with requests of the same salt ("" = the deployment's shared cache;
            ``services/common/prefix_hash.py``).
        speculative: whether a worker running speculative decoding (``--speculative``) may
            speculate for this request (Tandem's extension field; speculation never changes
            greedy output, nor seeded output: ``services/engine/core/speculative.py``). False
            decodes one token per step.
        prompt_logprobs: vLLM's ``prompt_logprobs``: None = none; k >= 0 returns, for every
            prompt token after the first, its logprob given the tokens before it, its rank in
            the vocabulary and the top-k (computed where the prompt is prefilled; such a prompt
            is computed whole, never read from the prefix cache).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    grammar: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    cache_salt: str = ""
    speculative: bool = True
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        """Temperature 0 or below ``GREEDY_TEMPERATURE`` (whose distribution is the argmax)."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> "SamplingParams":
        """Raise InvalidArgumentError (with ``param``) on any out-of-range value; return self."""
        _finite(self.temperature, "temperature")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidArgumentError("temperature must be in [0, 100]", param="temperature")
        if self.top_k < -1:
            raise InvalidArgumentError("top_k must be -1, 0 (disabled) or positive", param="top_k")
        _finite(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError("top_p must be in (0, 1]", param="top_p")
        _finite(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgumentError("min_p must be in [0, 1]", param="min_p")
        _finite(self.repetition_penalty, "repetition_penalty")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidArgumentError(
                "repetition_penalty must be in (0, 10]", param="repetition_penalty"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _finite(value, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidArgumentError(f"{name} must be in [-2, 2]", param=name)
        if self.seed is not None and not SEED_MIN <= self.seed < SEED_END:
            raise InvalidArgumentError("seed must fit in 64 bits", param="seed")
        if self.max_tokens < 1:
            raise InvalidArgumentError("max_tokens must be at least 1", param="max_tokens")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidArgumentError(
                "min_tokens must be in [0, max_tokens]", param="min_tokens"
            )
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise InvalidArgumentError("stop must hold 1 to 16 non-empty strings", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidArgumentError(
                f"each stop string must be at most {MAX_STOP_CHARS} characters", param="stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgumentError(
                f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids", param="stop_token_ids")
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidArgumentError(
                f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters", param="cache_salt")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgumentError("stop_token_ids must be non-negative", param="stop_token_ids")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgumentError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgumentError(
                f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="prompt_logprobs"
            )
        if not 1 <= self.n <= MAX_N:
            raise InvalidArgumentError("n must be in [1, 16]", param="n")
        if self.grammar is not None and not 0 < len(self.grammar.encode()) <= MAX_GRAMMAR_BYTES:
            raise InvalidArgumentError(
                f"the output grammar must be 1 to {MAX_GRAMMAR_BYTES} bytes", param="response_format"
            )
        self._validate_logit_bias()
        return self

    def _validate_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidArgumentError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens", param="logit_bias"
            )
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidArgumentError("logit_bias keys must be token ids", param="logit_bias")
            _finite(bias, "logit_bias")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidArgumentError("logit_bias values must be in [-100, 100]",
                                           param="logit_bias")  # fmt: skip


def _finite(value: float, name: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be a finite number", param=name)
