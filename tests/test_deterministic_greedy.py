"""The same greedy request gives the same tokens, and bit for bit the same logprobs, on every path
a request can take: cold, after a full or a partial prefix-cache hit (a one-token uncached tail
included), chunked, batched with 15 other random requests, prefilled on one engine and decoded on
another, resumed after a migration, and with a prompt that contains tokens an earlier request
generated (their KV cached from decode steps) — for every family Tandem runs and for the default
dtype of each stored format (``--dtype auto``: float32, bfloat16 weight-only, ``q4_a8_decode``
for 4-bit GGUFs, ``q4`` for K-quants, ``q8_0``), and over a ``q8_0`` KV cache (every path reads
the quantized K/V: a prompt attends over its own keys as stored).

Logprobs equal to the last bit mean every position's computation (matmuls, norms, attention)
gave the same numbers whichever step, batch or phase computed it (``linear.py``,
``cpu_paged_attention.c``): the guarantee on CPU with the native kernels, which CI requires. The
served check runs real prefill and decode gRPC workers: the second run of a prompt is answered
from the prefill worker's prefix cache, the first from a cold one, and both equal the engine.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.engine.core.engine import EngineConfig, LLMEngine, RequestOutput
from services.engine.core.loaders import LoadedModel, load_model
from tests.conftest import native_kernel_or_skip
from tests.test_model_families import FAMILIES
from tests.prefill_decode_cluster import cluster, tokens_of

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
BLOCK = 16
Result = tuple[list[int], list[float | None]]


def _base_config(**overrides: object) -> EngineConfig:
    base: dict[str, object] = dict(block_size=BLOCK, num_blocks=400, kv_cache_dtype="auto")
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def _result(out: RequestOutput) -> Result:
    return out.new_token_ids, [lp.logprob if lp is not None else None for lp in out.new_logprobs]


def _prompts(vocab: int, seed: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    top = min(vocab, 40000) - 1
    prompt = [rng.randrange(3, top) for _ in range(2 * BLOCK + 1)]  # two cached blocks + 1
    others = [[rng.randrange(3, top) for _ in range(rng.randrange(3, 70))] for _ in range(15)]
    return prompt, others


def _check_every_path(loaded: LoadedModel, seed: int = 0, kv: str = "auto") -> None:
    """Every path of the module docstring gives the cold run's tokens and logprobs; ``kv``: the
    engines' ``kv_cache_dtype``."""

    def _config(**overrides: object) -> EngineConfig:
        return _base_config(kv_cache_dtype=kv, **overrides)

    prompt, others = _prompts(loaded.config.vocab_size, seed)
    cold_engine = LLMEngine(loaded, _config(enable_prefix_caching=False))

    def cold(p: list[int]) -> Result:
        return _result(cold_engine.generate([p], PARAMS)[0])

    expected = cold(prompt)
    failures: list[str] = []

    def same(name: str, got: Result, want: Result = expected) -> None:
        if got != want:
            failures.append(f"{name}: {got} != {want}")

    cached = LLMEngine(loaded, _config())
    same("first run on a caching engine", _result(cached.generate([prompt], PARAMS)[0]))
    hit = cached.generate([prompt], PARAMS)[0]
    assert hit.num_cached_tokens == 2 * BLOCK, "the full-hit case needs its prefix cached"
    same("full prefix hit, one-token tail", _result(hit))
    partial = prompt[:BLOCK] + others[0][:9] + prompt[BLOCK:]
    same("partial prefix hit", _result(cached.generate([partial], PARAMS)[0]), cold(partial))
    grown = prompt + expected[0][:8] + others[1][:5]  # a next turn quoting the reply
    same("prompt holding generated tokens (their KV from decode steps)",
         _result(cached.generate([grown], PARAMS)[0]), cold(grown))  # fmt: skip
    batched = cold_engine.generate([prompt, *others], PARAMS)
    same("batched with 15 random requests", _result(batched[0]))
    chunked = LLMEngine(loaded, _config(enable_prefix_caching=False, max_num_batched_tokens=7))
    same("chunked prefill (7-token chunks)", _result(chunked.generate([prompt], PARAMS)[0]))

    prefill = LLMEngine(loaded, _config())
    decode = LLMEngine(loaded, _config())
    prefill.add_request("r", prompt, PARAMS, prefill_only=True)
    (done,) = [out for out in _drain(prefill) if out.finish_reason == "prefilled"]
    dest = decode.block_manager.allocate(len(done.block_ids))
    decode.kv.write_blocks(dest, prefill.kv.read_blocks(done.block_ids))
    prefill.release_blocks(done.block_ids)
    remote = _result(done)
    decode.add_prefilled("r", prompt, PARAMS, block_ids=dest, first_token_id=done.new_token_ids[0],
                         first_logprob=done.new_logprobs[0])  # fmt: skip
    for out in _drain(decode):
        remote[0].extend(out.new_token_ids)
        remote[1].extend(lp.logprob if lp is not None else None for lp in out.new_logprobs)
    same("prefilled on one engine, decoded on another", remote)

    migrated = LLMEngine(loaded, _config())
    migrated.add_request("m", prompt, PARAMS, resume_output_ids=expected[0][:5])
    rest: Result = ([], [])
    for out in _drain(migrated):
        rest[0].extend(out.new_token_ids)
        rest[1].extend(lp.logprob if lp is not None else None for lp in out.new_logprobs)
    same("resumed after 5 tokens (a migration)", rest, (expected[0][5:], expected[1][5:]))

    for engine in (cold_engine, cached, chunked, prefill, decode, migrated):
        assert engine.block_manager.num_blocks_in_use == 0
    assert not failures, "\n".join(failures)


