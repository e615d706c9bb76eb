"""Quantized models end to end: which weight format ``--dtype`` resolves to, what a quantized model
holds in memory, and how close its logits and greedy tokens are to the float32 model.

* tiny random Llama (HF folder) as ``q8_0``: every linear and embedding weight quantized at load,
  no float32 weight left; logits equal a float32 model running the dequantized Q8_0 weights
  (that is the whole error), and stay close to the float32 model.
* the default SmolLM2 GGUF (Q4_1 matrices, Q8_0 embedding) as ``q4`` keeps the file's blocks as
  stored, so it is the same network as float32 (which dequantizes them exactly): same greedy
  tokens on 8 chats x 64 tokens, logits equal to float32 rounding, and equal to transformers'
  on the same file. As ``q8_0`` its 4-bit blocks are re-quantized to 8 bits, a small extra error.
* ``bfloat16`` / ``float16`` on CPU are weight-only: 16-bit matrices and embedding, float32
  activations and KV cache; the logits equal a float32 model running the rounded weights.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.common.errors import ModelLoadError
from services.common.model_source import resolve_model
from services.common.sampling_params import SamplingParams
from services.engine.core.attention import AttentionMetadata
from services.engine.core.embedding import Embedding
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.kernels.cpu_q4a8_gemm import load_cpu_q4a8_gemm
from services.engine.core.kernels.cpu_qgemv import load_cpu_qgemv
from services.engine.core.kv_cache import KVLayout, KVPool
from services.engine.core.linear import Linear
from services.engine.core.loaders import DTYPE_CHOICES, LoadedModel, load_model, parse_dtype, resolve_dtype
from services.engine.core.quant.quantized_weight import quantize_q8_0

# SmolLM2's chat template around one user message (token ids from its tokenizer)
SYSTEM = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
          407, 19712, 8182, 2, 198, 1, 4093, 198]  # <|im_start|>system ... <|im_start|>user\n
ASSISTANT = [2, 198, 1, 520, 9531, 198]  # <|im_end|>\n<|im_start|>assistant\n
QUESTIONS = [  # fmt: skip
    [1780, 314, 260, 3575, 282, 4649, 47],  # What is the capital of France?
    [19161, 253, 421, 30614, 563, 260, 3426, 30],  # Write a haiku about the sea.
    [6106, 1296, 9552, 2966, 30],  # List three prime numbers.
    [36971, 732, 253, 659, 70, 13842, 314, 281, 582, 6330, 30],  # Explain what a KV cache is ...
    [26533, 549, 253, 11594, 327, 45137, 30],  # Give me a recipe for pancakes.
    [4898, 314, 260, 6376, 4461, 47],  # Why is the sky blue?
    [8241, 12837, 637, 12018, 5738, 23, 618, 5071, 30],  # Translate 'good morning' into Spanish.
    [19161, 253, 5905, 1517, 338, 10557, 266, 253, 4928, 30],  # Write a Python function that ...
]
CHATS = [SYSTEM + q + ASSISTANT for q in QUESTIONS]
NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a machine busy with other work each two-thread parallel region
    waits a scheduler tick for its second thread (a 64-token run took 90 s instead of 4 s).
    Kernel results do not depend on the thread count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def linears(loaded: LoadedModel) -> list[Linear]:
    return [m for m in loaded.model.modules() if isinstance(m, Linear)]


def float_weight_elements(loaded: LoadedModel) -> int:
    """Elements of the float ``weight`` parameters of linear and embedding layers."""
    return sum(
        m.weight.numel() for m in loaded.model.modules() if isinstance(m, Linear | Embedding)
    )


@torch.inference_mode()
def prefill_logits(loaded: LoadedModel, ids: list[int], block: int = 16) -> torch.Tensor:
    """Logits at every position of ``ids`` run as one prefill (a fresh KV pool)."""
    c = loaded.config
    blocks = -(-len(ids) // block)
    kv = KVPool(blocks + 1, KVLayout(c.num_layers, block, c.num_kv_heads, c.head_dim, "float32"))
    meta = AttentionMetadata.build(
        is_prefill=True, query_lens=[len(ids)], context_lens=[len(ids)],
        block_tables=[list(range(1, blocks + 1))], block_size=block,
    )  # fmt: skip
    hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), kv, meta)
    return loaded.model.compute_logits(hidden)


def agreement(got: list[list[int]], expected: list[list[int]]) -> tuple[int, list[int]]:
    """Tokens equal at the same position, and per sequence the length of the common prefix."""
    same = sum(a == b for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=True))
    prefixes = [
        next((i for i, (a, b) in enumerate(zip(g, e, strict=True)) if a != b), len(e))
        for g, e in zip(got, expected, strict=True)
    ]
    return same, prefixes


# ---------------------------------------------------------------------------- dtype names


def test_auto_picks_q4_a8_decode_for_the_default_gguf_when_the_kernels_build() -> None:
    source = resolve_model("default")
    assert source.kind == "gguf"
    kernel = load_cpu_qgemv()
    if kernel is None or kernel.isa == "generic":
        expected = "float32"
    else:
        expected = "q4_a8_decode" if load_cpu_q4a8_gemm() is not None else "q4"
    assert resolve_dtype("auto", source) == expected
    assert resolve_dtype("auto", source, "cuda") == "bfloat16"  # resolving needs no GPU
    assert resolve_dtype("q8_0", source) == "q8_0" and resolve_dtype("float32", source) == "float32"
    assert resolve_dtype("q4", source) == "q4" and resolve_dtype("q4_a8", source) == "q4_a8"


def test_auto_falls_back_to_q4_without_the_int8_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.engine.core.kernels.cpu_q4a8_gemm as q4a8

    kernel = load_cpu_qgemv()
    if kernel is None or kernel.isa == "generic":
        pytest.skip("auto is float32 where the quantized kernel is generic or absent")
    monkeypatch.setattr(q4a8, "load_cpu_q4a8_gemm", lambda: None)
    assert resolve_dtype("auto", resolve_model("default")) == "q4"


def test_auto_on_an_hf_folder_is_float32_and_q4_is_refused(tiny_llama_dir: Path) -> None:
    source = resolve_model(str(tiny_llama_dir))
    assert source.kind == "hf"
    assert resolve_dtype("auto", source) == "float32"
    assert resolve_dtype("q8_0", source) == "q8_0"
    with pytest.raises(ModelLoadError, match="q4 serves a GGUF's 4-bit weights"):
        resolve_dtype("q4", source)
    with pytest.raises(ModelLoadError, match="q4 serves"):
        load_model(str(tiny_llama_dir), "q4")
    with pytest.raises(ModelLoadError, match="CPU only"):
        resolve_dtype("q8_0", source, "cuda")
    with pytest.raises(ModelLoadError, match="q4 serves"):  # q4_a8 holds q4's weights
        resolve_dtype("q4_a8", source)
    with pytest.raises(ModelLoadError, match="CPU only"):
        resolve_dtype("q4_a8", resolve_model("default"), "cuda")


def _checkpoint_as(source: Path, dest: Path, dtype: torch.dtype, keep_float32: str = "") -> Path:
    """A copy of an HF folder whose tensors are stored as ``dtype`` (except ``keep_float32``)."""
    from safetensors.torch import load_file, save_file

    dest.mkdir()
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, dest / file.name)
            continue
        tensors = load_file(str(file))
        save_file({n: t if n == keep_float32 else t.to(dtype) for n, t in tensors.items()},
                  str(dest / file.name))  # fmt: skip
    return dest


def test_auto_keeps_a_16_bit_checkpoint_16_bit(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A bfloat16 / float16 checkpoint runs weight-only in its own type (no weight rounded, none
    widened in memory); float32 or mixed matrices stay float32."""
    kernel = load_cpu_qgemv()
    fast = kernel is not None and kernel.isa != "generic"
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        folder = _checkpoint_as(tiny_llama_dir, tmp_path / name, dtype)
        assert resolve_dtype("auto", resolve_model(str(folder))) == (name if fast else "float32")
        assert resolve_dtype("auto", resolve_model(str(folder)), "cuda") == "bfloat16"
    mixed = _checkpoint_as(
        tiny_llama_dir, tmp_path / "mixed", torch.bfloat16, "model.layers.0.mlp.up_proj.weight"
    )
    assert resolve_dtype("auto", resolve_model(str(mixed))) == "float32"


