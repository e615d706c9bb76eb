"""The prompts a load level sends: synthetic prompts of exact token lengths, or a JSONL file.

Synthetic prompts (``--input-tokens N [--input-tokens-stdev S]``): each request's length is
drawn from a normal distribution (mean N, standard deviation S, rounded, at least 1), then

1. sample that many random vocabulary ids (special tokens excluded) and decode them to text;
2. re-encode the text: decoding and re-encoding do not round-trip (pieces merge or split), so
   keep the first N ids when there are more, or append fresh random ids when there are fewer;
3. repeat until the text encodes to exactly N tokens.

Lengths are counted with the load generator's tokenizer (``--tokenizer``; Tandem's default
model's by default), as ``encode(text, add_special_tokens=False)``: the prompt text's own tokens.
The server adds what it adds on top: BOS for a text completion on some models, and for chat the
whole chat template around the message, so the server's ``usage.prompt_tokens`` is larger for
chat. For chat the single user message's content is what has N tokens.

``--prompts-file F.jsonl``: one JSON object per line with ``"prompt"`` (a string) or
``"messages"`` (an OpenAI chat list; chat endpoint only) and optionally ``"max_tokens"``. Each
level sends the file's entries in order, cycling when it asks for more than the file has.

Every level of a synthetic sweep gets fresh prompts (seeded by ``--seed`` and the level's
position), so a prefix cache cannot serve a level the prompts of an earlier one, and two servers
compared in one run get the same prompts.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import InvalidArgumentError
from services.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_MAX_ROUNDS = 64  # rounds of step 2 per attempt; one or two suffice in practice
_ATTEMPTS = 8  # fresh samples before giving up on a length


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: a text prompt or chat messages, and its ``max_tokens``.

    ``input_tokens`` is the workload's count of the prompt text (for messages: the sum over the
    message contents), with the load generator's tokenizer.
    """

    max_tokens: int
    input_tokens: int
    prompt: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The request as chat messages: its own, or its prompt as one user message."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]


def token_counter(tokenizer: Tokenizer) -> Callable[[str], int]:
    """``text -> number of tokens`` without special tokens: how this package counts text."""
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


class SyntheticPrompts:
    """Random-token prompts of exact lengths by one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        special = tokenizer.all_special_ids
        self._pool = [i for i in range(tokenizer.vocab_size) if i not in special]
        if not self._pool:
            raise InvalidArgumentError(f"tokenizer {tokenizer.name} has no ordinary tokens")

    def prompt(self, num_tokens: int, rng: random.Random) -> str:
        """A text that encodes to exactly ``num_tokens`` tokens."""
        if num_tokens < 1:
            raise InvalidArgumentError(f"a prompt needs at least 1 token, not {num_tokens}")
        for _ in range(_ATTEMPTS):
            ids = self._sample(num_tokens, rng)
            for _ in range(_MAX_ROUNDS):
                text = self._tokenizer.decode(ids)
                again = self._tokenizer.encode(text, add_special_tokens=False)
                if len(again) == num_tokens:
                    return text
                if len(again) > num_tokens:
                    ids = again[:num_tokens]
                else:
                    ids = again + self._sample(num_tokens - len(again), rng)
        raise InvalidArgumentError(
            f"could not build a prompt of exactly {num_tokens} tokens with {self._tokenizer.name}"
        )

    def _sample(self, count: int, rng: random.Random) -> list[int]:
        return [self._pool[rng.randrange(len(self._pool))] for _ in range(count)]


def draw_length(rng: random.Random, mean: int, stdev: float) -> int:
    """A token length from N(mean, stdev), rounded and at least 1 (exactly ``mean`` at 0)."""
    if stdev <= 0:
        return max(1, mean)
    return max(1, round(rng.gauss(mean, stdev)))


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """The shape of every level's requests."""

    num_prompts: int
    input_tokens: int = 128
    input_tokens_stdev: float = 0.0
    output_tokens: int = 128
    output_tokens_stdev: float = 0.0
    seed: int = 0


class Workload:
    """Hands each level (and the warm-up) its list of :class:`RequestSpec`."""

    def __init__(
        self,
        config: WorkloadConfig,
        tokenizer: Tokenizer,
        file_entries: Sequence[RequestSpec] | None = None,
    ) -> None:
        if config.num_prompts < 1:
            raise InvalidArgumentError("--num-prompts must be at least 1")
        if file_entries is not None and not file_entries:
            raise InvalidArgumentError("the prompts file has no prompts")
        self.config = config
        self._count = token_counter(tokenizer)
        self._synthetic = SyntheticPrompts(tokenizer) if file_entries is None else None
        self._file: list[RequestSpec] = list(file_entries or ())

    def level(self, position: int) -> list[RequestSpec]:
        """The requests of the sweep's ``position``-th level (0-based)."""
        return self._specs(self.config.num_prompts, stream=position)

    def warmup(self, count: int) -> list[RequestSpec]:
        """``count`` requests shaped like the levels' ones, with prompts of their own."""
        return self._specs(count, stream=-1) if count > 0 else []

    def _specs(self, count: int, stream: int) -> list[RequestSpec]:
        if self._synthetic is None:
            return [self._file[i % len(self._file)] for i in range(count)]
        c = self.config
        rng = random.Random(c.seed * 1_000_003 + stream)
        specs = []
        for _ in range(count):
            n_in = draw_length(rng, c.input_tokens, c.input_tokens_stdev)
            n_out = draw_length(rng, c.output_tokens, c.output_tokens_stdev)
            specs.append(RequestSpec(n_out, n_in, prompt=self._synthetic.prompt(n_in, rng)))
        return specs

    def count_tokens(self, text: str) -> int:
        return self._count(text)


def load_prompts_file(
    path: str | Path, tokenizer: Tokenizer, default_max_tokens: int
) -> list[RequestSpec]:
    """The requests of a JSONL prompts file (see the module docstring)."""
    count = token_counter(tokenizer)
    specs = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read the prompts file {path}: {exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise InvalidArgumentError(f"{where}: not JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise InvalidArgumentError(f"{where}: expected a JSON object")
        max_tokens = obj.get("max_tokens", default_max_tokens)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InvalidArgumentError(f"{where}: max_tokens must be a positive integer")
        prompt, messages = obj.get("prompt"), obj.get("messages")
        if isinstance(prompt, str) and messages is None:
            specs.append(RequestSpec(max_tokens, count(prompt), prompt=prompt))
        elif isinstance(messages, list) and messages and prompt is None:
            if not all(isinstance(m, dict) and "role" in m for m in messages):
                raise InvalidArgumentError(f"{where}: messages must be objects with a role")
            tokens = sum(count(_content_text(m.get("content"))) for m in messages)
            specs.append(RequestSpec(max_tokens, tokens, messages=tuple(messages)))
        else:
            raise InvalidArgumentError(
                f'{where}: expected either "prompt" (a string) or "messages" (a chat list)'
            )
    return specs


def _content_text(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""
