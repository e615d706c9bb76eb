"""Every family through the disaggregated path: a prefill worker and a decode worker as real gRPC
servers on 127.0.0.1, the KV travelling over ``Decode.TransferKV``, and the served greedy tokens
equal to the one-process engine's — for prompts longer than Gemma's sliding window, and for the
MoE — with every KV block freed on both sides afterwards; then the prefill worker's prefix cache
serves the same prompt again."""

from __future__ import annotations

import pytest
import torch

from services.engine.core.loaders import LoadedModel, load_model
from tests.test_model_families import FAMILIES
from tests.prefill_decode_cluster import GREEDY, cluster, prompt_of, reference, tokens_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["gemma3", "qwen3_moe", "phi3"])
def family_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> LoadedModel:
    import transformers

    build, tiny, _ = FAMILIES[str(request.param)]
    torch.manual_seed(11)
    folder = tmp_path_factory.mktemp(f"handoff-{request.param}")
    build(transformers, tiny).save_pretrained(folder, safe_serialization=True)
    return load_model(str(folder))


async def test_family_prefill_to_decode_matches_the_engine(family_model: LoadedModel) -> None:
    prompt = prompt_of(40)  # five times Gemma's 8-token window
    expected = reference(family_model, [prompt], GREEDY)[0]
    async with cluster(family_model, transport="grpc") as c:
        pre, responses = await c.run("one", prompt)
        assert tokens_of(responses) == expected
        await c.wait_idle()
        again, responses = await c.run("two", prompt)
        assert again.num_cached_tokens == 32
        assert tokens_of(responses) == expected
        await c.wait_idle()