@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
def test_half_precision_on_cpu_is_weight_only(tiny_llama_dir: Path, fmt: str) -> None:
    """16-bit matrices and embedding (the tied head shares one table), float32 everything else;
    with the kernel the tiles hold the weights and the embedding reads the head's tiles."""
    loaded = load_model(str(tiny_llama_dir), fmt)
    assert loaded.weight_format == fmt and loaded.dtype == torch.float32
    assert float_weight_elements(loaded) == 0
    assert all(
        p.dtype == torch.float32 for n, p in loaded.model.named_parameters() if "norm" in n
    )
    embed = loaded.model.embed_tokens
    assert embed.quant is not None and embed.quant.qs.dtype == getattr(torch, fmt)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=16))
    assert engine.runner.kv.data.dtype == torch.float32
    for layer in linears(loaded):
        assert layer.weight_format == fmt
        if load_cpu_qgemv() is not None:
            assert layer.packed is not None and layer.quant is None
            assert layer.packed.numel() == layer.in_features * 2 * -(
                -layer.out_features // layer.kernel.tile  # type: ignore[union-attr]
            ) * layer.kernel.tile  # type: ignore[union-attr]  # two bytes a weight, whole tiles


@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
def test_half_precision_logits_are_float32_on_rounded_weights(
    tiny_llama_dir: Path, fmt: str
) -> None:
    """Rounding the weights to 16 bits is the whole difference from float32: the kernel widens
    them exactly and computes in float32."""
    loaded = load_model(str(tiny_llama_dir), fmt)
    LLMEngine(loaded, EngineConfig(num_blocks=16))  # packs the layers for this machine
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    rounded = load_model(str(tiny_llama_dir), "float32")
    for module in rounded.model.modules():
        if isinstance(module, Linear | Embedding):
            module.weight.data = module.weight.data.to(getattr(torch, fmt)).float()
    got, expected = prefill_logits(loaded, ids), prefill_logits(rounded, ids)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("name", ["int4", "Q4", "fp8", "", "torch.float32"])
