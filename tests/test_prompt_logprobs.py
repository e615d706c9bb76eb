"""Prompt logprobs (vLLM's ``prompt_logprobs``) and ``echo`` with ``logprobs`` on completions:
every prompt token's logprob, rank and top k equal ``transformers``' float32 log-softmax on the
same weights — in the engine (cold, chunked, a prompt whose prefix is cached, batched with
others), and served through the real gateway with the official ``openai`` SDK, prefilled by the
prefill worker (carried back in its reply) and by the decode worker itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest
import pytest_asyncio
import torch

from services.common.sampling_params import SamplingParams
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import load_model
from tests.tiny_stack import API_KEY, REMOTE_PREFILL_MIN_TOKENS, TinyStack, tiny_stack, write_tiny_model

TOLERANCE = 1e-4
VOCAB = 512


def reference(folder: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax over the prompt: row i is the distribution of token i+1."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield write_tiny_model(tmp_path_factory.mktemp("plp") / "m", VOCAB)


def rank_ok(rank: int, row: torch.Tensor, value: torch.Tensor) -> bool:
    """The rank counts the tokens more likely than the chosen one; a random model's flat
    distribution has many within float32 rounding of it, so those may fall either side."""
    return int((row > value + TOLERANCE).sum()) + 1 <= rank <= int((row > value - TOLERANCE).sum()) + 1


def check(scored: list, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert [lp.token_id for lp in scored] == prompt[1:]
    for i, lp in enumerate(scored):
        row = ref[i]
        assert abs(lp.logprob - row[prompt[i + 1]].item()) < TOLERANCE, i
        assert rank_ok(lp.rank, row, row[prompt[i + 1]])
        top = torch.topk(row, k)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(lp.top, top.values.tolist())) < TOLERANCE


def test_engine_prompt_logprobs_equal_transformers_on_every_path(tiny: Path) -> None:
    loaded = load_model(str(tiny), "float32", "cpu")
    prompt = [(37 * i + 11) % (VOCAB - 3) + 3 for i in range(70)]
    ref = reference(tiny, prompt)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=128))
    cold = engine.generate([prompt], params)[0]
    check(cold.prompt_logprobs, prompt, ref, 4)
    # the same prompt again: its blocks are cached, yet every position is scored (computed whole)
    again = engine.generate([prompt], params)[0]
    assert again.prompt_logprobs == cold.prompt_logprobs
    assert again.num_cached_tokens == 0
    # chunked prefill (16-token chunks), batched with prompts that ask for nothing
    chunked = LLMEngine(loaded, EngineConfig(num_blocks=128, max_num_batched_tokens=16))
    others = [[(5 * i + j) % 400 + 3 for i in range(30)] for j in range(3)]
    outs = chunked.generate([others[0], prompt, *others[1:]],
                            [SamplingParams(temperature=0, max_tokens=3)] + [params] * 3)  # fmt: skip
    check(outs[1].prompt_logprobs, prompt, ref, 4)
    assert outs[0].prompt_logprobs is None
    check(outs[2].prompt_logprobs, others[1], reference(tiny, others[1]), 4)
    # the tokens generated are those of a request without prompt logprobs
    plain = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3))[0]
    assert plain.new_token_ids == cold.new_token_ids and plain.prompt_logprobs is None


def test_out_of_range_prompt_logprobs_is_refused() -> None:
    with pytest.raises(Exception, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[TinyStack, Path]]:
    """The in-process stack on a tiny random Llama, and the folder its weights are in."""
    folder = tmp_path_factory.mktemp("plp-stack")
    async with tiny_stack(folder) as started:
        yield started, folder


def _client(stack: TinyStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("words", [4, 60], ids=["decode-prefills", "prefill-worker"])
async def test_echo_with_logprobs_scores_the_prompt(served: tuple[TinyStack, Path],
                                                    words: int) -> None:  # fmt: skip
    stack, folder = served
    client = _client(stack)
    prompt_ids = [(13 * i + 7) % 40000 + 1000 for i in range(words)]
    assert (len(prompt_ids) >= REMOTE_PREFILL_MIN_TOKENS) == (words == 60)
    reply = await client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=3,
                                            temperature=0, echo=True, logprobs=2)  # fmt: skip
    ref = reference(folder, prompt_ids)
    lp = reply.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(prompt_ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = torch.tensor(lp.token_logprobs[1 : len(prompt_ids)])
    want = ref[torch.arange(len(prompt_ids) - 1), torch.tensor(prompt_ids[1:])]
    assert (got - want).abs().max().item() < TOLERANCE
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    n = len(prompt_ids)
    assert lp.tokens is not None and lp.text_offset is not None
    assert lp.text_offset[:n] == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    # vLLM's field on the same request: token id -> logprob, rank, decoded token
    raw = await client.completions.with_raw_response.create(
        model="tiny", prompt=prompt_ids, max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": 1})  # fmt: skip
    scored = raw.http_response.json()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt_ids)
    for i, position in enumerate(scored[1:]):
        entry = position[str(prompt_ids[i + 1])]
        assert abs(entry["logprob"] - want[i].item()) < TOLERANCE
        assert rank_ok(entry["rank"], ref[i], want[i])
        assert isinstance(entry["decoded_token"], str)
    await stack.wait_idle()


@pytest.mark.asyncio(loop_scope="module")
async def test_chat_prompt_logprobs_at_the_top_level_and_never_streamed(
    served: tuple[TinyStack, Path],
) -> None:
    stack, _ = served
    client = _client(stack)
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hello there " * 20}], max_tokens=2,
        temperature=0, extra_body={"prompt_logprobs": 0})  # fmt: skip
    body = raw.http_response.json()
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert len(body["prompt_logprobs"]) == prompt_tokens and body["prompt_logprobs"][0] is None
    assert all(len(p) == 1 for p in body["prompt_logprobs"][1:])  # the prompt's token alone
    for extra, param in (({"prompt_logprobs": 1}, "prompt_logprobs"),):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
                extra_body=extra)  # fmt: skip
        assert caught.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model="tiny", prompt="hi", echo=True, logprobs=1,
                                        stream=True)  # fmt: skip
    assert caught.value.body["param"] == "echo"  # type: ignore[index]
    await stack.wait_idle()
