"""Sampler: exact filter masks and penalties, greedy fast path, per-request seeded draws."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingParams
from services.engine.core.sampler import (
    Sampler,
    SamplerOutput,
    SamplingState,
    TokenLogprobs,
    make_generator,
)
from services.engine.core.sampling_filters import (
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    sample_from_probs,
)

V = 8
EOS = 7


def state(prompt: list[int] | None = None, output: list[int] | None = None,
          **params: object) -> SamplingState:
    sp = SamplingParams(**params).validate()  # type: ignore[arg-type]
    st = SamplingState.create(sp, prompt or [])
    st.output_token_ids = list(output or [])
    return st


def survivors(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def step_logits(step: int, rows: int, vocab: int = 64) -> torch.Tensor:
    """Deterministic pseudo-model logits for a step."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, vocab, generator=g) * 2


# ------------------------------------------------------------------------------ filters

def test_top_k_mask_exact() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 3.0, 0.5, 1.0, -2.0, 0.0],
                           [0.1, 2.0, -1.0, 3.0, 0.5, 1.0, -2.0, 0.0],
                           [5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    out = apply_top_k(logits, torch.tensor([3, 0, 1]))
    assert survivors(out[0]) == {1, 3, 5}
    assert survivors(out[1]) == set(range(V))  # 0 disables
    assert survivors(out[2]) == {0}
    assert torch.equal(out[0, [1, 3, 5]], logits[0, [1, 3, 5]])
    assert apply_top_k(logits, torch.tensor([0, -1, V])) is logits  # nothing enabled


def test_top_p_mask_exact() -> None:
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15, 0.0, 0.0, 0.0]) + 1e-9
    logits = probs.log().repeat(4, 1)
    out = apply_top_p(logits, torch.tensor([0.5, 0.75, 0.9, 1.0]))
    # Sorted: 1 (0.4), 3 (0.3), 4 (0.15), 2 (0.1), 0 (0.05), then ~0. A token survives while the
    # mass ranked above it is below p.
    assert survivors(out[0]) == {1, 3}          # above 3: 0.4 < 0.5; above 4: 0.7
    assert survivors(out[1]) == {1, 3, 4}       # above 2: 0.85
    assert survivors(out[2]) == {1, 2, 3, 4}    # above 0: 0.95
    assert survivors(out[3]) == set(range(V))   # 1.0 disables
    tiny = apply_top_p(logits[:1], torch.tensor([1e-6]))
    assert survivors(tiny[0]) == {1}            # the most likely token always survives


def test_min_p_mask_exact() -> None:
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15, 0.0, 0.0, 0.0]) + 1e-9
    logits = probs.log().repeat(3, 1)
    out = apply_min_p(logits, torch.tensor([0.3, 0.0, 1.0]))
    assert survivors(out[0]) == {1, 3, 4}       # threshold 0.12
    assert survivors(out[1]) == set(range(V))
    assert survivors(out[2]) == {1}


def test_penalties_exact_values() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0, 0.0, 4.0],
                           [2.0, -2.0, 1.0, -1.0, 0.5, 3.0, 0.0, 4.0]])
    out = apply_penalties(
        logits,
        prompt_token_ids=[[0, 1], [0]],
        output_token_ids=[[2, 2, 3, 9999], []],       # 9999 is out of vocabulary: ignored
        repetition_penalty=torch.tensor([2.0, 1.0]),
        presence_penalty=torch.tensor([0.5, 1.0]),
        frequency_penalty=torch.tensor([0.25, 1.0]),
    )
    expected0 = [2.0 / 2, -2.0 * 2, 1.0 / 2 - 0.5 - 0.5, -1.0 * 2 - 0.5 - 0.25,
                 0.5, 3.0, 0.0, 4.0]
    assert out[0].tolist() == pytest.approx(expected0)
    assert torch.equal(out[1], logits[1])  # no output tokens and repetition 1: unchanged


# ------------------------------------------------------------------------------ sampler

def test_greedy_is_argmax_and_fast_path_matches_general() -> None:
    sampler = Sampler(vocab_size=64, eos_token_ids=[EOS])
    logits = step_logits(0, 5)
    states = [state(temperature=0.0) for _ in range(5)]
    out = sampler(logits, states)
    assert out == SamplerOutput(logits.argmax(-1).tolist(), [None] * 5)
    assert sampler.sample_general(logits, states) == out
    half = sampler(logits.to(torch.bfloat16), states)
    assert half.token_ids == sampler.sample_general(logits.to(torch.bfloat16), states).token_ids
    assert all(s.generator is None for s in states)


