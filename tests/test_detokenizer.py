"""Incremental detokenizer: never half a UTF-8 character, never the start of a stop string that
completes, and the deltas always add up to the full decode (cut at the stop string)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from services.common.errors import InvalidArgumentError
from services.common.model_source import resolve_model
from services.tokenizer.detokenizer import DetokenizedDelta, IncrementalDetokenizer
from services.tokenizer.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(resolve_model("default"))


class ByteTokenizer:
    """One id per UTF-8 byte: the harshest splitting of multi-byte characters."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class LeadingSpaceTokenizer(ByteTokenizer):
    """Drops one leading space of any decoded text, like sentencepiece's ``▁`` decoder."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = super().decode(ids, skip_special_tokens)
        return text[1:] if text.startswith(" ") else text


def reference(full: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """The full text cut before the stop string that completes first."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = full.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return (full, None) if best is None else (full[: best[1]], best[2])


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunks: Sequence[int] | None = None
) -> tuple[list[DetokenizedDelta], str]:
    """Push ``ids`` in chunks (default one at a time); return the deltas and the flush text."""
    deltas: list[DetokenizedDelta] = []
    sizes = list(chunks or [1] * len(ids))
    position = 0
    while position < len(ids):
        size = sizes.pop(0) if sizes else 1
        deltas.append(detok.push(ids[position : position + size]))
        position += size
    return deltas, detok.flush()


# ------------------------------------------------------------------------------ UTF-8 safety


@pytest.mark.parametrize(
    "text",
    ["🎉 party 🎉🎉", "👨‍👩‍👧‍👦 family", "中文测试：你好，世界！", "日本語のテキスト", "😀a😀 b", "🏳️‍🌈🧑🏽‍💻"],
)
def test_multibyte_characters_never_split(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)  # the text really splits characters
    deltas, tail = stream(IncrementalDetokenizer(tok), ids)
    for delta in deltas:
        assert REPLACEMENT not in delta.text
    assert tail == ""
    assert "".join(d.text for d in deltas) == text


def test_byte_tokenizer_releases_whole_characters_only() -> None:
    text = "aé中😀👨‍👩‍👧b"
    byte_tok = ByteTokenizer()
    deltas, tail = stream(IncrementalDetokenizer(byte_tok), byte_tok.encode(text))
    assert [d.text for d in deltas if d.text] == ["a", "é", "中", "😀", "👨", "\u200d", "👩", "\u200d", "👧", "b"]
    assert tail == ""


def test_flush_releases_incomplete_character() -> None:
    byte_tok = ByteTokenizer()
    ids = byte_tok.encode("ok 😀")[:-2]  # cut in the middle of the emoji
    deltas, tail = stream(IncrementalDetokenizer(byte_tok), ids)
    assert "".join(d.text for d in deltas) == "ok "
    assert tail == byte_tok.decode(ids)[3:] and tail.startswith(REPLACEMENT)


def test_prompt_context_keeps_leading_space() -> None:
    """With the prompt as context, a sentencepiece-style space at the start of the reply stays."""
    sp_tok = LeadingSpaceTokenizer()
    prompt = sp_tok.encode("Q: hi A:")
    reply = sp_tok.encode(" yes no")
    deltas, tail = stream(IncrementalDetokenizer(sp_tok, prompt_token_ids=prompt), reply)
    assert "".join(d.text for d in deltas) + tail == " yes no"
    deltas, tail = stream(IncrementalDetokenizer(sp_tok), reply)
    assert "".join(d.text for d in deltas) + tail == sp_tok.decode(reply) == "yes no"


def test_prompt_context_with_model_tokenizer(tok: Tokenizer) -> None:
    prompt = tok.encode_chat([{"role": "user", "content": "Say 中文"}])
    reply = tok.encode("中文 means Chinese 😀.")
    deltas, tail = stream(IncrementalDetokenizer(tok, prompt_token_ids=prompt), reply)
    assert "".join(d.text for d in deltas) + tail == "中文 means Chinese 😀."
    assert all(REPLACEMENT not in d.text for d in deltas)


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("Hi<|im_end|>\n<|im_start|>there")
    deltas, tail = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(d.text for d in deltas) + tail == "Hi\nthere"
    deltas, tail = stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids)
    assert "".join(d.text for d in deltas) + tail == "Hi<|im_end|>\n<|im_start|>there"


# ------------------------------------------------------------------------------ stop strings


