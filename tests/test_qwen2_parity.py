"""A tiny random Qwen2 (QKV bias, tied head) through Tandem's HF loader matches transformers."""

from __future__ import annotations

import pytest
import torch

from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import load_model
from services.common.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, eos_token_id=199,
    )
    model = Qwen2ForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


@torch.no_grad()
def test_qwen2_greedy_matches_transformers(qwen_dir) -> None:  # type: ignore[no-untyped-def]
    folder, ref = qwen_dir
    loaded = load_model(str(folder))
    assert loaded.config.attention_bias and loaded.config.tie_word_embeddings
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=64))
    prompt = [5, 17, 42, 99, 3, 8, 150]
    ours = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    expected = ref.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt):].tolist()
    assert ours[0].new_token_ids == expected