def test_padded_vocab_columns_never_chosen() -> None:
    sampler = Sampler(vocab_size=4, eos_token_ids=[])
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.2, 100.0, 100.0]])
    assert sampler(logits, [state(temperature=0.0)]).token_ids == [1]
    assert sampler(logits, [state(temperature=1.0, seed=1)]).token_ids[0] < 4
    with pytest.raises(InvalidArgumentError):
        sampler(logits[:, :3], [state(temperature=0.0)])
    with pytest.raises(InvalidArgumentError):
        sampler(logits, [])
    assert sampler(logits[:0], []) == SamplerOutput([], [])


def test_greedy_with_penalties_uses_penalised_logits() -> None:
    sampler = Sampler(vocab_size=V, eos_token_ids=[EOS])
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0]])
    plain = state(temperature=0.0)
    penalised = state(output=[1], temperature=0.0, presence_penalty=1.0)
    assert sampler(logits.repeat(2, 1), [plain, penalised]).token_ids == [1, 2]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    sampler = Sampler(vocab_size=V, eos_token_ids=[EOS])
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 8.0, 10.0]])
    waiting = state(output=[1], temperature=0.0, min_tokens=2, stop_token_ids=(5,),
                    ignore_eos=True)
    assert sampler(logits, [waiting]).token_ids == [6]
    waiting.output_token_ids.append(1)  # min_tokens reached
    assert sampler(logits, [waiting]).token_ids == [EOS]
    sampling = state(temperature=1.0, seed=3, min_tokens=1, stop_token_ids=(5,))
    for _ in range(50):
        assert sampler(logits, [sampling]).token_ids[0] not in (5, EOS)


def test_logprobs_are_raw_log_softmax_with_sorted_top() -> None:
    sampler = Sampler(vocab_size=64, eos_token_ids=[EOS])
    logits = step_logits(1, 3)
    states = [
        state(temperature=0.7, seed=5, logprobs=4, repetition_penalty=1.5, prompt=[3, 4]),
        state(temperature=0.0),
        state(temperature=0.0, logprobs=0),
    ]
    out = sampler(logits, states)
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for row in (0, 2):
        lp = out.logprobs[row]
        assert isinstance(lp, TokenLogprobs)
        assert lp.token_id == out.token_ids[row]
        assert lp.logprob == pytest.approx(expected[row, lp.token_id].item(), abs=1e-6)
    top = out.logprobs[0].top  # type: ignore[union-attr]
    assert len(top) == 4
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert [i for i, _ in top] == expected[0].topk(4).indices.tolist()
    assert [v for _, v in top] == pytest.approx(expected[0].topk(4).values.tolist(), abs=1e-6)
    assert out.logprobs[2].top == ()  # type: ignore[union-attr]


def test_seeded_request_is_batch_invariant() -> None:
    sampler = Sampler(vocab_size=64, eos_token_ids=[EOS])
    steps = 40

    def run(row: int, rows: int, with_others: bool) -> list[int]:
        target = state(temperature=0.9, top_k=20, top_p=0.9, seed=1234)
        kinds = [
            lambda i: state(temperature=1.0, seed=99 + i),
            lambda i: state(temperature=1.2, min_p=0.05),
            lambda i: state(prompt=[1, 2], temperature=0.0, repetition_penalty=1.3, logprobs=2),
        ]
        others = [kinds[i % 3](i) for i in range(rows - 1)] if with_others else []
        if not with_others:
            rows, row = 1, 0
        tokens = []
        for step in range(steps):
            logits = step_logits(step, rows)
            logits[row] = step_logits(step, 1)[0]  # the target's own logits
            batch = others[:row] + [target] + others[row:]
            out = sampler(logits, batch)
            tokens.append(out.token_ids[row])
        return tokens

    alone = run(0, 1, with_others=False)
    assert run(0, 4, with_others=True) == alone
    assert run(3, 5, with_others=True) == alone
    assert run(1, 2, with_others=True) == alone
    assert len(set(alone)) > 5  # it really samples