def test_unknown_dtype_names_are_load_errors(name: str, tiny_llama_dir: Path) -> None:
    assert set(DTYPE_CHOICES) == {"auto", "float32", "bfloat16", "float16", "q8_0", "q4", "q4_a8",
                                  "q4_a8_decode"}  # fmt: skip
    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        parse_dtype(name)
    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        load_model(str(tiny_llama_dir), name)


# ------------------------------------------------------------------- tiny HF llama as q8_0


@pytest.fixture(scope="module")
def tiny_f32(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), "float32")


@pytest.fixture(scope="module")
def tiny_q8(tiny_llama_dir: Path) -> LoadedModel:
    loaded = load_model(str(tiny_llama_dir), "q8_0")
    LLMEngine(loaded, EngineConfig(num_blocks=16))  # packs the layers for this machine
    return loaded


def test_tiny_q8_0_holds_no_float32_weights(tiny_q8: LoadedModel) -> None:
    assert tiny_q8.weight_format == "q8_0" and tiny_q8.dtype == torch.float32
    layers = linears(tiny_q8)
    assert len(layers) == 1 + 4 * tiny_q8.config.num_layers  # qkv, o, gate_up, down; lm_head
    assert float_weight_elements(tiny_q8) == 0
    embed = tiny_q8.model.embed_tokens
    kernel = load_cpu_qgemv() is not None
    if kernel:  # the untied table is held as the kernel's tiles, a step's rows expanded in C
        assert embed.quant is None and embed.rows_from is not None
    else:
        assert embed.quant is not None and embed.quant.format == "q8_0"
    for layer in layers:
        assert layer.weight_format == "q8_0"
        if kernel:  # the kernel's tiles hold the weight, nothing else does
            assert layer.packed is not None and layer.packed.dtype == torch.uint8
            assert layer.quant is None
        else:  # the reference path: the canonical quantized weight, dequantized per call
            assert layer.quant is not None and layer.packed is None


def test_untied_table_read_from_tiles_gives_the_table_rows(
    tiny_q8: LoadedModel, tiny_llama_dir: Path
) -> None:
    """The lookup from the table's tiles is the quantized table's rows, bit for bit."""
    table = load_model(str(tiny_llama_dir), "q8_0").model.embed_tokens  # not packed: its rows
    assert table.quant is not None
    ids = torch.tensor([[0, 7], [tiny_q8.config.vocab_size - 1, 7]])
    assert torch.equal(tiny_q8.model.embed_tokens(ids), table(ids))