def test_stop_string_spanning_tokens_is_never_emitted(tok: Tokenizer) -> None:
    text = "The answer is forty-two. ### END of answer, more text"
    stop = "### END"
    ids = tok.encode(text)
    assert len(tok.encode(stop, add_special_tokens=False)) > 1
    detok = IncrementalDetokenizer(tok, stop=[stop])
    emitted = ""
    stopped_at = None
    for index, token_id in enumerate(ids):
        delta = detok.push([token_id])
        emitted += delta.text
        assert "#" not in emitted  # no part of the stop string ever leaves
        if delta.stopped:
            stopped_at = index
            assert delta.stop_string == stop
            break
    assert stopped_at is not None
    assert emitted == "The answer is forty-two. "
    assert detok.stopped and detok.stop_string == stop
    after = detok.push(ids[stopped_at + 1 :])
    assert after == DetokenizedDelta("", True, stop)
    assert detok.flush() == ""
    assert detok.text == emitted


def test_stop_prefix_that_does_not_complete_is_released(tok: Tokenizer) -> None:
    text = "wait ### ENDLESS? no: ### EN"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["### END!"])
    deltas, tail = stream(detok, ids)
    assert not any(d.stopped for d in deltas)
    assert tail == "### EN"  # held until the end: it could still have become the stop string
    assert "".join(d.text for d in deltas) + tail == text


def test_first_completed_stop_wins() -> None:
    byte_tok = ByteTokenizer()
    detok = IncrementalDetokenizer(byte_tok, stop=["abcd", "bc"])
    deltas, tail = stream(detok, byte_tok.encode("xxabcd"))
    assert "".join(d.text for d in deltas) + tail == "xxa"
    assert detok.stop_string == "bc"
    detok = IncrementalDetokenizer(byte_tok, stop=["bcd", "abcd"])  # same end: the earlier start
    deltas, tail = stream(detok, byte_tok.encode("xxabcd"))
    assert "".join(d.text for d in deltas) + tail == "xx"
    assert detok.stop_string == "abcd"


def test_stop_string_can_complete_at_flush() -> None:
    byte_tok = ByteTokenizer()
    ids = byte_tok.encode("go 😀")[:-1]
    detok = IncrementalDetokenizer(byte_tok, stop=[REPLACEMENT])
    deltas, tail = stream(detok, ids)
    assert "".join(d.text for d in deltas) + tail == "go "
    assert detok.stopped


@pytest.mark.parametrize("bad", [[""], ["ok", ""], [None]])
def test_invalid_stop_strings(tok: Tokenizer, bad: list[object]) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        IncrementalDetokenizer(tok, stop=bad)  # type: ignore[arg-type]
    assert info.value.param == "stop"


# ------------------------------------------------------------------------------ property


POOL = (
    list("abcdefghij ABC  \n\t.,!?'\"-_0123456789")
    + ["é", "ü", "ß", "中", "文", "日", "本", "한", "ع", "ب", "😀", "🎉", "👍🏽", "👨‍👩‍👧", "🏳️‍🌈", "\u200d"]
    + [" the", " and", "ing", "<|im_end|>", "<|im_start|>", "###", "STOP", "\n\n"]
)


def _random_case(rng: random.Random) -> tuple[str, list[str], bool, list[int]]:
    text = "".join(rng.choice(POOL) for _ in range(rng.randint(0, 40)))
    stops: list[str] = []
    for _ in range(rng.randint(0, 3)):
        if text and rng.random() < 0.6:
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 6)])
        else:
            stops.append("".join(rng.choice(POOL) for _ in range(rng.randint(1, 3))))
    chunks = [rng.randint(1, 4) for _ in range(60)]
    return text, stops, rng.random() < 0.5, chunks


@pytest.mark.parametrize("seed", range(6))
def test_concatenation_equals_decode(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        text, stops, skip, chunks = _random_case(rng)
        ids = tok.encode(text)
        full = tok.decode(ids, skip_special_tokens=skip)
        expected, expected_stop = reference(full, stops)
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, stop=stops)
        deltas, tail = stream(detok, ids, chunks)
        emitted = "".join(d.text for d in deltas) + tail
        context = (text, stops, skip)
        assert emitted == expected, context
        assert detok.stop_string == expected_stop, context
        assert all(REPLACEMENT not in d.text for d in deltas) or REPLACEMENT in full, context
        first = next((i for i, d in enumerate(deltas) if d.stopped), len(deltas))
        assert all(d == DetokenizedDelta("", True, expected_stop) for d in deltas[first + 1 :]), context


@pytest.mark.parametrize("seed", range(4))
def test_concatenation_equals_decode_byte_tokenizer(seed: int) -> None:
    rng = random.Random(1000 + seed)
    byte_tok = ByteTokenizer()
    for _ in range(100):
        text, stops, _, chunks = _random_case(rng)
        ids = byte_tok.encode(text)
        if ids and rng.random() < 0.3:
            ids = ids[: rng.randrange(len(ids))]  # may end inside a character
        expected, _ = reference(byte_tok.decode(ids), stops)
        deltas, tail = stream(IncrementalDetokenizer(byte_tok, stop=stops), ids, chunks)
        assert "".join(d.text for d in deltas) + tail == expected, (text, stops)
        assert all(REPLACEMENT not in d.text for d in deltas), (text, stops)
