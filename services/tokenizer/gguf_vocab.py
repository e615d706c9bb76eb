"""Build a Hugging Face ``tokenizers.Tokenizer`` from the tokenizer metadata of a GGUF file.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, the merges, per-token types and
the special token ids under llama.cpp's key names (``tokenizer.ggml.*``). We rebuild the same
tokenizer that ``transformers`` builds from those keys
(``transformers/integrations/gguf/gguf_tokenizer_mapping.py``), because transformers is our
correctness reference: Tandem's token ids must equal ``AutoTokenizer.from_pretrained(folder,
gguf_file=...)``'s.

Supported ``tokenizer.ggml.model`` values:

- ``"gpt2"``: byte-level BPE. Tokens spelled outside the GPT-2 byte alphabet are re-spelled from
  their UTF-8 bytes. The pre-tokenizer depends on ``tokenizer.ggml.pre``: the names transformers
  maps to a split regex (``llama-bpe``, ``qwen2``, ``gpt-4o``, ``tekken``, ...) get that regex,
  every other name (``smollm``, ``default``, ``gpt2``, ...) gets the plain GPT-2 byte-level
  regex, as in transformers.
- ``"llama"``: SentencePiece-style BPE with byte fallback, merges taken from the file or rebuilt
  from the vocabulary, in three flavours by ``general.architecture``, as transformers builds them
  (``GGUF_SENTENCEPIECE_BUILDERS``):

  - Gemma (``gemma``, ``gemma2``, ``gemma3``): no prefix space; a normalizer spells spaces ``▁``.
    Tokens of two or more spaces are stored as real spaces and are respelled ``▁▁...``, and the
    rebuilt merges are ranked by the tokens' order in the file (Gemma's scores do not follow its
    merge order). A file without ``tokenizer.chat_template`` gets Gemma's own template
    (:data:`~services.tokenizer.chat_template.GEMMA_CHAT_TEMPLATE`), and ``<end_of_turn>``
    ends generation too, as in Gemma's ``generation_config``;
  - Phi-3: a normalizer prepends ``▁`` and spells spaces ``▁`` (no pre-tokenizer);
  - the rest (Llama 2, Mistral, ...): a ``▁`` metaspace before the first piece, merges from the
    token scores.

Anything else raises :class:`ModelLoadError`.

Building, step by step:

1. Read the ``tokenizer.*`` keys, ``general.architecture`` and ``<arch>.context_length``.
2. Build the BPE model, pre-tokenizer and decoder for the tokenizer type.
3. Add tokens typed CONTROL (3) as special added tokens and USER_DEFINED (4) as plain added
   tokens, so text containing them keeps them whole; then the named bos/eos/unk/pad tokens if
   they are not added yet.
4. Install a post-processor that prepends BOS / appends EOS per ``add_bos_token`` /
   ``add_eos_token``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from services.common.errors import ModelLoadError
from services.tokenizer.chat_template import GEMMA_CHAT_TEMPLATE

logger = logging.getLogger(__name__)

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ``tokenizer.ggml.pre`` -> split regex, as in transformers' GGUF_PRE_TOKENIZER_SPLITS. Names not
# listed here (smollm, default, gpt2, starcoder, ...) keep the GPT-2 byte-level regex.
PRE_TOKENIZER_SPLITS: Mapping[str, str] = {
    **dict.fromkeys(
        (
            "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
            "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}

_SPECIAL_ID_KEYS: Mapping[str, str] = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
}
# Ids that end a turn in llama.cpp besides EOS ("end of turn", "end of message").
_EXTRA_EOS_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
GEMMA_END_OF_TURN = "<end_of_turn>"


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """Everything the tokenizer needs from a GGUF file.

    Attributes:
        backend: the rebuilt ``tokenizers.Tokenizer``.
        architecture: ``general.architecture`` (e.g. ``"llama"``).
        tokenizer_model: ``tokenizer.ggml.model`` (``"gpt2"`` or ``"llama"``).
        pre_tokenizer: ``tokenizer.ggml.pre`` or None.
        bos_token_id / eos_token_id / unk_token_id / pad_token_id: named special ids, or None.
        extra_eos_token_ids: end-of-turn / end-of-message ids that also end generation.
        add_bos_token / add_eos_token: whether ``encode`` adds them (the post-processor does).
        chat_template: ``tokenizer.chat_template`` or None.
        context_length: ``<architecture>.context_length`` or None.
    """

    backend: BackendTokenizer
    architecture: str
    tokenizer_model: str
    pre_tokenizer: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    extra_eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    context_length: int | None


def load_gguf_vocab(path: str | Path) -> GGUFVocab:
    """Read ``path``'s tokenizer metadata and rebuild its tokenizer; ModelLoadError on failure."""
    meta = read_tokenizer_metadata(path)
    return build_gguf_vocab(meta, source=str(path))


