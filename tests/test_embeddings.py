"""Embeddings (``POST /v1/embeddings``), from the engine to the OpenAI SDK.

1. Engine parity: :class:`~services.engine.core.embedder.Embedder` over the production loader
   equals ``transformers.AutoModel``'s ``last_hidden_state`` pooled the same way (cosine >= 0.9999
   in float32) for base checkpoints of two families (``Qwen3Model``, ``LlamaModel``: no ``model.``
   prefix, no LM head) and a causal LM used as an embedder, with last-token and mean pooling,
   inputs chunked across passes and batched in one wave; every block is free afterwards.
2. The pieces: the sentence-transformers pooling config, the request parser against its
   declaration, Matryoshka truncation, a headless model refusing logits / decode / Prefill, and
   ``tandem up --decode 0`` planning an embeddings-only deployment.

Served end to end (the openai SDK against a real stack): tests/test_embeddings_served.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    ModelLoadError,
    ResourceExhaustedError,
    TandemError,
)
from services.common.pb import prefill_pb2
from services.common.pooling_config import PoolingConfig, read_pooling_config
from services.engine.core.embedder import Embedder, finish_embedding
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import load_model
from services.gateway.api_schema import MAX_INT32
from services.gateway.embedding_request import EMBEDDINGS, MAX_INPUTS, parse_embedding_request
from services.gateway.embeddings import embedding_response
from services.gateway.openapi import openapi_document
from services.launch_plan import LaunchConfig, plan
from tests.embedding_checkpoints import COSINE, cosine, prompts, reference, write_checkpoint

pytestmark = pytest.mark.slow

SERVED = "tiny-embed"


# --------------------------------------------------------------------------- engine parity


@pytest.mark.parametrize("kind", ["qwen3", "llama", "llama-causal"])
def test_embedder_matches_transformers(tmp_path: Path, kind: str) -> None:
    folder = write_checkpoint(tmp_path / kind, kind)
    loaded = load_model(str(folder), "float32")
    assert loaded.config.base_model == (kind != "llama-causal")
    assert loaded.config.has_lm_head == (kind == "llama-causal")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=48, block_size=8,
                                            max_num_batched_tokens=32))  # fmt: skip
    inputs = prompts(256)
    for pooling in ("last", "mean"):
        embedder = Embedder(loaded.model, engine.kv, engine.block_manager, pooling=pooling,
                            max_num_batched_tokens=32)  # fmt: skip
        got: list[torch.Tensor] = []
        while len(got) < len(inputs):  # a wave takes what fits the 32-token budget
            wave = embedder.run(inputs[len(got):])
            assert wave, "an empty pool must always take the next input"
            got.extend(wave)
            assert engine.block_manager.num_blocks_in_use == 0
        for ids, vector in zip(inputs, got, strict=True):
            expected = reference(folder, ids, pooling)
            assert vector.shape == (64,) and vector.dtype == torch.float32
            assert cosine(vector, expected) >= COSINE, (kind, pooling, len(ids))
            assert torch.allclose(vector, expected, atol=1e-3, rtol=1e-3)


def test_a_wave_batches_inputs_and_waits_for_blocks(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "q", "qwen3")
    loaded = load_model(str(folder), "float32")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=12, block_size=8))
    embedder = Embedder(loaded.model, engine.kv, engine.block_manager, pooling="mean",
                        max_num_batched_tokens=256)  # fmt: skip
    inputs = prompts(256)[:3]  # 1 + 1 + 3 blocks: one wave, one batched pass
    together = embedder.run(inputs)
    assert len(together) == 3
    alone = [embedder.run([ids])[0] for ids in inputs]
    for a, b in zip(together, alone, strict=True):
        assert cosine(a, b) >= COSINE
    held = engine.block_manager.allocate(10)  # others hold the pool: nothing fits now
    assert embedder.run([inputs[2]]) == []
    engine.block_manager.free(held)
    with pytest.raises(ResourceExhaustedError) as info:  # longer than the whole pool: never fits
        embedder.run([list(range(3, 3 + 12 * 8 + 1))])
    assert info.value.code == "kv_cache_too_small"
    assert engine.block_manager.num_blocks_in_use == 0


def test_finish_embedding_truncates_then_normalises() -> None:
    vector = torch.tensor([3.0, 4.0, 12.0])
    assert torch.allclose(finish_embedding(vector, dimensions=None, normalize=True),
                          vector / 13.0)  # fmt: skip
    assert torch.allclose(finish_embedding(vector, dimensions=2, normalize=True),
                          torch.tensor([0.6, 0.8]))  # fmt: skip
    assert torch.equal(finish_embedding(vector, dimensions=2, normalize=False), vector[:2])
    for bad in (0, 4):
        with pytest.raises(InvalidArgumentError) as info:
            finish_embedding(vector, dimensions=bad, normalize=True)
        assert info.value.param == "dimensions"


def test_a_headless_base_model_serves_embeddings_only(tmp_path: Path) -> None:
    loaded = load_model(str(write_checkpoint(tmp_path / "l", "llama")), "float32")
    assert not any(name.startswith("lm_head") for name, _ in loaded.model.named_parameters())
    with pytest.raises(FailedPreconditionError):
        loaded.model.compute_logits(torch.zeros(1, 64))
    tied = load_model(str(write_checkpoint(tmp_path / "q", "qwen3", tie=True)), "float32")
    assert tied.config.base_model and tied.config.has_lm_head  # its head is the embedding
    logits = tied.model.compute_logits(torch.ones(1, 64))
    expected = torch.ones(1, 64) @ tied.model.embed_tokens.weight.T
    assert torch.allclose(logits, expected, atol=1e-4)


# --------------------------------------------------------------------------- pooling config


def _sentence_transformers(folder: Path, pooling: dict[str, bool], normalize: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": False, **pooling}))
    return folder


def test_pooling_follows_sentence_transformers_and_the_flag(tmp_path: Path) -> None:
    assert read_pooling_config(None) == PoolingConfig("last", True)
    assert read_pooling_config(tmp_path) == PoolingConfig("last", True)  # no modules.json
    last = _sentence_transformers(tmp_path / "a", {"pooling_mode_lasttoken": True}, True)
    assert read_pooling_config(last) == PoolingConfig("last", True)
    assert read_pooling_config(last, "mean") == PoolingConfig("mean", True)
    mean = _sentence_transformers(tmp_path / "b", {"pooling_mode_mean_tokens": True}, False)
    assert read_pooling_config(mean) == PoolingConfig("mean", False)
    cls = _sentence_transformers(tmp_path / "c", {"pooling_mode_cls_token": True}, True)
    with pytest.raises(ModelLoadError, match="pooling_mode_cls_token"):
        read_pooling_config(cls)
    assert read_pooling_config(cls, "last") == PoolingConfig("last", True)
    with pytest.raises(ModelLoadError):
        read_pooling_config(None, "max")


# --------------------------------------------------------------------------- the request


def test_the_parser_reads_the_declared_fields_and_names_the_param() -> None:
    seen: set[str] = set()

    class Recording(dict):  # type: ignore[type-arg]
        def get(self, key: str, default: Any = None) -> Any:
            seen.add(key)
            return super().get(key, default)

    full = {"model": SERVED, "input": ["a", "b"], "dimensions": 8, "encoding_format": "base64",
            "user": "u", "unknown": 1}  # fmt: skip
    parsed = parse_embedding_request(Recording(full), served_models=[SERVED])
    assert seen == EMBEDDINGS.names
    assert (parsed.inputs, parsed.dimensions, parsed.encoding_format) == (("a", "b"), 8, "base64")
    assert parse_embedding_request({"model": SERVED, "input": [1, 2]},
                                   served_models=[SERVED]).inputs == ((1, 2),)  # fmt: skip
    assert parse_embedding_request({"model": SERVED, "input": [[1], [2, 3]]},
                                   served_models=[SERVED]).inputs == ((1,), (2, 3))  # fmt: skip
    assert EMBEDDINGS["dimensions"].maximum == MAX_INT32
    bad: list[tuple[dict[str, Any], str]] = [
        ({"input": "x"}, "model"), ({"model": SERVED}, "input"),
        ({"model": SERVED, "input": ""}, "input"), ({"model": SERVED, "input": []}, "input"),
        ({"model": SERVED, "input": [[]]}, "input"), ({"model": SERVED, "input": [-1]}, "input"),
        ({"model": SERVED, "input": [2**32]}, "input"),
        ({"model": SERVED, "input": {"a": 1}}, "input"),
        ({"model": SERVED, "input": ["a", 1]}, "input"),
        ({"model": SERVED, "input": ["a", [1]]}, "input"),
        ({"model": SERVED, "input": [[1], "a"]}, "input"),
        ({"model": SERVED, "input": [{"a": 1}]}, "input"),
        ({"model": SERVED, "input": [[1, "a"]]}, "input"),
        ({"model": SERVED, "input": ["a"] * (MAX_INPUTS + 1)}, "input"),
        ({"model": SERVED, "input": "x", "dimensions": 0}, "dimensions"),
        ({"model": SERVED, "input": "x", "dimensions": 1.5}, "dimensions"),
        ({"model": SERVED, "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": SERVED, "input": "x", "user": 3}, "user"),
    ]  # fmt: skip
    for body, param in bad:
        with pytest.raises(InvalidArgumentError) as info:
            parse_embedding_request(body, served_models=[SERVED])
        assert info.value.param == param, (body, info.value.message)


def test_the_documented_schema_agrees_with_the_parser() -> None:
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    doc = openapi_document(served_names=[SERVED], vocab_size=1000)
    assert "/v1/embeddings" in doc["paths"]
    registry = Registry().with_resource("urn:doc", Resource.from_contents(doc, DRAFT202012))
    body = Draft202012Validator({"$ref": f"urn:doc#/components/schemas/{EMBEDDINGS.name}"},
                                registry=registry)  # fmt: skip
    base = {"model": SERVED, "input": "x"}
    accepted = [base, {**base, "input": ["a", "b"]}, {**base, "input": [1, 999]},
                {**base, "input": [[1], [2, 3]]}, {**base, "dimensions": 8, "user": None},
                {**base, "encoding_format": "base64"}, {**base, "encoding_format": None}]  # fmt: skip
    refused = [{**base, "input": value} for value in
               ("", [], [[]], [-1], ["a", 1], ["a", [1]], [[1], "a"], {"a": 1}, None, [""])]
    refused += [{**base, "dimensions": 0}, {**base, "encoding_format": "int8"},
                {**base, "user": 3}, {"input": "x"}, {**base, "model": "other"}]  # fmt: skip
    for request in accepted:
        assert body.is_valid(request), request
        parse_embedding_request(request, served_models=[SERVED])
    for request in refused:
        assert not body.is_valid(request), request
        with pytest.raises(TandemError):
            parse_embedding_request(request, served_models=[SERVED])
    response = Draft202012Validator(
        {"$ref": "urn:doc#/components/schemas/CreateEmbeddingResponse"}, registry=registry)
    reply = prefill_pb2.EmbedResponse(num_prompt_tokens=3, embeddings=[
        prefill_pb2.Embedding(values=[0.6, 0.8])])
    for fmt in ("float", "base64"):
        parsed = parse_embedding_request({**base, "encoding_format": fmt}, served_models=[SERVED])
        response.validate(embedding_response(parsed, reply))


def test_tandem_up_decode_0_plans_an_embeddings_only_deployment() -> None:
    specs = plan(LaunchConfig(model="/models/e5", num_prefill=1, num_decode=0, cpus=(0, 1),
                              pooling="mean"))  # fmt: skip
    assert [s.name for s in specs] == ["tokenizer", "prefill-0", "gateway"]
    gateway, prefill = specs[-1].argv, specs[1].argv
    assert "--no-decode" in gateway and "--decode" not in gateway
    assert prefill[prefill.index("--pooling") + 1] == "mean"
    mixed = plan(LaunchConfig(num_prefill=1, num_decode=1, cpus=(0, 1), pooling="last"))
    assert [("--pooling" in s.argv) for s in mixed] == [False, True, False, False]
    assert "--no-decode" not in mixed[-1].argv
    with pytest.raises(InvalidArgumentError):
        plan(LaunchConfig(num_prefill=0, num_decode=0, cpus=(0, 1)))
