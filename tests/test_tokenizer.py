"""Tokenizer parity with transformers: the default SmolLM2 GGUF, a saved Hugging Face folder, and
synthetic GGUF files (another pre-tokenizer, a sentencepiece vocabulary, an unsupported model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.common.errors import InvalidArgumentError, ModelLoadError
from services.common.model_source import ModelSource, resolve_model
from services.tokenizer.gguf_vocab import read_tokenizer_metadata
from services.tokenizer.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! This is a plain English sentence.",
    "  leading and trailing spaces  ",
    " single leading space",
    "trailing space ",
    "line one\nline two\n\n\tindented with a tab\r\nwindows newline\n",
    "\t\ttabs\tbetween\twords",
    "digits 0123456789, 3.14159, 1,000,000 and a  1 and  42",
    "Café naïve résumé façade Ünïcödé Ångström",
    "中文测试：你好，世界！日本語のテキスト。한국어 문장",
    "مرحبا بالعالم، كيف حالك؟",
    "emoji 😀🎉👍🏽 and ZWJ 👨‍👩‍👧‍👦 🏳️‍🌈 🧑🏽‍💻",
    "def f(x):\n    if x:\n        return {'a': [1, 2]}\n    return None\n",
    "text with <|im_start|> inside and <|im_end|> too",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|><|im_start|>x<|endoftext|>",
    "partial <|im_sta rt|> and <|im_start| tokens",
    "don't won't it's I'm we'll they've she'd DON'T",
    "URL https://example.com/a?b=c&d=e#f and mail a.b@c.de",
    "no\u00a0break space, zero\u200bwidth, soft\u00adhyphen",
    "",
    " ",
    "\n\n\n",
]


@pytest.fixture(scope="module")
def default_source() -> ModelSource:
    return resolve_model("default")


@pytest.fixture(scope="module")
def tok(default_source: ModelSource) -> Tokenizer:
    return Tokenizer.load(default_source)


@pytest.fixture(scope="module")
def hf_tok(default_source: ModelSource) -> Any:
    transformers = pytest.importorskip("transformers")
    path = Path(default_source.path)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# ------------------------------------------------------------------------------ default GGUF


def test_default_model_attributes(tok: Tokenizer) -> None:
    assert tok.name == "SmolLM2-135M-Instruct"
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.id_to_token(1) == "<|im_start|>"
    assert tok.eos_token_id == 2 and tok.id_to_token(2) == "<|im_end|>"
    assert tok.eos_token_ids == (2,)
    assert tok.pad_token_id == 2
    assert tok.add_bos_token is False
    assert tok.context_length == 8192
    assert tok.special_tokens["<|im_start|>"] == 1
    assert tok.special_tokens["<|endoftext|>"] == 0
    assert tok.all_special_ids == frozenset(range(17))
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    assert tok.encode(text) == hf_tok(text).input_ids
    assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False).input_ids


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level BPE round-trips exactly
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)


@pytest.mark.slow
def test_special_token_text_is_one_token(tok: Tokenizer) -> None:
    ids = tok.encode("a<|im_start|>b")
    assert 1 in ids
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "a<|im_start|>b"


@pytest.mark.slow
def test_id_to_token_matches_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    for token_id in (0, 1, 2, 100, 198, 1000, 49151):
        assert tok.id_to_token(token_id) == hf_tok.convert_ids_to_tokens(token_id)
        assert tok.token_to_id(tok.id_to_token(token_id)) == token_id


def test_invalid_ids_raise(tok: Tokenizer) -> None:
    for bad in (-1, 49152, 10**9):
        with pytest.raises(InvalidArgumentError) as info:
            tok.decode([5, bad])
        assert info.value.param == "token_ids"
        with pytest.raises(InvalidArgumentError):
            tok.id_to_token(bad)
    with pytest.raises(InvalidArgumentError):
        tok.encode(123)  # type: ignore[arg-type]


def test_dummy_source_has_no_tokenizer() -> None:
    with pytest.raises(ModelLoadError):
        Tokenizer.load(ModelSource("dummy", "llama-8b", "dummy-llama-8b"))


def test_tokenizer_package_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import services.tokenizer.tokenizer, services.tokenizer.detokenizer\n"
        "import services.tokenizer.context_window, services.tokenizer.chat_template\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# ------------------------------------------------------------------------------ HF folder


def _save_hf_folder(hf_tok: Any, folder: Path, **config_overrides: Any) -> None:
    hf_tok.save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    if config_overrides:
        path = folder / "tokenizer_config.json"
        config = json.loads(path.read_text())
        config.update(config_overrides)
        path.write_text(json.dumps(config))


@pytest.mark.slow
def test_hf_folder_matches_transformers(hf_tok: Any, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    _save_hf_folder(hf_tok, tmp_path)
    source = resolve_model(str(tmp_path))
    assert source.kind == "hf"
    tok = Tokenizer.load(source)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert tok.encode(text) == reference(text).input_ids
        assert tok.decode(tok.encode(text)) == reference.decode(tok.encode(text), skip_special_tokens=True)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 0) and tok.pad_token_id == 2
    assert tok.context_length == 2048
    assert tok.chat_template == hf_tok.chat_template  # read from chat_template.jinja
    messages = [{"role": "user", "content": "Hi there"}]
    assert tok.encode_chat(messages) == reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


@pytest.mark.slow
def test_hf_folder_bos_comes_from_tokenizer_json(hf_tok: Any, tmp_path: Path) -> None:
    """transformers 5 ignores tokenizer_config's add_bos_token when tokenizer.json exists; the
    file's post-processor decides. Check both halves against transformers."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as BackendTokenizer

    from services.tokenizer.gguf_vocab import bos_eos_processor

    flag_only = tmp_path / "flag"
    _save_hf_folder(hf_tok, flag_only, add_bos_token=True)
    tok = Tokenizer.load(resolve_model(str(flag_only)))
    reference = transformers.AutoTokenizer.from_pretrained(str(flag_only))
    assert tok.add_bos_token is False
    assert tok.encode("Hello world") == reference("Hello world").input_ids == [19556, 905]

    with_bos = tmp_path / "bos"
    _save_hf_folder(hf_tok, with_bos)
    backend = BackendTokenizer.from_file(str(with_bos / "tokenizer.json"))
    backend.post_processor = bos_eos_processor(("<|im_start|>", 1), None)
    backend.save(str(with_bos / "tokenizer.json"))
    tok = Tokenizer.load(resolve_model(str(with_bos)))
    reference = transformers.AutoTokenizer.from_pretrained(str(with_bos))
    assert tok.add_bos_token is True
    for text in ("Hello world", "", "<|im_start|>x"):
        assert tok.encode(text) == reference(text).input_ids
        assert tok.encode(text)[0] == 1
    assert tok.encode("Hello", add_special_tokens=False) == [19556]
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.encode_chat(messages) == reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_hf_folder_without_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.load(resolve_model(str(tmp_path)))


