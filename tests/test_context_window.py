"""Context window fitting (docs/request-lifecycle.md, step 3): exact drop counts with a counting encoder, then the same
policy on SmolLM2's real chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from services.common.errors import InvalidArgumentError
from services.common.model_source import resolve_model
from services.tokenizer.context_window import FittedPrompt, fit_chat, fit_prompt
from services.tokenizer.tokenizer import Tokenizer


class CountingEncoder:
    """Each message is one header token (its role's first letter) plus one token per content
    character; the generation prompt is one token (0). Lengths are easy to do by hand."""

    def __init__(self) -> None:
        self.calls = 0

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        self.calls += 1
        ids: list[int] = []
        for message in messages:
            ids.append(ord(message["role"][0]))
            ids.extend(ord(c) for c in message["content"])
        return ids + ([0] if add_generation_prompt else [])


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


# system 10 tokens, three turns of 20 + 30, final user 10, generation prompt 1: 171 in all.
CHAT = [
    msg("system", "S" * 9),
    msg("user", "1" * 19), msg("assistant", "a" * 29),
    msg("user", "2" * 19), msg("assistant", "b" * 29),
    msg("user", "3" * 19), msg("assistant", "c" * 29),
    msg("user", "q" * 9),
]


@pytest.mark.parametrize(
    ("context_length", "dropped", "length"),
    [
        (181, 0, 171),
        (180, 2, 121),
        (131, 2, 121),
        (130, 4, 71),
        (81, 4, 71),
        (80, 6, 21),
        (31, 6, 21),
    ],
)
def test_drops_fewest_oldest_turns(context_length: int, dropped: int, length: int) -> None:
    fitted = fit_chat(CountingEncoder(), CHAT, max_tokens=10, context_length=context_length)
    assert fitted.dropped_messages == dropped
    assert len(fitted.token_ids) == length
    kept = [CHAT[0], *CHAT[1 + dropped :]]
    assert list(fitted.token_ids) == CountingEncoder().encode_chat(kept)


def test_cannot_fit_even_the_last_turn() -> None:
    with pytest.raises(InvalidArgumentError, match="context length is 30") as info:
        fit_chat(CountingEncoder(), CHAT, max_tokens=10, context_length=30)
    assert info.value.param == "messages"


@pytest.mark.parametrize(("max_tokens", "context_length"), [(200, 200), (201, 200), (0, 200), (-1, 200)])
def test_max_tokens_alone_too_large(max_tokens: int, context_length: int) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        fit_chat(CountingEncoder(), CHAT, max_tokens=max_tokens, context_length=context_length)
    assert info.value.param == "max_tokens"


def test_system_messages_anywhere_are_kept() -> None:
    chat = [
        msg("user", "1" * 19), msg("assistant", "a" * 29),
        msg("system", "S" * 9),
        msg("user", "2" * 19), msg("assistant", "b" * 29),
        msg("user", "q" * 9),
    ]
    fitted = fit_chat(CountingEncoder(), chat, max_tokens=10, context_length=100)
    assert fitted.dropped_messages == 2
    assert list(fitted.token_ids) == CountingEncoder().encode_chat(chat[2:])
    fitted = fit_chat(CountingEncoder(), chat, max_tokens=10, context_length=50)
    assert fitted.dropped_messages == 4
    assert list(fitted.token_ids) == CountingEncoder().encode_chat([chat[2], chat[5]])


def test_turn_includes_tool_messages_and_leading_assistant() -> None:
    chat = [
        msg("assistant", "g" * 9),  # before any user message: a turn of its own (10 tokens)
        msg("user", "1" * 9), msg("assistant", "a" * 9), msg("tool", "t" * 9), msg("assistant", "b" * 9),
        msg("user", "q" * 9),
    ]
    # 10 + 40 + 10 + 1 = 61 tokens.
    assert fit_chat(CountingEncoder(), chat, max_tokens=5, context_length=66).dropped_messages == 0
    assert fit_chat(CountingEncoder(), chat, max_tokens=5, context_length=65).dropped_messages == 1
    assert fit_chat(CountingEncoder(), chat, max_tokens=5, context_length=56).dropped_messages == 1
    assert fit_chat(CountingEncoder(), chat, max_tokens=5, context_length=55).dropped_messages == 5
    assert fit_chat(CountingEncoder(), chat, max_tokens=5, context_length=16).dropped_messages == 5
    with pytest.raises(InvalidArgumentError):
        fit_chat(CountingEncoder(), chat, max_tokens=5, context_length=15)


def test_messages_after_last_user_are_protected() -> None:
    chat = [msg("user", "1" * 9), msg("assistant", "a" * 9), msg("user", "q" * 9), msg("assistant", "p" * 29)]
    # 10 + 10 + 10 + 30 + 1 = 61; dropping the first turn leaves 41.
    fitted = fit_chat(CountingEncoder(), chat, max_tokens=4, context_length=45)
    assert fitted.dropped_messages == 2
    with pytest.raises(InvalidArgumentError):
        fit_chat(CountingEncoder(), chat, max_tokens=4, context_length=44)


def test_without_user_message_the_last_message_is_kept() -> None:
    chat = [msg("system", "S" * 9), msg("assistant", "a" * 9), msg("assistant", "b" * 9)]
    fitted = fit_chat(CountingEncoder(), chat, max_tokens=1, context_length=22)
    assert fitted.dropped_messages == 1
    assert list(fitted.token_ids) == CountingEncoder().encode_chat([chat[0], chat[2]])


def test_many_turns_bisection_is_minimal_and_cheap() -> None:
    chat = [msg("system", "S" * 9)]
    for turn in range(100):
        chat += [msg("user", "u" * (turn % 7 + 3)), msg("assistant", "a" * (turn % 11 + 5))]
    chat.append(msg("user", "q" * 9))
    encoder = CountingEncoder()
    for context_length in (60, 200, 777, 1300):
        encoder.calls = 0
        fitted = fit_chat(encoder, chat, max_tokens=16, context_length=context_length)
        assert encoder.calls <= 10
        linear = next(
            k for k in range(101)
            if len(CountingEncoder().encode_chat([chat[0], *chat[1 + 2 * k :]])) + 16 <= context_length
        )
        assert fitted.dropped_messages == 2 * linear


def test_invalid_messages_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        fit_chat(CountingEncoder(), [{"role": "user"}], max_tokens=1, context_length=10)
    assert info.value.param == "messages"


# ------------------------------------------------------------------------------ fit_prompt


def test_fit_prompt() -> None:
    assert fit_prompt([1, 2, 3], max_tokens=7, context_length=10) == FittedPrompt((1, 2, 3), 0)
    with pytest.raises(InvalidArgumentError, match="context length is 10") as info:
        fit_prompt([1, 2, 3, 4], max_tokens=7, context_length=10)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidArgumentError) as info:
        fit_prompt([], max_tokens=1, context_length=10)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidArgumentError) as info:
        fit_prompt([1], max_tokens=10, context_length=10)
    assert info.value.param == "max_tokens"


# ------------------------------------------------------------------------------ real template


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(resolve_model("default"))


def test_smollm2_chat_window(tok: Tokenizer) -> None:
    sentence = "This sentence is padding for the context window test. "
    chat = [
        msg("user", "First question? " + sentence * 3), msg("assistant", "First answer. " + sentence * 4),
        msg("user", "Second question? " + sentence * 2), msg("assistant", "Second answer. " + sentence),
        msg("user", "Last question?"),
    ]
    full = tok.encode_chat(chat)
    without_one = tok.encode_chat(chat[2:])
    without_two = tok.encode_chat(chat[4:])
    assert len(full) > len(without_one) > len(without_two)
    max_tokens = 64
    fitted = fit_chat(tok, chat, max_tokens=max_tokens, context_length=len(full) + max_tokens)
    assert fitted == FittedPrompt(tuple(full), 0)
    fitted = fit_chat(tok, chat, max_tokens=max_tokens, context_length=len(full) + max_tokens - 1)
    assert fitted == FittedPrompt(tuple(without_one), 2)
    fitted = fit_chat(tok, chat, max_tokens=max_tokens, context_length=len(without_one) + max_tokens - 1)
    assert fitted == FittedPrompt(tuple(without_two), 4)
    # The default system prompt the template adds is part of what must fit.
    assert tok.decode(list(fitted.token_ids)).startswith("system\nYou are a helpful AI assistant")
    with pytest.raises(InvalidArgumentError, match=f"context length is {len(without_two) + max_tokens - 1}"):
        fit_chat(tok, chat, max_tokens=max_tokens, context_length=len(without_two) + max_tokens - 1)