def read_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    """The ``tokenizer.*`` keys, ``general.architecture`` and the context length, as values."""
    from services.common.config_reader import fast_gguf_reader  # deferred: pulls in numpy

    try:
        reader = fast_gguf_reader()(str(path), "r")
        architecture = _field(reader, "general.architecture") or ""
        wanted = {"general.architecture", f"{architecture}.context_length"}
        return {
            name: field.contents()
            for name, field in reader.fields.items()
            if name.startswith("tokenizer.") or name in wanted
        }
    except Exception as exc:  # a truncated or corrupt file fails in many ways inside gguf/numpy
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc


def _field(reader: Any, name: str) -> Any:
    field = reader.fields.get(name)
    return None if field is None else field.contents()


def build_gguf_vocab(meta: Mapping[str, Any], *, source: str = "<gguf>") -> GGUFVocab:
    """Build the tokenizer that GGUF metadata (from :func:`read_tokenizer_metadata`) describes."""
    architecture = str(meta.get("general.architecture") or "")
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(
            f"GGUF file {source} has no tokenizer vocabulary (tokenizer.ggml.tokens)"
        )
    token_types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or ()
    pre = meta.get("tokenizer.ggml.pre")
    ids = {name: _token_id(meta.get(key), len(tokens)) for name, key in _SPECIAL_ID_KEYS.items()}
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if model == "gpt2":
        backend = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges"), meta, source)
        if pre in PRE_TOKENIZER_SPLITS:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
    elif model == "llama":
        merges = meta.get("tokenizer.ggml.merges")
        if architecture in GEMMA_ARCHITECTURES:
            backend = _gemma_bpe(tokens, merges)
        else:
            backend = _sentencepiece_bpe(tokens, merges, meta, source)
            if architecture == "phi3":
                _phi3_spacing(backend)
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        add_bos = True if add_bos is None else add_bos
    else:
        raise ModelLoadError(
            f"GGUF file {source} uses tokenizer model {model!r}; Tandem supports 'gpt2' "
            "(byte-level BPE) and 'llama' (sentencepiece BPE)"
        )
    _add_typed_tokens(backend, tokens, token_types, byte_level=model == "gpt2")
    _add_named_special_tokens(backend, tokens, ids)
    add_bos = bool(add_bos) and ids["bos"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token")) and ids["eos"] is not None
    backend.post_processor = bos_eos_processor(
        (tokens[ids["bos"]], ids["bos"]) if add_bos and ids["bos"] is not None else None,
        (tokens[ids["eos"]], ids["eos"]) if add_eos and ids["eos"] is not None else None,
    )
    extra_eos = tuple(
        token_id
        for key in _EXTRA_EOS_KEYS
        if (token_id := _token_id(meta.get(key), len(tokens))) is not None
    )
    chat_template = meta.get("tokenizer.chat_template")
    if architecture in GEMMA_ARCHITECTURES:
        end_of_turn = backend.token_to_id(GEMMA_END_OF_TURN)
        if end_of_turn is not None and end_of_turn not in extra_eos:
            extra_eos += (end_of_turn,)
        chat_template = chat_template or GEMMA_CHAT_TEMPLATE
    context = meta.get(f"{architecture}.context_length")
    logger.debug("built %s tokenizer (pre=%s, %d tokens) from %s", model, pre, len(tokens), source)
    return GGUFVocab(
        backend=backend,
        architecture=architecture,
        tokenizer_model=str(model),
        pre_tokenizer=None if pre is None else str(pre),
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        unk_token_id=ids["unk"],
        pad_token_id=ids["pad"],
        extra_eos_token_ids=extra_eos,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=chat_template,
        context_length=None if context is None else int(context),
    )


def _token_id(value: Any, vocab_size: int) -> int | None:
    if value is None:
        return None
    token_id = int(value)
    return token_id if 0 <= token_id < vocab_size else None


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (the byte-level BPE alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def _byte_level_bpe(
    tokens: list[str], merges: list[str] | None, meta: Mapping[str, Any], source: str
) -> BackendTokenizer:
    spelling = bytes_to_unicode()
    alphabet = frozenset(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index  # a duplicate keeps its last id, as in transformers
    pairs = _merges(tokens, merges, meta, source)
    backend = BackendTokenizer(
        BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    tokens: list[str], merges: list[str] | None, meta: Mapping[str, Any], source: str
) -> BackendTokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = _merges(tokens, merges, meta, source)
    backend = BackendTokenizer(
        BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    # transformers' LlamaTokenizer (legacy=False, add_prefix_space=True): a "▁" before the first
    # piece only, and the decoder strips it again. It ignores tokenizer.ggml.add_space_prefix.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    return backend


def _gemma_bpe(tokens: list[str], merges: list[str] | None) -> BackendTokenizer:
    """transformers' ``gemma_tokenizer`` + ``GemmaTokenizer``: no prefix space, spaces spelled
    ``▁`` by the normalizer, all-space tokens respelled, merges ranked by file order."""
    spelled = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = merges_from_scores(spelled, [-float(i) for i in range(len(spelled))])
    backend = BackendTokenizer(
        BPE(
            vocab=vocab, merges=pairs, fuse_unk=True, unk_token="<unk>", byte_fallback=True,
            dropout=None,
        )
    )
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


def _phi3_spacing(backend: BackendTokenizer) -> None:
    """transformers' ``phi3_tokenizer``: the prefix space comes from a normalizer (so ``"  hi"``
    keeps all its spaces), not from the metaspace pre-tokenizer."""
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.pre_tokenizer = None


def _merges(
    tokens: list[str], merges: list[str] | None, meta: Mapping[str, Any], source: str
) -> list[tuple[str, str]]:
    if merges:
        pairs = []
        for merge in merges:
            left, sep, right = merge.partition(" ")
            if not sep:
                raise ModelLoadError(f"GGUF file {source} has a malformed merge {merge!r}")
            pairs.append((left, right))
        return pairs
    scores = meta.get("tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise ModelLoadError(f"GGUF file {source} has neither merges nor token scores")
    logger.info("GGUF file %s lists no merges; rebuilding them from the token scores", source)
    return merges_from_scores(tokens, scores)


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary (transformers' ``generate_merges``).

    Every split of every token into two in-vocabulary halves is a merge; merges are ordered by
    the merged token's score (best first), then by the lengths of the halves.
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    token_scores: dict[str, float] = dict(zip(tokens, (float(s) for s in scores)))
    found: list[tuple[str, str, float]] = []
    for merged, score in token_scores.items():
        local = [
            (merged[:i], merged[i:], score)
            for i in range(1, len(merged))
            if merged[:i] in vocab and merged[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_typed_tokens(
    backend: BackendTokenizer, tokens: list[str], token_types: Sequence[int], *, byte_level: bool
) -> None:
    """CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens.

    In a byte-level vocabulary a CONTROL token spelled outside the byte alphabet is a llama.cpp
    mislabel and is skipped, as transformers does.
    """
    alphabet = frozenset(bytes_to_unicode().values()) if byte_level else None
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind == TOKEN_TYPE_CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=True)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types)
        if kind == TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    if user_defined:
        backend.add_tokens(user_defined)


def _add_named_special_tokens(
    backend: BackendTokenizer, tokens: list[str], ids: Mapping[str, int | None]
) -> None:
    """Make bos/eos/unk/pad special added tokens when they are not added tokens already."""
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    missing = []
    for token_id in ids.values():
        if token_id is not None and tokens[token_id] not in added:
            missing.append(AddedToken(tokens[token_id], normalized=False, special=True))
            added.add(tokens[token_id])
    if missing:
        backend.add_special_tokens(missing)


def bos_eos_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """transformers' ``update_post_processor``: ``[bos] $A [eos]`` (and the pair form).

    Args:
        bos: ``(text, id)`` of the BOS token to prepend, or None to prepend nothing.
        eos: ``(text, id)`` of the EOS token to append, or None to append nothing.
    """
    single = f"{bos[0] + ':0 ' if bos else ''}$A:0{' ' + eos[0] + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos[0] + ':1' if bos else ''} $B:1{' ' + eos[0] + ':1' if eos else ''}"
    special = [token for token in (bos, eos) if token is not None]
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(special))
    )
