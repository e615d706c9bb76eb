"""Shared fixtures: a tiny random Llama saved by transformers, and the default SmolLM2 model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.engine.core.kernels.native_build import architecture_isas

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# fixtures: make_stack (fake services behind the real gateway), tokenizer/server/channel
# (a real grpc.aio server with small fake servicers), start_up (``tandem up`` as a subprocess)
pytest_plugins = ["tests.gateway_fakes", "tests.grpc_fakes", "tests.up_process"]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for a test, the count restored after. Results do not depend on it;
    timings do: on a busy machine every two-thread parallel region waits a scheduler tick (~4 ms)
    for its second thread, which drowns what is measured."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LlamaForCausalLM (GQA, untied head, llama3 rope scaling) saved as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from services.common.model_source import default_model_path

    return default_model_path()


def native_kernel_or_skip():  # type: ignore[no-untyped-def]
    """The native CPU matmul kernel; skips without one (fails instead on CI, which must have it)."""
    from services.engine.core.kernels.cpu_gemv import load_cpu_gemv

    kernel = load_cpu_gemv()
    if kernel is None:
        if os.environ.get("TANDEM_REQUIRE_CPU_KERNELS") == "1":
            pytest.fail("the native CPU kernel must build here (TANDEM_REQUIRE_CPU_KERNELS=1)")
        pytest.skip("no native CPU kernel on this machine (no C compiler or not Linux)")
    return kernel


@pytest.fixture(params=architecture_isas())  # x86-64's sets, or aarch64's (neondot, generic)
def isa(request: pytest.FixtureRequest) -> str:
    """Each instruction-set build of the native kernels this CPU runs (the others skip)."""
    from services.engine.core.kernels.native_build import supported_isas

    native_kernel_or_skip()
    if request.param not in supported_isas():
        pytest.skip(f"this CPU lacks {request.param}")
    return str(request.param)
