"""The paged engine end to end on a tiny random Llama: continuous batching, preemption,
prefix caching, prefill→decode hand-off between two engines, seeds, stop conditions, aborts.

Greedy outputs of every scenario must equal those of the same prompt run alone with plenty of
room, and KV blocks in use must return to zero afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingParams
from services.engine.core.engine import EngineConfig, LLMEngine, RequestOutput
from services.engine.core.loaders import LoadedModel, load_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(l),), generator=gen).tolist() for l in torch.randint(3, 40, (n,), generator=gen)]


def _alone(tiny: LoadedModel, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=256, enable_prefix_caching=False))
    return engine.generate([prompt], params)[0].new_token_ids


def test_batched_generation_equals_each_prompt_alone(tiny: LoadedModel) -> None:
    prompts = _prompts(6)
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=256))
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.new_token_ids == _alone(tiny, prompt)
        assert out.finish_reason == "length" and len(out.new_token_ids) == 12
    assert engine.block_manager.num_blocks_in_use == 0


def test_requests_join_a_running_batch(tiny: LoadedModel) -> None:
    prompts = _prompts(3, seed=1)
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=256))
    engine.add_request("a", prompts[0], GREEDY)
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    batch_sizes = []
    for step in range(40):
        if step == 3:
            engine.add_request("b", prompts[1], GREEDY)
        if step == 6:
            engine.add_request("c", prompts[2], GREEDY)
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        batch_sizes.append(engine.scheduler.num_running)
        if not engine.has_unfinished():
            break
    assert max(batch_sizes) == 3  # all three decoded in the same steps at some point
    for rid, prompt in zip("abc", prompts):
        assert got[rid] == _alone(tiny, prompt)


def test_chunked_prefill_of_long_prompt(tiny: LoadedModel) -> None:
    prompt = _prompts(1, seed=2)[0] * 4
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=16))
    assert engine.generate([prompt], GREEDY)[0].new_token_ids == _alone(tiny, prompt)


def test_preemption_under_block_pressure_keeps_outputs(tiny: LoadedModel) -> None:
    prompts = _prompts(4, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=30, enable_prefix_caching=False))
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.new_token_ids == _alone(tiny, prompt, params)
    assert engine.block_manager.num_blocks_in_use == 0


def test_prefix_cache_hit_reuses_blocks_and_keeps_outputs(tiny: LoadedModel) -> None:
    prefix = _prompts(1, seed=4)[0] + list(range(10, 30))
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=256))
    first = engine.generate([prefix + [7, 8]], GREEDY)[0]
    second = engine.generate([prefix + [9, 10, 11]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(prefix) // 4) * 4
    assert second.new_token_ids == _alone(tiny, prefix + [9, 10, 11])
    assert engine.block_manager.num_blocks_in_use == 0


def _move_kv(prefill: LLMEngine, decode: LLMEngine, done: RequestOutput) -> list[int]:
    """Copy a prefilled request's blocks into fresh blocks of ``decode``; free prefill's copy."""
    dest = decode.block_manager.allocate(len(done.block_ids))
    decode.kv.write_blocks(dest, prefill.kv.read_blocks(done.block_ids))
    prefill.release_blocks(done.block_ids)
    return dest


def _prefill_all(prefill: LLMEngine) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while prefill.has_unfinished():
        outs.extend(prefill.step())
    return outs


def test_prefill_on_one_engine_decode_on_another(tiny: LoadedModel) -> None:
    """The in-process version of the KV hand-off: copy whole blocks between two pools."""
    prompt = _prompts(1, seed=5)[0]
    prefill = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=64))
    decode = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=64))
    prefill.add_request("r", prompt, GREEDY, prefill_only=True)
    (done,) = _prefill_all(prefill)
    assert done.finish_reason == "prefilled" and len(done.new_token_ids) == 1
    assert prefill.block_manager.num_blocks_in_use == len(done.block_ids)  # held under lease
    dest = _move_kv(prefill, decode, done)
    tokens = list(done.new_token_ids)
    for out in decode.add_prefilled("r", prompt, GREEDY, block_ids=dest, first_token_id=tokens[0]):
        assert out.new_token_ids == tokens[:1]
    while decode.has_unfinished():
        for out in decode.step():
            tokens.extend(out.new_token_ids)
    assert tokens == _alone(tiny, prompt)
    assert prefill.block_manager.num_blocks_in_use == 0
    assert decode.block_manager.num_blocks_in_use == 0


def test_seeded_sampling_survives_the_hand_off(tiny: LoadedModel) -> None:
    """Prefill draws the first token from the seed; decode continues the same random stream."""
    prompt = _prompts(1, seed=13)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = _alone(tiny, prompt, params)
    prefill = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=64))
    decode = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=64))
    prefill.add_request("s", prompt, params, prefill_only=True)
    (done,) = _prefill_all(prefill)
    dest = _move_kv(prefill, decode, done)
    tokens = list(done.new_token_ids)
    decode.add_prefilled("s", prompt, params, block_ids=dest, first_token_id=tokens[0])
    while decode.has_unfinished():
        for out in decode.step():
            tokens.extend(out.new_token_ids)
    assert tokens == alone


@pytest.mark.parametrize("params", [
    GREEDY,
    SamplingParams(temperature=1.0, top_p=0.9, seed=77, max_tokens=12, ignore_eos=True,
                   repetition_penalty=1.3),
], ids=["greedy", "seeded-with-penalty"])  # fmt: skip
def test_a_resumed_request_continues_as_if_it_never_moved(
    tiny: LoadedModel, params: SamplingParams
) -> None:
    """A stream migrated after 5 tokens (another engine recomputes prompt + those 5) goes on with
    the tokens the original would have produced: same greedy picks, same seeded draws."""
    prompt = _prompts(1, seed=21)[0]
    alone = _alone(tiny, prompt, params)
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=64))
    engine.add_request("m", prompt, params, resume_output_ids=alone[:5])
    tokens = list(alone[:5])
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    assert tokens == alone
    assert engine.block_manager.num_blocks_in_use == 0
    with pytest.raises(InvalidArgumentError):
        engine.add_request("full", prompt, params, resume_output_ids=alone)  # nothing left to do


def test_prefilled_requests_wait_for_a_seat(tiny: LoadedModel) -> None:
    """A decode engine never runs more than ``max_num_seqs``: hand-offs beyond it queue, holding
    their KV blocks, and decode the same tokens once seated."""
    prompts = _prompts(3, seed=11)
    prefill = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=128))
    decode = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=128, max_num_seqs=2))
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, GREEDY, prefill_only=True)
    tokens: dict[str, list[int]] = {}
    for done in sorted(_prefill_all(prefill), key=lambda o: o.request_id):
        dest = _move_kv(prefill, decode, done)
        i = int(done.request_id[1:])
        tokens[done.request_id] = list(done.new_token_ids)
        decode.add_prefilled(done.request_id, prompts[i], GREEDY, block_ids=dest,
                             first_token_id=done.new_token_ids[0])
    assert decode.scheduler.num_waiting == 3 and decode.scheduler.num_running == 0
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.request_id].extend(out.new_token_ids)
        assert decode.scheduler.num_running <= 2
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == _alone(tiny, prompt)
    assert decode.block_manager.num_blocks_in_use == 0


def test_abort_of_a_queued_prefilled_request_frees_its_blocks(tiny: LoadedModel) -> None:
    decode = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=32, max_num_seqs=1))
    prompt = _prompts(1, seed=12)[0]
    for rid in ("a", "b"):
        blocks = decode.block_manager.allocate(-(-len(prompt) // 4))
        decode.add_prefilled(rid, prompt, GREEDY, block_ids=blocks, first_token_id=5)
    decode.step()  # seats "a"; "b" keeps waiting with its blocks
    assert decode.scheduler.num_running == 1 and decode.scheduler.num_waiting == 1
    assert decode.abort("b") and decode.abort("a")
    assert decode.block_manager.num_blocks_in_use == 0


def test_seeded_sampling_is_independent_of_batch_mates(tiny: LoadedModel) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = _prompts(1, seed=6)[0]
    alone = _alone(tiny, prompt, params)
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=256))
    mates = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 3
    outs = engine.generate(_prompts(3, seed=7) + [prompt], mates + [params])
    assert outs[-1].new_token_ids == alone
    other_seed = _alone(tiny, prompt, SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=16, ignore_eos=True))
    assert other_seed != alone


def test_stop_conditions(tiny: LoadedModel) -> None:
    prompt = _prompts(1, seed=8)[0]
    reference = _alone(tiny, prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop_tok = reference[5]
    first = reference.index(stop_tok)
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=256))
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(stop_tok,), ignore_eos=True))[0]
    assert out.new_token_ids == reference[: first + 1] and out.finish_reason == "stop"
    eos_engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=256), eos_token_ids=[stop_tok])
    out = eos_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0]
    assert out.new_token_ids == reference[: first + 1] and out.finish_reason == "stop"
    out = eos_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 2))[0]
    assert stop_tok not in out.new_token_ids[: first + 2]


def test_abort_frees_blocks(tiny: LoadedModel) -> None:
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=256))
    engine.add_request("x", _prompts(1, seed=9)[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_blocks_in_use > 0
    assert engine.abort("x")
    assert engine.block_manager.num_blocks_in_use == 0
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "abort"
    assert not engine.abort("x")


def test_bad_requests_are_refused(tiny: LoadedModel) -> None:
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=256))
    with pytest.raises(InvalidArgumentError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        engine.add_request("a", [5, 9999], GREEDY)
    with pytest.raises(InvalidArgumentError, match="context"):
        engine.add_request("a", [5] * 600, GREEDY)
    with pytest.raises(InvalidArgumentError):
        engine.add_request("a", [5], SamplingParams(temperature=-1))


def test_prompt_larger_than_pool_finishes_with_length(tiny: LoadedModel) -> None:
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=4))
    outs = engine.generate([list(range(3, 40))], GREEDY)
    assert outs[0].finish_reason == "length" and outs[0].new_token_ids == []
