"""Every model family on the GPU (marked ``gpu``; skipped cleanly where there is no CUDA device):
``--device cuda`` in float32 against the CPU engine on the same random weights (a
``transformers`` checkpoint of each family at its realistic head size: Gemma's 256, Phi-3's 96,
Qwen's 128), the prompt's last-position logits close and greedy output token for token, decode
steps replayed from CUDA graphs (where the family can be captured) and eager. The prompts and
the generation run well past the sliding window, so Gemma's windowed layers decode through the
Triton kernel's window inside the graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_model_families import FAMILIES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _greedy(engine: object, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from services.common.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [out.new_token_ids for out in engine.generate(prompts, params)]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_on_cuda_matches_the_cpu_engine(name: str, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:  # fmt: skip
    import transformers

    from services.engine.core.attention import AttentionMetadata
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model

    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")  # the CPU side is PyTorch's reference path
    torch.backends.cuda.matmul.allow_tf32 = False
    build, _, head_dim = FAMILIES[name]
    torch.manual_seed(7)
    build(transformers, head_dim).eval().save_pretrained(tmp_path, safe_serialization=True)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 40, 13)]
    results: dict[str, list[list[int]]] = {}
    logits: dict[str, torch.Tensor] = {}
    for run, device, graphs in (("cpu", "cpu", False), ("cuda", "cuda", True),
                                ("cuda-eager", "cuda", False)):  # fmt: skip
        loaded = load_model(str(tmp_path), "float32", device)
        engine = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=96, cuda_graphs=graphs))
        if run == "cuda":  # every dense family is captured; the MoE says why it is not
            assert (engine.runner.graphs is not None) == loaded.model.graph_safe(), name
        results[run] = _greedy(engine, prompts, 24)
        ids = torch.tensor(prompts[1], device=device)
        meta = AttentionMetadata.build(is_prefill=True, query_lens=[len(ids)],
                                       context_lens=[len(ids)], block_tables=[list(range(1, 11))],
                                       block_size=4, device=device)  # fmt: skip
        with torch.inference_mode():
            hidden = loaded.model(ids, torch.arange(len(ids), device=device), engine.kv, meta)
            logits[run] = loaded.model.compute_logits(hidden[-1:]).cpu()
    assert logits["cpu"].abs().max() > 0.05
    assert (logits["cpu"] - logits["cuda"]).abs().max().item() < 1e-4, name
    assert results["cuda"] == results["cpu"], name
    assert results["cuda-eager"] == results["cpu"], name
