"""The CUDA path, on the device (marked ``gpu``; skipped cleanly where there is no CUDA device):

* the Triton decode kernels against a float64 reference on the GPU, float32 and bfloat16, for
  short contexts and ones split over many partitions;
* ``--device cuda`` in float32 against the CPU engine on the same weights: prompt logits close
  and greedy output token for token, with decode steps replayed from CUDA graphs and without;
* a served request: ``tandem up`` on the GPU (both workers sharing it), the official ``openai``
  client streaming a short prompt (prefilled on decode) and a long one (prefilled on the prefill
  worker, its KV handed to decode), and no KV left in use afterwards.

The served test needs a tokenizer: the default model's (its GGUF), or, where that is not
installed (a GPU box that cannot receive the model file), a ``tokenizer.json`` named by
``TANDEM_TEST_TOKENIZER_JSON``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.ports import free_ports
from tests.tiny_stack import write_tiny_model
from tests.up_process import StartUp, port_flags, wait_kv_freed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOKENIZER_ENV = "TANDEM_TEST_TOKENIZER_JSON"


def _reference_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                      tables: list[list[int]], lens: list[int], scale: float) -> torch.Tensor:
    """Float64 attention of each sequence's one query over its context (gathered by table)."""
    out = []
    group = q.shape[1] // kc.shape[2]
    for row, (table, n) in enumerate(zip(tables, lens)):
        keys = kc[table].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)  # [n, H, D]
        values = vc[table].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[row].double(), keys) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
    return torch.stack(out)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_triton_decode_kernel_on_the_device(dtype: torch.dtype, tolerance: float) -> None:
    from services.engine.core.kernels.paged_decode_attention import paged_decode_attention

    generator = torch.Generator(device="cuda").manual_seed(1)
    heads, kv_heads, dim, bs = 32, 8, 128, 16
    lens = [1, 17, 300, 4096, 9000]
    num_blocks = 4 + sum(-(-n // bs) for n in lens)
    # a pool shaped like the engine's: [blocks, layers, K/V, slots, kv heads, dim], layer 1 used
    pool = torch.randn(num_blocks, 2, 2, bs, kv_heads, dim, device="cuda", dtype=dtype,
                       generator=generator)  # fmt: skip
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    order = torch.randperm(num_blocks - 1, device="cuda", generator=generator).tolist()
    tables, used = [], 0
    for n in lens:
        need = -(-n // bs)
        tables.append([1 + b for b in order[used : used + need]])
        used += need
    width = max(map(len, tables))
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], device="cuda")
    q = torch.randn(len(lens), heads, dim, device="cuda", dtype=dtype, generator=generator)
    scale = dim**-0.5
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    out.copy_(paged_decode_attention(q, kc, vc, table_tensor,
                                     torch.tensor(lens, device="cuda"), scale))  # fmt: skip
    ref = _reference_decode(q, kc, vc, tables, lens, scale)
    assert not out.isnan().any()
    error = ((out.double() - ref).norm() / ref.norm()).item()
    assert error < tolerance, error


def _write_model(folder: Path, vocab: int, context: int) -> Path:
    """A 4-layer random Llama as a Hugging Face folder (weights made on the CPU: both devices
    load the very same ones)."""
    return write_tiny_model(folder, vocab, context=context, hidden=256, layers=4, heads=8)


def _greedy(engine: object, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from services.common.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [out.new_token_ids for out in engine.generate(prompts, params)]  # type: ignore[attr-defined]


def test_cuda_float32_matches_the_cpu_engine(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    from services.engine.core.attention import AttentionMetadata
    from services.engine.core.engine import EngineConfig, LLMEngine
    from services.engine.core.loaders import load_model

    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")  # the CPU side is PyTorch's reference path
    torch.backends.cuda.matmul.allow_tf32 = False
    folder = _write_model(tmp_path / "model", vocab=4096, context=1024)
    prompts = [[1 + (7 * i + 3 * j) % 4000 for j in range(n)] for i, n in enumerate((5, 40, 130))]
    results = {}
    logits = {}
    for name, device, graphs in (("cpu", "cpu", False), ("cuda", "cuda", True),
                                 ("cuda-eager", "cuda", False)):  # fmt: skip
        loaded = load_model(str(folder), "float32", device)
        engine = LLMEngine(loaded, EngineConfig(num_blocks=128, cuda_graphs=graphs))
        assert (engine.runner.graphs is not None) == graphs
        results[name] = _greedy(engine, prompts, 24)
        # the prompt's last-position logits, straight from the model
        ids = torch.tensor(prompts[2], device=device)
        meta = AttentionMetadata.build(is_prefill=True, query_lens=[len(prompts[2])],
                                       context_lens=[len(prompts[2])], block_tables=[list(range(1, 10))],
                                       block_size=16, device=device)  # fmt: skip
        with torch.inference_mode():
            hidden = loaded.model(ids, torch.arange(len(prompts[2]), device=device), engine.kv, meta)
            logits[name] = loaded.model.compute_logits(hidden[-1:]).cpu()
    assert (logits["cpu"] - logits["cuda"]).abs().max().item() < 1e-4
    assert results["cuda"] == results["cpu"]
    assert results["cuda-eager"] == results["cpu"]


def _tokenizer_json(tmp: Path) -> Path:
    named = os.environ.get(TOKENIZER_ENV)
    if named:
        return Path(named)
    from services.common.model_source import resolve_model
    from services.tokenizer.tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer.load(resolve_model("default"))
    except Exception as err:  # noqa: BLE001 - no default model here
        pytest.skip(f"no tokenizer: the default model is missing ({err}) and {TOKENIZER_ENV} "
                    "is unset")  # fmt: skip
    path = tmp / "tokenizer.json"
    tokenizer._backend.save(str(path))  # the fast tokenizer behind it
    return path


def test_served_request_through_tandem_up_on_the_gpu(start_up: StartUp, tmp_path: Path) -> None:
    import openai

    tokenizer = json.loads(_tokenizer_json(tmp_path).read_text())
    vocab = max(tokenizer["model"]["vocab"].values()) + 1
    vocab = max([vocab] + [t["id"] + 1 for t in tokenizer.get("added_tokens", [])])
    folder = _write_model(tmp_path / "model", vocab=vocab, context=2048)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    gateway_port = free_ports(1)[0]
    up = start_up("--model", str(folder), "--prefill", "1", "--decode", "1",
                  "--gateway-port", str(gateway_port), *port_flags(1, 1),
                  env={**os.environ, "TANDEM_DEVICE": "cuda"}, gateway=True)  # fmt: skip
    up.wait_ready()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="unused")
    model = client.models.list().data[0].id
    for prompt in ("Hello", "The quick brown fox jumps over the lazy dog. " * 60):
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        chunks = [chunk for chunk in stream if chunk.choices]
        assert "".join(c.choices[0].text for c in chunks), prompt
        assert chunks[-1].choices[0].finish_reason == "length"
    wait_kv_freed(gateway_port)  # every worker's KV is freed
