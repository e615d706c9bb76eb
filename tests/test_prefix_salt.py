"""Prefix-cache keys salted per deployment and per tenant (issue 32, part 4;
services/common/prefix_hash.py): the block manager matches a prompt only under the chain root it
was cached with, the engine gives a request with another ``cache_salt`` none of the cached
blocks (no reuse, no ``cached_tokens`` side channel) yet the same tokens, and the gateway parses
vLLM's ``cache_salt`` onto the wire."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from services.common.errors import InvalidArgumentError
from services.common.prefix_hash import block_hashes, prefix_root
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_from_proto, sampling_params_to_proto
from services.engine.core.block_manager import BlockManager
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import LoadedModel, load_model
from services.gateway.openai_requests import parse_chat_request

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir))


def test_roots_differ_per_deployment_and_tenant() -> None:
    assert prefix_root() == b""  # unsalted: the original chain
    roots = {prefix_root(b"deploy-a"), prefix_root(b"deploy-b"), prefix_root(b"deploy-a", "t1"),
             prefix_root(b"deploy-a", "t2"), prefix_root(b"", "t1")}  # fmt: skip
    assert len(roots) == 5 and all(len(r) == 32 for r in roots)
    tokens = list(range(8))
    assert block_hashes(tokens, 4) != block_hashes(tokens, 4, prefix_root(b"deploy-a"))
    # no ambiguity between the deployment salt and the tenant's
    assert prefix_root(b"ab", "c") != prefix_root(b"a", "bc")


def test_the_block_manager_matches_only_under_the_same_root() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(9))
    a = prefix_root(b"d", "tenant-a")
    alloc = bm.allocate_prompt(prompt, root=a)
    bm.cache_full_blocks(alloc.block_ids, prompt, a)
    assert bm.match_prefix(prompt, a) == 8
    assert bm.match_prefix(prompt) == 0 and bm.match_prefix(prompt, prefix_root(b"d", "b")) == 0
    assert bm.allocate_prompt(prompt, root=prefix_root(b"d")).num_cached_tokens == 0


def test_a_tenant_never_reuses_anothers_prefix(tiny: LoadedModel) -> None:
    engine = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=128, prefix_salt=b"deploy"))
    prompt = [(7 * i + 3) % 200 + 3 for i in range(21)]
    shared = engine.generate([prompt], GREEDY)[0]
    tenant_a = dataclasses.replace(GREEDY, cache_salt="tenant-a")
    first_a = engine.generate([prompt], tenant_a)[0]
    again_a = engine.generate([prompt], tenant_a)[0]
    again_shared = engine.generate([prompt], GREEDY)[0]
    assert first_a.num_cached_tokens == 0  # the shared cache holds it, but not for tenant-a
    assert again_a.num_cached_tokens == 20 and again_shared.num_cached_tokens == 20
    assert shared.new_token_ids == first_a.new_token_ids == again_a.new_token_ids


def test_cache_salt_is_parsed_and_travels() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "t-1"}
    req = parse_chat_request(body, served_models=["m"])
    assert req.sampling.cache_salt == "t-1"
    wire = sampling_params_from_proto(sampling_params_to_proto(req.sampling))
    assert wire.cache_salt == "t-1"
    for bad in (7, "x" * 257):
        with pytest.raises(InvalidArgumentError) as err:
            parse_chat_request({**body, "cache_salt": bad}, served_models=["m"])
        assert err.value.param == "cache_salt"