def test_tiny_q8_0_logits(tiny_f32: LoadedModel, tiny_q8: LoadedModel, tiny_llama_dir: Path) -> None:
    """The Q8_0 rounding of the weights is the whole difference from float32."""
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    quant = prefill_logits(tiny_q8, ids)
    dense = prefill_logits(tiny_f32, ids)
    # measured 0.0067 max abs, 0.0013 mean (logits' std 0.16); argmax equal at every position
    assert (quant - dense).abs().max() < 0.02
    assert torch.equal(quant.argmax(-1), dense.argmax(-1))

    rounded = load_model(str(tiny_llama_dir), "float32")  # float32 running the Q8_0 values
    for module in rounded.model.modules():
        if isinstance(module, Linear | Embedding):
            module.weight.data = quantize_q8_0(module.weight.data).dequantize()
    expected = prefill_logits(rounded, ids)  # measured 0 to 2e-7 apart
    assert torch.allclose(quant, expected, atol=1e-5), (quant - expected).abs().max()


# ------------------------------------------------------------------- default SmolLM2 GGUF


def _capture_logits(engine: LLMEngine) -> list[torch.Tensor]:
    """Record the logits the engine samples from, one ``[rows, vocab]`` tensor per step."""
    steps: list[torch.Tensor] = []
    sampler = engine.runner.sampler

    def capture(logits, states):  # type: ignore[no-untyped-def]
        steps.append(logits.clone())
        return sampler(logits, states)

    engine.runner.sampler = capture  # type: ignore[assignment]
    return steps


def _greedy_run(dtype: str) -> tuple[LoadedModel, list[list[int]], list[torch.Tensor]]:
    """The default model as ``dtype``: greedy tokens for CHATS and the logits of every step."""
    loaded = load_model("default", dtype)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=256))
    steps = _capture_logits(engine)
    outputs = engine.generate(CHATS, GREEDY)
    return loaded, [o.new_token_ids for o in outputs], steps


@pytest.fixture(scope="module")
def smol_f32() -> tuple[LoadedModel, list[list[int]], list[torch.Tensor]]:
    return _greedy_run("float32")


@pytest.fixture(scope="module")
def smol_q4() -> tuple[LoadedModel, list[list[int]], list[torch.Tensor]]:
    return _greedy_run("q4")


@pytest.mark.slow
def test_smollm2_q4_holds_its_4bit_blocks(smol_f32, smol_q4) -> None:  # type: ignore[no-untyped-def]
    f32, q4 = smol_f32[0], smol_q4[0]
    assert q4.weight_format == "q4"
    assert float_weight_elements(q4) == 0  # the tied head and the embedding are quantized too
    embedding = q4.model.embed_tokens
    layers = linears(q4)
    if load_cpu_qgemv() is None:
        assert embedding.quant is not None and embedding.quant.format == "q8_0"  # as in the file
        assert all(layer.quant is not None for layer in layers)
        return
    # the Q8_0 table is held once: the embedding reads the tied head's tiles
    assert embedding.quant is None and embedding.rows_from is not None
    assert all(layer.packed is not None and layer.packed.dtype == torch.uint8 for layer in layers)
    assert {layer.weight_format for layer in layers} == {"q4", "q8_0"}  # matrices, tied head
    assert q4.model.lm_head.weight_format == "q8_0"
    held = sum(layer.packed.numel() for layer in layers)
    c = f32.config  # float32 bytes of the same matrices (the head tied to the embedding)
    dense = 4 * (c.vocab_size * c.hidden_size + sum(
        layer.out_features * layer.in_features for layer in linears(f32)
        if layer is not f32.model.lm_head
    ))  # fmt: skip
    # measured 111.5 MB of tiles (31.9 MB of them the tied head, which the embedding reads) vs
    # 537.9 MB of float32: 0.21
    assert held < 0.25 * dense, (held, dense)