# ------------------------------------------------------------------------------ synthetic GGUF


@pytest.fixture(scope="module")
def default_meta(default_source: ModelSource) -> dict[str, Any]:
    return read_tokenizer_metadata(default_source.path)


def _write_gguf(path: Path, fields: dict[str, Any]) -> None:
    """A tensor-less GGUF holding only tokenizer metadata (enough for both tokenizers)."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(fields.get("context_length", 4096))
    writer.add_tokenizer_model(fields["model"])
    if "pre" in fields:
        writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["token_types"])
    if "merges" in fields:
        writer.add_token_merges(fields["merges"])
    if "scores" in fields:
        writer.add_token_scores(fields["scores"])
    writer.add_bos_token_id(fields["bos"])
    writer.add_eos_token_id(fields["eos"])
    if "add_bos" in fields:
        writer.add_add_bos_token(fields["add_bos"])
    if "chat_template" in fields:
        writer.add_chat_template(fields["chat_template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _load_both(path: Path) -> tuple[Tokenizer, Any]:
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.load(ModelSource("gguf", str(path), path.stem))
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, reference


@pytest.mark.slow
def test_gguf_llama_bpe_pre_tokenizer(default_meta: dict[str, Any], tmp_path: Path) -> None:
    """Same vocabulary, Llama-3's split regex and add_bos_token: both tokenizers agree."""
    path = tmp_path / "llama-bpe.gguf"
    _write_gguf(
        path,
        {
            "model": "gpt2",
            "pre": "llama-bpe",
            "tokens": default_meta["tokenizer.ggml.tokens"],
            "token_types": default_meta["tokenizer.ggml.token_type"],
            "merges": default_meta["tokenizer.ggml.merges"],
            "bos": 1,
            "eos": 2,
            "add_bos": True,
            "context_length": 2048,
        },
    )
    ours, reference = _load_both(path)
    assert ours.context_length == 2048 and ours.add_bos_token is True and ours.chat_template is None
    for text in TEXTS:
        assert ours.encode(text) == reference(text).input_ids
    with pytest.raises(InvalidArgumentError):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


def _sentencepiece_fields(default_meta: dict[str, Any]) -> dict[str, Any]:
    """A small scored sentencepiece vocabulary made from SmolLM2's word pieces."""
    pieces: dict[str, None] = {}
    for token in default_meta["tokenizer.ggml.tokens"][100:4000]:
        piece = token.replace("Ġ", "▁")
        if all(c == "▁" or (c.isascii() and c.isalnum()) for c in piece):
            pieces[piece] = None
    chars = sorted({c for piece in pieces for c in piece})
    body = chars + [p for p in pieces if len(p) > 1]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + body
    types = [2, 3, 3] + [6] * 256 + [1] * len(body)
    scores = [0.0] * 259 + [-float(i) for i in range(len(body))]
    return {"model": "llama", "tokens": tokens, "token_types": types, "scores": scores, "bos": 1, "eos": 2}


@pytest.mark.slow
def test_gguf_sentencepiece_matches_transformers(default_meta: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    _write_gguf(path, _sentencepiece_fields(default_meta))
    ours, reference = _load_both(path)
    assert ours.add_bos_token is True  # llama.cpp's default for sentencepiece vocabularies
    texts = TEXTS + ["</s> inside <s> text", "Hello world", "the quick brown fox"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference(text).input_ids
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids)


def test_gguf_unsupported_tokenizer_model(tmp_path: Path) -> None:
    path = tmp_path / "bert.gguf"
    _write_gguf(path, {"model": "bert", "tokens": ["[PAD]", "[CLS]", "[SEP]", "a"], "token_types": [3, 3, 3, 1], "bos": 1, "eos": 2})
    with pytest.raises(ModelLoadError, match="bert"):
        Tokenizer.load(ModelSource("gguf", str(path), "bert"))


def test_gguf_not_a_gguf_file(default_source: ModelSource, tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError):
        Tokenizer.load(ModelSource("gguf", str(path), "broken"))
    truncated = tmp_path / "truncated.gguf"
    with open(default_source.path, "rb") as original:
        truncated.write_bytes(original.read(500_000))
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        Tokenizer.load(ModelSource("gguf", str(truncated), "truncated"))