def _drain(engine: LLMEngine) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> Iterator[None]:
    """The native kernels (CI requires them), their speed choices fixed rather than measured: the
    choices are among paths with the same bits, so measuring them here would only cost time."""
    native_kernel_or_skip()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_AUTOTUNE", "fixed")
        yield


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_in_float32(family: str, tmp_path: Path) -> None:
    import transformers

    build, head_dim, _ = FAMILIES[family]
    torch.manual_seed(5)
    build(transformers, head_dim).save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path), "auto")
    assert loaded.weight_format == "float32"
    _check_every_path(loaded)


def test_bfloat16_weights(tmp_path: Path) -> None:
    import transformers

    build, head_dim, _ = FAMILIES["qwen3"]
    torch.manual_seed(6)
    build(transformers, head_dim).to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path), "auto")
    assert loaded.weight_format == "bfloat16"
    _check_every_path(loaded, seed=1)


@pytest.mark.parametrize("dtype", ["auto", "q4", "q8_0"])
def test_the_default_model(smollm2_gguf: Path, dtype: str) -> None:
    loaded = load_model(str(smollm2_gguf), dtype)
    if dtype == "auto":
        assert loaded.weight_format in ("q4_a8_decode", "q4")
    _check_every_path(loaded, seed=2)


def test_the_default_model_over_a_q8_0_cache(smollm2_gguf: Path) -> None:
    loaded = load_model(str(smollm2_gguf), "auto")
    _check_every_path(loaded, seed=5, kv="q8_0")


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_q8_0_cache_with_windows_soft_caps_and_short_groups(family: str, tmp_path: Path) -> None:
    """Gemma 2 (sliding window, soft-cap) and Phi-3 at their real head sizes (256, 96: three
    groups of 32) over a ``q8_0`` cache."""
    import transformers

    build, _, head_dim = FAMILIES[family]
    torch.manual_seed(8)
    build(transformers, head_dim).save_pretrained(tmp_path, safe_serialization=True)
    _check_every_path(load_model(str(tmp_path), "auto"), seed=6, kv="q8_0")


def test_gemma3_k_quants() -> None:
    """Gemma 3 270M as stored (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 matrices), sliding-window layers."""
    from services.common.model_source import gemma3_270m_path

    loaded = load_model(str(gemma3_270m_path()), "auto")
    _check_every_path(loaded, seed=3)


async def test_served_twice_through_the_prefix_cache(smollm2_gguf: Path) -> None:
    """Real prefill and decode workers: the same prompt cold and then from the prefill worker's
    prefix cache gives the engine's tokens both times."""
    from services.common.sampling_params import SamplingParams as Params

    loaded = load_model(str(smollm2_gguf), "auto")
    prompt, _ = _prompts(loaded.config.vocab_size, 4)
    params = Params(temperature=0, max_tokens=16, ignore_eos=True)
    engine = LLMEngine(loaded, _base_config(enable_prefix_caching=False))
    expected = engine.generate([prompt], params)[0].new_token_ids
    async with cluster(loaded, prefill_blocks=64, decode_blocks=64) as c:
        first, responses = await c.run("one", prompt, params)
        assert tokens_of(responses) == expected
        await c.wait_idle()
        again, responses = await c.run("two", prompt, params)
        assert again.num_cached_tokens == 2 * BLOCK
        assert tokens_of(responses) == expected
        await c.wait_idle()
