"""Fit a prompt into the model's context window (docs/request-lifecycle.md, step 3).

A request needs ``len(prompt) + max_tokens <= context_length`` tokens. Plain completions are
never changed: :func:`fit_prompt` accepts or rejects them. Chats get a sliding window,
:func:`fit_chat`:

1. If ``max_tokens >= context_length`` no prompt can fit: reject (``param="max_tokens"``).
2. Render and encode the whole conversation; if it fits, use it as is.
3. Otherwise split the messages into the kept part and droppable turns:

   - every ``system`` message is kept, wherever it stands;
   - a *turn* is a ``user`` message together with the non-system messages that follow it up to
     the next ``user`` message (the assistant's reply, tool results); messages before the first
     user message form a turn of their own;
   - the turn holding the last user message (and everything after it) is never dropped.

4. Drop the fewest oldest whole turns that make the rendered prompt fit. Rendering fewer turns
   never yields more tokens, so the fewest is found by bisection (a few encodes, not one per
   turn). ``dropped_messages`` counts the messages removed.
5. If the prompt does not fit even with every droppable turn gone, reject with
   ``param="messages"`` and a message naming the context length.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.common.errors import InvalidArgumentError
from services.tokenizer.chat_template import validate_messages

logger = logging.getLogger(__name__)


class ChatEncoder(Protocol):
    """What fitting needs from a tokenizer."""

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class FittedPrompt:
    """A prompt that fits: its ids and how many chat messages were dropped to make it fit."""

    token_ids: tuple[int, ...]
    dropped_messages: int = 0


def fit_prompt(token_ids: Sequence[int], *, max_tokens: int, context_length: int) -> FittedPrompt:
    """Accept a plain prompt if ``len(token_ids) + max_tokens <= context_length``, else raise."""
    _check_budget(max_tokens, context_length)
    if not token_ids:
        raise InvalidArgumentError("the prompt must contain at least one token", param="prompt")
    if len(token_ids) + max_tokens > context_length:
        raise InvalidArgumentError(
            f"this model's context length is {context_length} tokens, but the prompt has "
            f"{len(token_ids)} tokens and max_tokens is {max_tokens}; shorten the prompt or "
            "lower max_tokens",
            param="prompt",
        )
    return FittedPrompt(tuple(token_ids), 0)


def fit_chat(
    tokenizer: ChatEncoder,
    messages: Sequence[Mapping[str, Any]],
    *,
    max_tokens: int,
    context_length: int,
) -> FittedPrompt:
    """Encode a conversation, dropping the oldest whole turns until it leaves room for
    ``max_tokens`` (the policy in this module's docstring)."""
    _check_budget(max_tokens, context_length)
    chat = validate_messages(messages)
    budget = context_length - max_tokens
    full = tokenizer.encode_chat(chat)
    if len(full) <= budget:
        return FittedPrompt(tuple(full), 0)

    turns = _droppable_turns(chat)

    def encode_without(dropped_turns: int) -> list[int]:
        removed = {i for turn in turns[:dropped_turns] for i in turn}
        return tokenizer.encode_chat([m for i, m in enumerate(chat) if i not in removed])

    # Bisection for the fewest dropped turns that fit: lo does not fit, hi is the candidate.
    lo, hi = 0, len(turns)
    shortest = encode_without(hi) if hi else full
    if len(shortest) > budget:
        raise InvalidArgumentError(
            f"this model's context length is {context_length} tokens; even after dropping all "
            f"earlier turns the conversation needs {len(shortest)} prompt tokens plus max_tokens "
            f"{max_tokens}; shorten the system prompt or the last message, or lower max_tokens",
            param="messages",
        )
    best = shortest
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ids = encode_without(mid)
        if len(ids) <= budget:
            hi, best = mid, ids
        else:
            lo = mid
    dropped = sum(len(turn) for turn in turns[:hi])
    logger.info(
        "dropped %d oldest messages (%d turns) to fit %d + %d tokens into %d",
        dropped, hi, len(best), max_tokens, context_length,
    )
    return FittedPrompt(tuple(best), dropped)


def _check_budget(max_tokens: int, context_length: int) -> None:
    if context_length < 1:
        raise ValueError(f"context_length must be positive, got {context_length}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidArgumentError("max_tokens must be a positive integer", param="max_tokens")
    if max_tokens >= context_length:
        raise InvalidArgumentError(
            f"max_tokens ({max_tokens}) must be smaller than this model's context length "
            f"({context_length} tokens), which also has to hold the prompt",
            param="max_tokens",
        )


def _droppable_turns(chat: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """The turns that may be dropped, oldest first, each as a list of message indices.

    System messages are never in a turn. Everything from the last user message on is protected
    (from the last non-system message when there is no user message).
    """
    users = [i for i, m in enumerate(chat) if m["role"] == "user"]
    others = [i for i, m in enumerate(chat) if m["role"] != "system"]
    protected_from = users[-1] if users else (others[-1] if others else len(chat))
    turns: list[list[int]] = []
    for i, message in enumerate(chat[:protected_from]):
        if message["role"] == "system":
            continue
        if message["role"] == "user" or not turns:
            turns.append([i])
        else:
            turns[-1].append(i)
    return turns
