"""Prompt logprobs on the OpenAI side: vLLM's ``prompt_logprobs`` field, and ``echo`` with
``logprobs`` on ``/v1/completions`` (what evaluation harnesses use to score loglikelihoods).

The worker that prefills a prompt (a prefill worker, in its ``PrefillResponse``; a decode worker
prefilling locally, in the first ``GenerateResponse``) sends one ``TokenLogprob`` per prompt
token after the first: the token, its logprob given the tokens before it (the model's float32
log-softmax, no sampling processor), its rank in the vocabulary and the top k. This module turns
them into the two shapes clients read:

- vLLM's: ``[null, {"<token id>": {"logprob", "rank", "decoded_token"}, ...}, ...]``, one entry per
  prompt token, the first null (nothing precedes it), each dict holding the prompt's own token
  and the top k (on chat completions at the response's top level, on completions per choice);
- OpenAI's legacy completions ``logprobs`` with ``echo``: the prompt's tokens first in
  ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` (the first token's logprob
  and alternatives null), then the completion's.

Neither is streamed (as in vLLM: a 400 asks for ``stream: false``): the prompt's logprobs reach the
gateway with the prefill's reply, which a streamed response would have to wait for anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.pb import common_pb2
from services.gateway.openai_responses import JsonDict, TokenLogprob, completion_logprobs
from services.gateway.token_texts import TokenTexts

LOGPROB_FLOOR = -9999.0
"""What a -inf logprob is sent as (JSON has no infinity), as for sampled tokens."""


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """One prompt position: its token and, after the first position, the token's logprob, rank
    and the top alternatives ``(token id, text, logprob)``, most likely first."""

    token_id: int
    token: str
    logprob: float | None = None
    rank: int | None = None
    top: tuple[tuple[int, str, float], ...] = ()


def from_workers(
    prompt_ids: Sequence[int], scored: Sequence[common_pb2.TokenLogprob], texts: TokenTexts
) -> tuple[PromptLogprob, ...]:
    """Every prompt position: the first token alone, then the worker's scored positions."""
    first = [PromptLogprob(int(prompt_ids[0]), texts.render(int(prompt_ids[0]))[0])] if prompt_ids else []
    rest = [
        PromptLogprob(
            int(lp.token_id), texts.render(int(lp.token_id))[0], float(lp.logprob), int(lp.rank),
            tuple((int(t.token_id), texts.render(int(t.token_id))[0], float(t.logprob))
                  for t in lp.top),
        )  # fmt: skip
        for lp in scored
    ]
    return tuple(first + rest)


def vllm_prompt_logprobs(entries: Sequence[PromptLogprob]) -> list[JsonDict | None]:
    """vLLM's ``prompt_logprobs`` list (see the module docstring)."""
    out: list[JsonDict | None] = []
    for entry in entries:
        if entry.logprob is None:
            out.append(None)
            continue
        position: JsonDict = {}
        for rank, (token_id, text, value) in enumerate(entry.top, start=1):
            position[str(token_id)] = {"logprob": _safe(value), "rank": rank, "decoded_token": text}
        position[str(entry.token_id)] = {
            "logprob": _safe(entry.logprob), "rank": entry.rank, "decoded_token": entry.token,
        }  # fmt: skip
        out.append(position)
    return out


def echo_logprobs(entries: Sequence[PromptLogprob], completion: Sequence[TokenLogprob],
                  completion_offset: int) -> JsonDict:  # fmt: skip
    """Legacy completions ``logprobs`` for an echoed prompt followed by its completion: the
    prompt's positions first (offsets from 0), the completion's from ``completion_offset`` (the
    echoed text's length)."""
    tail = completion_logprobs(completion, text_offset_start=completion_offset)
    offsets, offset = [], 0
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries] + tail["tokens"],
        "token_logprobs": [None if e.logprob is None else _safe(e.logprob) for e in entries]
        + tail["token_logprobs"],
        "top_logprobs": [
            None if e.logprob is None else {text: _safe(value) for _, text, value in e.top}
            for e in entries
        ]
        + tail["top_logprobs"],
        "text_offset": offsets + tail["text_offset"],
    }


def _safe(value: float) -> float:
    return value if value == value and value >= LOGPROB_FLOOR else LOGPROB_FLOOR