@pytest.mark.slow
def test_smollm2_q4_greedy_and_logits_equal_float32(  # type: ignore[no-untyped-def]
    smol_f32, smol_q4
) -> None:
    """The q4 model runs the file's 4-bit weights, which float32 dequantizes exactly: the same
    network, so only summation order may differ (the q4 kernel factors each group's scale and
    offset out of its sum): the logits differ by float32 rounding."""
    (f32, f32_tokens, f32_steps), (q4, q4_tokens, q4_steps) = smol_f32, smol_q4
    same, prefixes = agreement(q4_tokens, f32_tokens)
    assert same == len(CHATS) * NEW_TOKENS, prefixes  # measured 512 / 512
    # the logits each engine sampled from, step by step (prefill, then decode of 8 rows)
    assert len(q4_steps) == len(f32_steps) == NEW_TOKENS
    decode_diff = max((a - b).abs().max().item() for a, b in zip(q4_steps, f32_steps, strict=True))
    assert decode_diff < 5e-4, decode_diff  # measured 8.5e-5
    for chat, continuation in zip(CHATS[:3], f32_tokens, strict=False):  # long prefills
        ids = chat + continuation
        diff = (prefill_logits(q4, ids) - prefill_logits(f32, ids)).abs().max().item()
        assert diff < 5e-4, diff  # measured 9.4e-5 to 9.5e-5


@pytest.mark.slow
def test_smollm2_q4_matches_transformers(  # type: ignore[no-untyped-def]
    smol_q4, smollm2_gguf: Path
) -> None:
    """transformers dequantizes the same GGUF to float32: the q4 engine's greedy tokens are its
    argmax at every position (teacher-forced; measured free-running as well: 512 / 512 equal)
    and the logits agree to float32 rounding (measured 1.4e-4 per chat + 64 tokens)."""
    from transformers import AutoModelForCausalLM

    q4, q4_tokens, _ = smol_q4
    hf = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    same = 0
    for i, (chat, continuation) in enumerate(zip(CHATS, q4_tokens, strict=True)):
        ids = chat + continuation
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        picks = expected[len(chat) - 1 : -1].argmax(-1).tolist()
        same += sum(a == b for a, b in zip(picks, continuation, strict=True))
        if i < 3:
            diff = (prefill_logits(q4, ids) - expected).abs().max().item()
            assert diff < 5e-4, diff
    assert same == len(CHATS) * NEW_TOKENS  # measured 512 / 512


