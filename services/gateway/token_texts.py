"""How logprob entries name their tokens: ``"token"`` text and ``"bytes"`` for a token id.

Workers return logprobs as token ids (``TokenLogprob``); OpenAI's format wants each token's text
and UTF-8 bytes. Two renderings:

1. :class:`TokenIdTexts` (no vocabulary at hand): ``"token_id:<id>"``, the convention of vLLM's
   ``--return-tokens-as-token-ids``, so clients can still map ids back themselves.
2. :class:`VocabTexts`: the model's own vocabulary, loaded in the gateway (torch-free) when
   ``--model`` names it. A byte-level BPE token that is only part of a UTF-8 character renders
   as ``"bytes:\\xe2\\x80"`` (OpenAI's convention) with its exact bytes.

:func:`load_token_texts` loads the vocabulary and checks it against the tokenizer service's
ModelInfo, falling back to token ids when they disagree.
"""

from __future__ import annotations

import logging
from typing import Protocol

from services.common.errors import TandemError
from services.common.pb import common_pb2, tokenizer_pb2
from services.gateway.openai_responses import TokenLogprob, TopLogprob

logger = logging.getLogger(__name__)

_CACHE_SIZE = 65536


class TokenTexts(Protocol):
    """Renders one token id as ``(text, bytes or None)``; None bytes means ``text.encode()``."""

    def render(self, token_id: int) -> tuple[str, bytes | None]: ...


class TokenIdTexts:
    """``token_id:<id>`` for every token."""

    def render(self, token_id: int) -> tuple[str, bytes | None]:
        return f"token_id:{token_id}", None


class VocabTexts:
    """Token texts from the model's vocabulary (a ``services.tokenizer`` Tokenizer)."""

    def __init__(self, tokenizer: object) -> None:
        from services.tokenizer.gguf_vocab import bytes_to_unicode

        self._tokenizer = tokenizer
        self._unspell = {ch: byte for byte, ch in bytes_to_unicode().items()}
        self._cache: dict[int, tuple[str, bytes | None]] = {}

    def render(self, token_id: int) -> tuple[str, bytes | None]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._render(token_id)
            if len(self._cache) < _CACHE_SIZE:
                self._cache[token_id] = hit
        return hit

    def _render(self, token_id: int) -> tuple[str, bytes | None]:
        tok = self._tokenizer
        try:
            piece: str = tok.id_to_token(token_id)  # type: ignore[attr-defined]
            text: str = tok.decode([token_id], skip_special_tokens=False)  # type: ignore[attr-defined]
        except TandemError:
            return f"token_id:{token_id}", None
        if piece and all(ch in self._unspell for ch in piece):  # byte-level BPE spelling
            raw = bytes(self._unspell[ch] for ch in piece)
            try:
                return raw.decode("utf-8"), raw
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw
        return text, None


def load_token_texts(model: str | None, info: tokenizer_pb2.ModelInfo | None) -> TokenTexts:
    """A vocabulary rendering for ``model`` (a ``--model`` value), else token ids.

    Blocking (reads the model's tokenizer): call it in a thread.
    """
    if not model:
        return TokenIdTexts()
    try:
        from services.common.model_source import resolve_model
        from services.tokenizer.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(resolve_model(model))
    except TandemError as err:
        logger.warning("logprob tokens rendered as ids: cannot load %s: %s", model, err.message)
        return TokenIdTexts()
    if info is not None and info.vocab_size and info.vocab_size != tokenizer.vocab_size:
        logger.warning(
            "logprob tokens rendered as ids: %s has %d tokens but the tokenizer service serves %d",
            model, tokenizer.vocab_size, info.vocab_size,
        )  # fmt: skip
        return TokenIdTexts()
    logger.info("logprob tokens rendered with the vocabulary of %s", tokenizer.name)
    return VocabTexts(tokenizer)


def to_openai_logprob(lp: common_pb2.TokenLogprob, texts: TokenTexts) -> TokenLogprob:
    """A worker's ``TokenLogprob`` as the gateway's OpenAI-side value."""
    text, raw = texts.render(lp.token_id)
    top = []
    for alt in lp.top:
        alt_text, alt_raw = texts.render(alt.token_id)
        top.append(TopLogprob(alt_text, float(alt.logprob), alt_raw))
    return TokenLogprob(text, float(lp.logprob), tuple(top), raw)
