"""The worker's one owner of text (``services.engine.runtime.output_text``): the engine returns
token ids only; ``OutputText`` turns them into text deltas, and a completed stop string ends the
request in the engine before the next step (no token past the stop, every block freed).

Real pieces: the dummy tiny model (random weights, vocab 512) and the default model's tokenizer.
"""

from __future__ import annotations

import pytest
import torch

from services.common.model_source import resolve_model
from services.common.sampling_params import SamplingParams
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import LoadedModel, load_model
from services.engine.runtime.engine_loop import EngineLoop
from services.engine.runtime.output_text import OutputText
from services.tokenizer.tokenizer import Tokenizer

PROMPT = [5, 17, 260, 33, 401, 77]


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("dummy:tiny")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(resolve_model("default"))


def _engine(tiny: LoadedModel) -> LLMEngine:
    return LLMEngine(tiny, EngineConfig(num_blocks=32, enable_prefix_caching=False))


def _free_run(tiny: LoadedModel, tokenizer: Tokenizer) -> tuple[list[int], str]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with torch.inference_mode():
        out = _engine(tiny).generate([PROMPT], params, output_filter=OutputText(tokenizer))[0]
    return out.new_token_ids, out.text


def test_engine_alone_has_no_text(tiny: LoadedModel) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=("a",))
    with torch.inference_mode():
        out = _engine(tiny).generate([PROMPT], params)[0]
    assert out.text == "" and len(out.new_token_ids) == 8 and out.finish_reason == "length"


def test_text_is_the_decoded_ids(tiny: LoadedModel, tokenizer: Tokenizer) -> None:
    ids, text = _free_run(tiny, tokenizer)
    assert text == tokenizer.decode(ids) and text


def test_a_stop_string_ends_the_request_in_the_engine(tiny: LoadedModel, tokenizer: Tokenizer) -> None:
    ids, text = _free_run(tiny, tokenizer)
    # a stop string completed by the 10th token: its text from the 10th token's own text
    before, upto = tokenizer.decode(ids[:9]), tokenizer.decode(ids[:10])
    assert upto.startswith(before) and len(upto) > len(before)
    stop = upto[len(before):]
    cut = text.index(stop)
    engine = _engine(tiny)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=(stop,))
    with torch.inference_mode():
        out = engine.generate([PROMPT], params, output_filter=OutputText(tokenizer))[0]
    assert out.finish_reason == "stop" and out.text == text[:cut]
    assert out.new_token_ids == ids[: len(out.new_token_ids)] and len(out.new_token_ids) <= 10
    assert engine.block_manager.num_free_blocks == 32 and not engine.has_unfinished()


def _stepwise(tiny: LoadedModel, tokenizer: Tokenizer, resume: list[int]) -> list[tuple[int, str]]:
    """(token, text delta) per output of one request, resumed after ``resume`` when given."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine, texts = _engine(tiny), OutputText(tokenizer)
    deltas: list[tuple[int, str]] = []
    with torch.inference_mode():
        engine.add_request("r", PROMPT, params, resume_output_ids=resume)
        texts.start("r", PROMPT, params, resume)
        while engine.has_unfinished():
            for out in engine.step():
                texts.apply(out, engine)
                assert len(out.new_token_ids) == 1
                deltas.append((out.new_token_ids[0], out.text))
    return deltas


def test_a_resumed_request_continues_the_text(tiny: LoadedModel, tokenizer: Tokenizer) -> None:
    """A stream migrated after k tokens: the text the first worker sent for them plus the text
    the second sends after them is exactly the unmoved stream's text."""
    whole = _stepwise(tiny, tokenizer, [])
    ids, text = [t for t, _ in whole], "".join(d for _, d in whole)
    for k in (1, 7, 15):
        sent = "".join(d for _, d in whole[:k])
        rest = _stepwise(tiny, tokenizer, ids[:k])
        assert [t for t, _ in rest] == ids[k:]
        assert sent + "".join(d for _, d in rest) == text


async def test_the_engine_loop_applies_text_on_its_thread(tiny: LoadedModel, tokenizer: Tokenizer) -> None:
    ids, text = _free_run(tiny, tokenizer)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    expected = text[: text.index(stop)]
    engine, output_text = _engine(tiny), OutputText(tokenizer)
    loop = EngineLoop(engine, output_filter=output_text)
    loop.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=(stop,))
        outs = [out async for out in loop.generate("r1", PROMPT, params)]
        assert "".join(o.text for o in outs) == expected and outs[-1].finish_reason == "stop"
        # a prefill-only request has no text and starts no stream
        outs = [out async for out in loop.generate("r2", PROMPT, params, prefill_only=True)]
        assert outs[-1].finish_reason == "prefilled" and outs[-1].text == ""
        await loop.release("r2")
        assert len(output_text) == 0
        assert await loop.call(lambda e: e.block_manager.num_free_blocks) == 32
    finally:
        await loop.stop()