def test_different_seeds_differ_and_unseeded_vary() -> None:
    sampler = Sampler(vocab_size=64, eos_token_ids=[])
    logits = torch.zeros(1, 64)

    def draws(st: SamplingState) -> list[int]:
        return [sampler(logits, [st]).token_ids[0] for _ in range(20)]

    assert draws(state(seed=1)) == draws(state(seed=1))
    assert draws(state(seed=1)) != draws(state(seed=2))
    assert draws(state()) != draws(state())  # urandom seeds
    assert make_generator(None, greedy=True) is None
    assert make_generator(-5) is not None and make_generator(2**64 - 1) is not None


def test_temperature_frequencies_match_softmax() -> None:
    sampler = Sampler(vocab_size=4, eos_token_ids=[])
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    n = 4000
    states = [state(temperature=0.7, seed=i) for i in range(n)]
    out = sampler(logits.repeat(n, 1), states)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    expected = torch.softmax(logits / 0.7, dim=-1)
    assert torch.allclose(counts, expected, atol=0.03), (counts, expected)


def test_sampling_respects_filters() -> None:
    sampler = Sampler(vocab_size=64, eos_token_ids=[])
    logits = step_logits(7, 1)
    allowed = set(logits[0].topk(3).indices.tolist())
    st = state(temperature=2.0, top_k=3, seed=11)
    seen = {sampler(logits, [st]).token_ids[0] for _ in range(200)}
    assert seen == allowed


def test_sample_from_probs_exponential_race() -> None:
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    picks = sample_from_probs(probs, gens)
    assert picks[0].item() == 1 and picks[1].item() in (0, 2)
    # Row noise depends only on its own generator.
    g = torch.Generator().manual_seed(1)
    q = torch.empty(3).exponential_(generator=g)
    assert picks[1].item() == int(torch.argmax(probs[1] / q))


def test_unseeded_state_without_generator_gets_one() -> None:
    sampler = Sampler(vocab_size=64, eos_token_ids=[])
    st = SamplingState(SamplingParams(temperature=1.0), [], [], None)
    sampler(step_logits(0, 1), [st])
    assert isinstance(st.generator, torch.Generator)
    assert st.generator.device == torch.device("cpu")


# ------------------------------------------------------------------------ failure isolation

class _BrokenGenerator:
    """Stands in for a row whose sampling raises (a torch error from its own parameters)."""

    device = torch.device("cpu")


def test_a_row_that_fails_alone_fails_only_itself_and_neighbours_draw_as_without_it() -> None:
    sampler = Sampler(64, [EOS])
    logits = step_logits(0, 3)
    seeded = dict(temperature=0.8, seed=11, max_tokens=4)
    alone = [sampler(logits[i : i + 1], [s]).token_ids[0]
             for i, s in enumerate([state(**seeded), state(temperature=0.0), state(**seeded)])]
    rows = [state(**seeded), state(temperature=0.7, seed=3), state(temperature=0.0)]
    rows[1].generator = _BrokenGenerator()  # type: ignore[assignment]
    # row 0's draw comes before row 1 raises: it must be rewound, not drawn twice
    out = sampler(logits[[0, 1, 1]], [rows[0], rows[1], rows[2]])
    assert list(out.failures) == [1] and "TypeError" in out.failures[1]
    assert out.token_ids[1] == -1 and out.logprobs[1] is None
    assert out.token_ids[0] == alone[0] and out.token_ids[2] == alone[1]
    # and its generator stands exactly one draw on, as a reference that drew once alone
    reference = state(**seeded)
    sampler(logits[0:1], [reference])
    assert torch.equal(rows[0].generator.get_state(), reference.generator.get_state())


def test_non_finite_logits_fail_the_step_not_a_request() -> None:
    sampler = Sampler(64, [EOS])
    logits = step_logits(1, 2)
    logits[1, 5] = float("nan")
    rows = [state(temperature=0.0), state(temperature=0.9, seed=1)]
    rows[1].generator = _BrokenGenerator()  # type: ignore[assignment]
    with pytest.raises(TypeError):
        sampler(logits, rows)


def test_a_vanishing_temperature_samples_greedily() -> None:
    logits = step_logits(2, 1)
    st = state(temperature=1e-40, seed=4)
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=1e-4).greedy
    assert Sampler(64, [EOS])(logits, [st]).token_ids == logits.argmax(dim=-1).tolist()
