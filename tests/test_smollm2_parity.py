"""The default SmolLM2 GGUF: Tandem's GGUF loader + paged engine vs transformers on the same file.

Greedy generation of 32 tokens must equal transformers' token for token on several prompts
(run as one batch through the paged engine), logits must match to ~1e-4, and the
``tandem generate ... --json`` demo of docs/getting-started.md must print transformers' token ids.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import LoadedModel, load_model

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a KV cache is in one sentence.",
]


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model("default", torch.float32)


def _chat_ids(tok, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2,
        )
    return out[0, len(prompt):].tolist()


def test_config_from_gguf_metadata(ours: LoadedModel) -> None:
    c = ours.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta) == (1536, 49152, 100000.0)
    assert c.tie_word_embeddings and c.max_position_embeddings == 8192


@torch.no_grad()
def test_logits_match_transformers(ours: LoadedModel, hf_model, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = _chat_ids(hf_tokenizer, CHATS[0])
    engine = LLMEngine(ours, EngineConfig(num_blocks=32))
    seq_logits = {}

    def capture(logits: torch.Tensor, states):  # type: ignore[no-untyped-def]
        seq_logits["last"] = logits.clone()
        return original(logits, states)

    original = engine.runner.sampler
    engine.runner.sampler = capture  # type: ignore[assignment]
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    diff = (seq_logits["last"][0] - expected).abs().max().item()
    assert diff < 2e-4, diff


def test_greedy_32_tokens_match_transformers_batched(ours: LoadedModel, hf_model, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompts = [_chat_ids(hf_tokenizer, text) for text in CHATS]
    prompts.append(hf_tokenizer("The quick brown fox").input_ids)
    engine = LLMEngine(ours, EngineConfig(num_blocks=256))
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.new_token_ids == _hf_greedy(hf_model, prompt, 32)


def test_cli_generate_json_matches_transformers(hf_model, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """docs/getting-started.md's ``tandem generate`` example with ``--dtype q4``: the GGUF's
    4-bit weights with float32 activations give transformers' greedy ids (the default, ``q4_a8``
    on AVX2/AVX-512, rounds the prompt's activations as llama.cpp does and flips this prompt's
    first token)."""
    question = "What is the capital of France?"
    proc = subprocess.run(
        [sys.executable, "-m", "services", "generate", "--model", "default", "--chat", question,
         "--temperature", "0", "--max-tokens", "32", "--json", "--dtype", "q4"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    record = json.loads(proc.stdout.strip().splitlines()[0])
    prompt = _chat_ids(hf_tokenizer, question)
    expected = _hf_greedy(hf_model, prompt, 32)
    # Tandem stops at EOS (<|im_end|>); transformers was told to ignore it, so compare the prefix.
    assert record["token_ids"] == expected[: len(record["token_ids"])]
    assert record["finish_reason"] in ("stop", "length")
    assert record["prompt_tokens"] == len(prompt)
    assert record["text"] == hf_tokenizer.decode(record["token_ids"], skip_special_tokens=True)
