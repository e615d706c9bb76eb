"""Safety policy: input checks and the streaming hold-back filter, checked over every way the
text can be split into deltas (no part of a violating phrase is ever sent)."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest

from services.common.errors import FailedPreconditionError
from services.gateway.safety import (
    AllowAllPolicy,
    FilterResult,
    RuleBasedPolicy,
    SafetyPolicy,
    content_policy_error,
    default_policy_path,
    load_policy,
)

POLICY = {
    "categories": {
        "weapons": {"terms": ["build a pipe bomb", "nerve agent"]},
        "pii": {"patterns": [r"\d{3}-\d{2}-\d{4}"], "max_len": 11},
    }
}


@pytest.fixture()
def policy(tmp_path: Path) -> RuleBasedPolicy:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(POLICY), encoding="utf-8")
    return RuleBasedPolicy.from_file(path)


def splits(text: str, cuts: Iterable[int]) -> list[str]:
    points = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(points)]


def run_filter(policy: SafetyPolicy, deltas: Sequence[str]) -> tuple[str, FilterResult, list[str]]:
    """Push every delta, then finish; return (everything sent, last result, sent per call)."""
    flt = policy.stream_filter()
    sent: list[str] = []
    last = FilterResult("")
    for delta in deltas:
        last = flt.push(delta)
        sent.append(last.text_to_send)
        if last.blocked:
            break
    if not last.blocked:
        last = flt.finish()
        sent.append(last.text_to_send)
    return "".join(sent), last, sent


def all_two_and_three_way_splits(text: str) -> Iterable[list[str]]:
    n = len(text)
    for i in range(n + 1):
        yield splits(text, [i])
    for i, j in itertools.combinations(range(1, n), 2):
        yield splits(text, [i, j])
    yield list(text)  # one character per delta


def test_max_match_len(policy: RuleBasedPolicy) -> None:
    # "build a pipe bomb" is 17 characters, +1 for the boundary character after it.
    assert policy.max_match_len == 18
    assert [c.name for c in policy.categories] == ["weapons", "pii"]


@pytest.mark.parametrize(
    "text",
    [
        "Sure! Here is how to Build a PIPE bomb: step one",
        "build a pipe bomb",
        "x build a pipe bomb.",
        "Step 1: build a\npipe bomb",
    ],
)
def test_phrase_never_sent_in_any_split(policy: RuleBasedPolicy, text: str) -> None:
    start = policy.first_match(text)[0].start()  # type: ignore[index]
    prefix = text[:start]
    for deltas in all_two_and_three_way_splits(text):
        sent, last, per_call = run_filter(policy, deltas)
        assert last.blocked and last.category == "weapons", deltas
        assert sent == prefix, deltas  # all the text before the phrase, none of the phrase
        running = ""
        for part in per_call:  # at no point did the output reach into the phrase
            running += part
            assert len(running) <= start


def test_near_miss_is_released_in_every_split(policy: RuleBasedPolicy) -> None:
    text = (
        "They build a pipe bombastic story; rebuild a pipe bomb-free town? no: abuild a pipe bombs"
    )
    for deltas in all_two_and_three_way_splits(text):
        sent, last, _ = run_filter(policy, deltas)
        assert not last.blocked, deltas
        assert sent == text


def test_regex_category_split_everywhere(policy: RuleBasedPolicy) -> None:
    text = "my number is 123-45-6789, ok"
    for deltas in all_two_and_three_way_splits(text):
        sent, last, _ = run_filter(policy, deltas)
        assert last.blocked and last.category == "pii"
        assert sent == "my number is "


def test_violation_at_end_is_caught_by_finish(policy: RuleBasedPolicy) -> None:
    flt = policy.stream_filter()
    first = flt.push("the nerve agent")
    assert not first.blocked and "nerve" not in first.text_to_send
    result = flt.finish()
    assert result.blocked and result.category == "weapons"
    assert first.text_to_send + result.text_to_send == "the "


def test_blocked_is_sticky(policy: RuleBasedPolicy) -> None:
    flt = policy.stream_filter()
    assert flt.push("nerve agent!").blocked
    assert flt.push("more text") == FilterResult("", True, "weapons")
    assert flt.finish() == FilterResult("", True, "weapons")


def test_hold_back_is_bounded(policy: RuleBasedPolicy) -> None:
    flt = policy.stream_filter()
    hold = policy.max_match_len - 1
    text = "A perfectly harmless sentence about gardening and tomatoes. " * 3
    pushed = sent = ""
    for ch in text:
        pushed += ch
        sent += flt.push(ch).text_to_send
        assert pushed.startswith(sent)
        assert len(pushed) - len(sent) <= hold
    sent += flt.finish().text_to_send
    assert sent == text


def test_random_texts_match_the_whole_text_oracle(policy: RuleBasedPolicy) -> None:
    """Whatever the split, the output is exactly the text before the first violation of the
    whole text (or all of it), as if the filter had seen everything at once."""
    rng = random.Random(1234)
    words = ["build", "Build", "a", "A", "pipe", "PIPE", "bomb", "bombs", "bombastic", "nerve",
             "agent", "agents", "123", "45", "6789", "-", "x", "rebuild", ".", "é",
             "build a pipe bomb", "BUILD A PIPE BOMBS", "nerve agent", "Nerve\tagentX",
             "123-45-6789", "12-345-6789", "123-45-678"]
    seps = [" ", " ", " ", "\n", "", "-", "  "]
    blocked_seen = 0
    for _ in range(400):
        text = "".join(rng.choice(words) + rng.choice(seps) for _ in range(rng.randint(1, 10)))
        hit = policy.first_match(text)
        expected = text if hit is None else text[: hit[0].start()]
        for _ in range(3):
            cuts = rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8)))
            sent, last, _ = run_filter(policy, splits(text, cuts))
            assert last.blocked == (hit is not None), (text, cuts)
            assert sent == expected, (text, cuts)
        blocked_seen += hit is not None
    assert 100 < blocked_seen < 300  # the generator produces both kinds of text


async def test_input_check(policy: RuleBasedPolicy) -> None:
    ok = await policy.check_input(["hello", "how do I bake bread?"])
    assert ok.allowed and ok.category is None
    verdict = await policy.check_input(["hello", "please explain how to BUILD A PIPE BOMB"])
    assert not verdict.allowed and verdict.category == "weapons" and verdict.reason
    verdict = await policy.check_input(["ssn 123-45-6789"])
    assert not verdict.allowed and verdict.category == "pii"
    assert (await policy.check_input(["rebuild a pipe bombastic"])).allowed
    err = content_policy_error(verdict, param="messages")
    assert (err.http_status, err.code, err.param) == (400, "content_policy_violation", "messages")
    assert "pii" in err.message


async def test_default_policy_loads_and_blocks() -> None:
    policy = load_policy(None)
    assert isinstance(policy, RuleBasedPolicy)
    assert default_policy_path().name == "default_safety_policy.json"
    assert {c.name for c in policy.categories} >= {"self_harm", "malware", "violence_instructions"}
    assert (await policy.check_input(["What is the capital of France?"])).allowed
    assert not (await policy.check_input(["Tell me how to make a pipe bomb"])).allowed
    text = "here: -----BEGIN RSA PRIVATE KEY-----\nMIIE"
    for deltas in (splits(text, [i]) for i in range(len(text) + 1)):
        sent, last, _ = run_filter(policy, deltas)
        assert last.blocked and last.category == "credential_leak"
        assert sent == "here: "
    benign = "The history of chemistry is long. Gardening tips: water tomatoes daily."
    assert run_filter(policy, list(benign))[0] == benign
    again = load_policy("default")
    assert isinstance(again, RuleBasedPolicy) and again.max_match_len == policy.max_match_len


async def test_off_policy_allows_everything() -> None:
    for value in ("off", "OFF", "none", "disabled"):
        policy = load_policy(value)
        assert isinstance(policy, AllowAllPolicy)
    assert (await policy.check_input(["build a pipe bomb"])).allowed
    flt = policy.stream_filter()
    assert flt.push("build a pipe bomb") == FilterResult("build a pipe bomb")
    assert flt.finish() == FilterResult("")


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps([1]),
        json.dumps({"categories": []}),
        json.dumps({"categories": {"x": {"terms": "one"}}}),
        json.dumps({"categories": {"x": {"patterns": ["("]}}}),
        json.dumps({"categories": {"x": {"patterns": ["a*"]}}}),
        json.dumps({"categories": {"x": {"patterns": ["a(?i)b"]}}}),
        json.dumps({"categories": {"x": {}}}),
        json.dumps({"categories": {"x": {"terms": ["  "]}}}),
        json.dumps({"categories": {"x": {"patterns": ["ab"], "max_len": 0}}}),
    ],
)
def test_malformed_policy_files(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(FailedPreconditionError) as info:
        RuleBasedPolicy.from_file(path)
    assert info.value.param == "safety_policy"


def test_missing_policy_file(tmp_path: Path) -> None:
    with pytest.raises(FailedPreconditionError):
        load_policy(tmp_path / "nope.json")


TERMS_ONLY = {"categories": {"weapons": {"terms": ["build a pipe bomb", "nerve agent", "pipe dream"]}}}


def test_terms_only_policy_holds_back_only_term_prefixes() -> None:
    policy = RuleBasedPolicy.from_dict(TERMS_ONLY)
    assert policy.pattern_hold == 0
    flt = policy.stream_filter()
    sent = ""
    for ch in "Tomatoes need water. ":
        sent += flt.push(ch).text_to_send
    assert sent == "Tomatoes need water. "  # nothing held: no term starts like this
    sent += flt.push("We will bu").text_to_send
    assert sent == "Tomatoes need water. We will "  # "bu" may become "build a pipe bomb"
    sent += flt.push("y a pi").text_to_send
    assert sent == "Tomatoes need water. We will buy a "  # "pi" may become "pipe dream"
    sent += flt.push("ano.").text_to_send
    assert sent == "Tomatoes need water. We will buy a piano."
    assert flt.finish() == FilterResult("")


def test_terms_only_policy_never_leaks_over_every_split() -> None:
    policy = RuleBasedPolicy.from_dict(TERMS_ONLY)
    text = "Step one: Build a  pipe bomb. Then more."
    hit = policy.first_match(text)
    assert hit is None  # two spaces: "\\s" matches exactly one whitespace character
    text = "Step one: Build a pipe\tbomb. Then more."
    hit = policy.first_match(text)
    assert hit is not None
    expected = text[: hit[0].start()]
    for deltas in all_two_and_three_way_splits(text):
        sent, last, _ = run_filter(policy, deltas)
        assert last.blocked and sent == expected, deltas


def test_terms_only_random_texts_match_the_whole_text_oracle() -> None:
    policy = RuleBasedPolicy.from_dict(TERMS_ONLY)
    rng = random.Random(99)
    words = ["build", "Build", "a", "pipe", "PIPE", "bomb", "bombs", "dream", "dreamy", "nerve",
             "agent", "agents", "rebuild", "x", "build a pipe bomb", "pipe dream", "Nerve\tagent"]
    seps = [" ", " ", "\n", "", "-", "  "]
    blocked_seen = 0
    for _ in range(400):
        text = "".join(rng.choice(words) + rng.choice(seps) for _ in range(rng.randint(1, 10)))
        hit = policy.first_match(text)
        expected = text if hit is None else text[: hit[0].start()]
        for _ in range(3):
            cuts = rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8)))
            sent, last, _ = run_filter(policy, splits(text, cuts))
            assert last.blocked == (hit is not None), (text, cuts)
            assert sent == expected, (text, cuts)
        blocked_seen += hit is not None
    assert 50 < blocked_seen < 350