@pytest.mark.slow
def test_smollm2_q8_0_requantizes_the_4bit_blocks(smol_f32) -> None:  # type: ignore[no-untyped-def]
    """``q8_0`` re-quantizes the file's Q4_1 matrices to Q8_0 (the embedding is Q8_0 already):
    the result equals float32 running those rounded weights, a small step from float32."""
    f32, f32_tokens, _ = smol_f32
    q8 = load_model("default", "q8_0")
    assert q8.weight_format == "q8_0" and float_weight_elements(q8) == 0
    engine = LLMEngine(q8, EngineConfig(num_blocks=256))
    assert {layer.weight_format for layer in linears(q8)} == {"q8_0"}
    outputs = engine.generate(CHATS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    same, prefixes = agreement([o.new_token_ids for o in outputs], [t[:16] for t in f32_tokens])
    # measured 98 / 128 tokens equal; common prefixes [16, 16, 0, 9, 16, 16, 16, 8]: greedy
    # decoding of a 135M model flips at near-ties (the third chat at its first token)
    assert same >= 80 and sum(p == 16 for p in prefixes) >= 4, (same, prefixes)

    ids = CHATS[5]
    got, dense = prefill_logits(q8, ids), prefill_logits(f32, ids)
    assert (got - dense).abs().max() < 3.0  # measured 1.32 max abs, 0.22 mean (logits' std 8)
    assert (got.argmax(-1) == dense.argmax(-1)).float().mean() > 0.9  # measured 0.972

    rounded = load_model("default", "float32")  # float32 running the re-quantized values
    for layer in linears(rounded):
        if layer is not rounded.model.lm_head:  # tied to the Q8_0 embedding: unchanged
            layer.weight.data = quantize_q8_0(layer.weight.data).dequantize()
    expected = prefill_logits(rounded, ids)
    assert (got - expected).abs().max() < 5e-4  # measured 9.1e-5


@pytest.mark.slow
def test_smollm2_q4_a8_rounds_prompt_activations_to_int8(  # type: ignore[no-untyped-def]
    smol_f32, smol_q4
) -> None:
    """``q4_a8``: q4's weights, prompt tokens' rows over int8 activations (llama.cpp's scheme),
    generated tokens' over float32 ones. Measured against float32, as docs/models.md states:
    teacher-forced argmax over float32's greedy text (every position through the int8 path),
    free-running greedy tokens, logits."""
    (f32, f32_tokens, _), (_, q4_tokens, _) = smol_f32, smol_q4
    q4a8 = load_model("default", "q4_a8")
    assert q4a8.weight_format == "q4_a8" and q4a8.int8_activations
    engine = LLMEngine(q4a8, EngineConfig(num_blocks=256))
    tokens = [o.new_token_ids for o in engine.generate(CHATS, GREEDY)]
    rounded = [layer for layer in linears(q4a8) if layer.int8_activations]
    if not rounded:  # no kernel here, or it measured slower than float32 activations: q4 exactly
        assert tokens == q4_tokens
        return
    assert {layer.weight_format for layer in rounded} == {"q4"}
    same, prefixes = agreement(tokens, f32_tokens)
    teacher, worst, kl = 0, 0.0, []
    for chat, continuation in zip(CHATS, f32_tokens, strict=True):
        ids = chat + continuation
        got = prefill_logits(q4a8, ids)  # every row rounded, as the engine rounds every row
        dense = prefill_logits(f32, ids)
        worst = max(worst, (got - dense).abs().max().item())
        picks = got[len(chat) - 1 : -1].argmax(-1).tolist()
        teacher += sum(a == b for a, b in zip(picks, continuation, strict=True))
        kl.append(torch.nn.functional.kl_div(
            got.log_softmax(-1), dense.log_softmax(-1), log_target=True, reduction="batchmean"
        ).item())  # fmt: skip
    print(f"q4_a8: free-running {same}/512 {prefixes}, teacher-forced {teacher}/512, "
          f"max |diff| {worst:.3f}, KL per chat {[round(k, 4) for k in kl]}")  # fmt: skip
    # measured (Zen 3, AVX2): teacher-forced 494 / 512, max |diff| 1.94 (logits' std ~8), KL
    # 0.0027-0.0043 nats per chat; free-running 164 / 512 (greedy flips at the first near-tie,
    # prefixes [0, 64, 3, 9, 31, 11, 0, 27]). With the offsets times the exact input sums instead
    # of the rounded ones (a kernel bug once): 473 / 512 and KL ~0.02.
    assert teacher >= 0.95 * len(CHATS) * NEW_TOKENS, teacher
    assert worst < 3.0, worst
    assert max(kl) < 0.01, kl
    assert same >= len(CHATS) * NEW_TOKENS // 8, (same, prefixes)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["q4_a8", "q4_a8_decode"])
def test_smollm2_q4_a8_resumed_requests_continue_as_before(dtype: str) -> None:
    """A request whose generated tokens are recomputed with its prompt (migrated from a dead
    decode worker, or preempted) goes on with the tokens it would have produced. ``q4_a8``
    rounds only prompt tokens' rows (before, any step of 33+ prompt-chunk rows rounded all of
    them, the recomputed outputs too: their KV changed and greedy text diverged after a
    migration); ``q4_a8_decode`` rounds generated rows too, through the decode kernel, and the
    recomputed tokens attend through the decode attention kernel as when they were generated
    (before, they met the prefill kernel, whose last-bit differences the int8 rounding turned
    into a quantum: 19/96, 64/96 tokens equal after cuts at 1 and 8)."""
    loaded = load_model("default", dtype)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=256))
    assert loaded.int8_decode == (dtype == "q4_a8_decode")
    if not loaded.int8_decode:  # q4_a8 rounds the GEMM's formats only, q4 none
        assert all(layer.weight_format in ("q4", "q4_k") for layer in linears(loaded)
                   if layer.int8_activations)  # fmt: skip
    chats, params = CHATS[:3], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    alone = [o.new_token_ids for o in engine.generate(chats, params)]
    for cut in (1, 8, 24):
        for i, (chat, expected) in enumerate(zip(chats, alone, strict=True)):
            engine.add_request(f"{cut}-{i}", chat, params, resume_output_ids=expected[:cut])
        tokens = {f"{cut}-{i}": list(expected[:cut]) for i, expected in enumerate(alone)}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
        assert [tokens[f"{cut}-{i}"] for i in range(len(chats))] == alone, cut
