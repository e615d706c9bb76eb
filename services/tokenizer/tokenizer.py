"""The model's tokenizer: text <-> token ids, special tokens and the chat template, torch-free.

One ``Tokenizer`` wraps a Hugging Face ``tokenizers.Tokenizer`` (the Rust BPE) plus what the
serving path needs around it: the special token ids (bos, eos, every id that ends generation,
pad), whether ``encode`` prepends BOS, the chat template and the model's context length. Its
token ids equal ``transformers``' for the same model, which the tests check.

Loading (:meth:`Tokenizer.load`) by :class:`ModelSource` kind:

1. ``"gguf"``: rebuild the tokenizer from the file's metadata (see ``gguf_vocab.py``); the
   context length is ``<arch>.context_length``.
2. ``"hf"``: ``tokenizer.json`` as is (its post-processor decides whether BOS is added: like
   transformers 5, the ``add_bos_token`` flag of ``tokenizer_config.json`` is ignored then);
   ``tokenizer_config.json`` for the named special tokens; the chat template from
   ``chat_template.jinja`` or ``tokenizer_config.json``; ``generation_config.json`` for extra EOS
   ids; ``config.json``'s ``max_position_embeddings`` for the context length.
3. ``"dummy"``: dummy weights have no vocabulary, so loading raises :class:`ModelLoadError`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from services.common.errors import InvalidArgumentError, ModelLoadError
from services.common.model_source import ModelSource
from services.tokenizer.chat_template import ChatTemplate
from services.tokenizer.gguf_vocab import load_gguf_vocab

logger = logging.getLogger(__name__)

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encode, decode and apply the chat template for one model.

    Attributes:
        name: the model name.
        vocab_size: number of ids, added tokens included.
        bos_token_id / eos_token_id / pad_token_id / unk_token_id: named special ids, or None.
        eos_token_ids: every id that ends generation (EOS first), as a tuple.
        special_tokens: every special added token, text -> id.
        all_special_ids: their ids; ``decode(skip_special_tokens=True)`` drops exactly these.
        chat_template: the Jinja template text, or None.
        add_bos_token: whether ``encode(..., add_special_tokens=True)`` prepends BOS.
        context_length: the model's context window in tokens, or None when unknown.
    """

    __slots__ = (
        "name", "vocab_size", "bos_token_id", "eos_token_id", "eos_token_ids", "pad_token_id",
        "unk_token_id", "special_tokens", "all_special_ids", "chat_template", "add_bos_token",
        "context_length", "_backend", "_template", "_template_tokens",
    )

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        name: str,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
        context_length: int | None = None,
    ) -> None:
        self._backend = backend
        self.name = name
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        eos = [] if eos_token_id is None else [eos_token_id]
        eos += [i for i in extra_eos_token_ids if i not in eos and 0 <= i < self.vocab_size]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.special_tokens: dict[str, int] = {
            token.content: token_id
            for token_id, token in sorted(backend.get_added_tokens_decoder().items())
            if token.special
        }
        self.all_special_ids: frozenset[int] = frozenset(self.special_tokens.values())
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.context_length = context_length
        self._template = ChatTemplate(chat_template) if chat_template else None
        named = {
            "bos_token": bos_token_id,
            "eos_token": eos_token_id,
            "unk_token": unk_token_id,
            "pad_token": pad_token_id,
        }
        self._template_tokens: dict[str, str] = {
            key: text
            for key, token_id in named.items()
            if token_id is not None and (text := backend.id_to_token(token_id)) is not None
        }

    def use_chat_template(self, source: str) -> None:
        """Render chats with ``source`` instead of the model's own template (``--chat-template``);
        ModelLoadError when it does not compile."""
        self._template = ChatTemplate(source)
        self.chat_template = source

    # ----------------------------------------------------------------------------- loading

    @classmethod
    def load(cls, source: ModelSource) -> Tokenizer:
        """The tokenizer of a resolved model; ModelLoadError when it has none or is unreadable."""
        if source.kind == "gguf":
            return cls._load_gguf(source)
        if source.kind == "hf":
            return cls._load_hf(source)
        if source.kind == "dummy":
            raise ModelLoadError(
                f"dummy weights ({source.name}) have no tokenizer; serve a GGUF file or a "
                "Hugging Face folder, or send token ids"
            )
        raise ModelLoadError(f"unknown model source kind {source.kind!r}")

    @classmethod
    def _load_gguf(cls, source: ModelSource) -> Tokenizer:
        vocab = load_gguf_vocab(source.path)
        return cls(
            vocab.backend,
            name=source.name,
            bos_token_id=vocab.bos_token_id,
            eos_token_id=vocab.eos_token_id,
            pad_token_id=vocab.pad_token_id,
            unk_token_id=vocab.unk_token_id,
            extra_eos_token_ids=vocab.extra_eos_token_ids,
            chat_template=vocab.chat_template,
            add_bos_token=vocab.add_bos_token,
            context_length=vocab.context_length,
        )

    @classmethod
    def _load_hf(cls, source: ModelSource) -> Tokenizer:
        folder = Path(source.path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"{folder} has no tokenizer.json (Tandem needs the fast tokenizer file)"
            )
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception on a bad file
            raise ModelLoadError(f"cannot load {tokenizer_file}: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        named = {key: _token_text(config.get(key)) for key in _NAMED_SPECIAL_TOKENS}
        _add_missing_special_tokens(backend, [t for t in named.values() if t is not None])
        ids = {key: _token_id(backend, text) for key, text in named.items()}
        # Like transformers, tokenizer.json's post-processor decides BOS/EOS; the add_bos_token /
        # add_eos_token flags of tokenizer_config.json are ignored when tokenizer.json exists.
        add_bos = _post_processor_adds(backend, ids["bos_token"])
        generation = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")
        context = model_config.get("max_position_embeddings")
        return cls(
            backend,
            name=source.name,
            bos_token_id=ids["bos_token"],
            eos_token_id=ids["eos_token"],
            pad_token_id=ids["pad_token"],
            unk_token_id=ids["unk_token"],
            extra_eos_token_ids=_int_list(generation.get("eos_token_id")),
            chat_template=_hf_chat_template(folder, config),
            add_bos_token=add_bos,
            context_length=int(context) if isinstance(context, int) else None,
        )

    # ----------------------------------------------------------------------------- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the BOS/EOS the model adds itself."""
        if not isinstance(text, str):
            raise InvalidArgumentError("the text to encode must be a string", param="prompt")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens dropped when ``skip_special_tokens``."""
        ids = list(ids)
        try:
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                bad = next(i for i in ids if not 0 <= i < self.vocab_size)
                raise InvalidArgumentError(
                    f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                    param="token_ids",
                )
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        except TypeError as exc:
            raise InvalidArgumentError("token ids must be integers", param="token_ids") from exc

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` as stored (byte-level spelling: ``"Ġthe"``)."""
        token = None
        if isinstance(token_id, int) and token_id >= 0:
            token = self._backend.id_to_token(token_id)
        if token is None:
            raise InvalidArgumentError(
                f"token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})",
                param="token_ids",
            )
        return token

    def vocabulary(self) -> dict[str, int]:
        """Every token (added ones included) and its id: two tokenizers with equal vocabularies
        map text to the same ids (a draft model's must equal the served model's)."""
        return self._backend.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self._backend.token_to_id(token)

    # ----------------------------------------------------------------------------- chat

    def to_json(self) -> str:
        """The ``tokenizers`` library's JSON of this tokenizer (what llguidance builds its token
        trie from for structured outputs)."""
        return self._backend.to_str()

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt text of a conversation, rendered like transformers' apply_chat_template."""
        if self._template is None:
            raise InvalidArgumentError(
                f"model {self.name} has no chat template; send a plain prompt instead",
                param="messages",
            )
        return self._template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self._template_tokens,
            **extra,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation. Like transformers, no BOS/EOS is added: the
        template writes the special tokens it wants, and they are parsed from the text."""
        text = self.apply_chat_template(messages, add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token_id}, eos={self.eos_token_ids}, context={self.context_length})"
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _token_id(backend: BackendTokenizer, text: str | None) -> int | None:
    return None if text is None else backend.token_to_id(text)


def _int_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _add_missing_special_tokens(backend: BackendTokenizer, tokens: Iterable[str]) -> None:
    """Named special tokens that ``tokenizer.json`` does not list as added tokens become special
    added tokens, as transformers does, so they are matched whole in text."""
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    missing = [
        AddedToken(token, normalized=False, special=True)
        for token in dict.fromkeys(tokens)
        if token not in added
    ]
    if missing:
        logger.debug("adding named special tokens %s", [t.content for t in missing])
        backend.add_special_tokens(missing)


def _post_processor_adds(backend: BackendTokenizer, bos_id: int | None) -> bool:
    """Whether the file's own post-processor prepends BOS (probe: encode an empty string)."""
    if bos_id is None:
        return False
    ids = backend.encode("", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja (which wins, as in transformers), else
    tokenizer_config.json's ``chat_template``, else a legacy chat_template.json."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = by_name.get("default")
    if isinstance(template, str) and template:
        return template
    json_template = _read_json(folder / "chat_template.json").get("chat_template")
    return json_template if isinstance(json_template, str) and json_template else None
