"""Embeddings (``POST /v1/embeddings``), from the engine to the OpenAI SDK.

1. Engine parity: :class:`~services.engine.core.embedder.Embedder` over the production loader
   equals ``transformers.AutoModel``'s ``last_hidden_state`` pooled the same way (cosine >= 0.9999
   in float32) for base checkpoints of two families (``Qwen3Model``, ``LlamaModel``: no ``model.``
   prefix, no LM head) and a causal LM used as an embedder, with last-token and mean pooling,
   inputs chunked across passes and batched in one wave; every block is free afterwards.
2. The pieces: the sentence-transformers pooling config, the request parser against its
   declaration, Matryoshka truncation, a headless model refusing logits / decode / Prefill, and
   ``tandem up --decode 0`` planning an embeddings-only deployment.
3. Served end to end: the tokenizer service, one prefill worker on a random ``Qwen3Model`` and
   the gateway with no decode pool, on 127.0.0.1, called with the official ``openai`` SDK: float
   and base64 vectors equal to transformers' on the tokenizer's ids, ``dimensions``, token-id
   inputs, concurrent requests, 400s naming the param, 401 without the key, a cancelled call that
   leaves no block held, and no KV in use at the end.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import json
import struct
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
import torch

from services.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    ModelLoadError,
    ResourceExhaustedError,
    TandemError,
)
from services.common.grpc_channel import open_channel
from services.common.grpc_server import start_grpc_server
from services.common.metrics import TandemMetrics
from services.common.model_source import resolve_model
from services.common.pb import common_pb2, prefill_pb2, prefill_pb2_grpc, tokenizer_pb2_grpc
from services.common.pooling_config import PoolingConfig, read_pooling_config
from services.engine.core.embedder import Embedder, finish_embedding
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.loaders import LoadedModel, load_model
from services.gateway.api_schema import MAX_INT32
from services.gateway.config import GatewayConfig
from services.gateway.embedding_request import EMBEDDINGS, MAX_INPUTS, parse_embedding_request
from services.gateway.embeddings import embedding_response
from services.gateway.openapi import openapi_document
from services.launch_plan import LaunchConfig, plan
from tests.tiny_stack import start_test_gateway
from tests.tls_identities import tls_for

pytestmark = pytest.mark.slow

COSINE = 0.9999
CONTEXT = 128
API_KEY = "embed-key"
SERVED = "tiny-embed"
INPUT_LENGTHS = (1, 5, 23, 77)  # with a 32-token budget: the long ones span passes


def _tiny(vocab: int, tie: bool = False) -> dict[str, Any]:
    return dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.08,
        max_position_embeddings=CONTEXT, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=tie,
    )  # fmt: skip


def write_checkpoint(folder: Path, kind: str, vocab: int = 256, *, tie: bool = False) -> Path:
    """A random checkpoint as ``save_pretrained`` writes it: ``qwen3`` / ``llama`` base models
    (architectures ``Qwen3Model`` / ``LlamaModel``) or a ``llama-causal`` LM; ``tie``: the
    config ties the head to the embedding (Qwen3-Embedding's does)."""
    import transformers as t

    torch.manual_seed(0)
    if kind == "qwen3":
        model = t.Qwen3Model(t.Qwen3Config(**_tiny(vocab, tie)))
    elif kind == "llama":
        model = t.LlamaModel(t.LlamaConfig(**_tiny(vocab, tie)))
    else:
        model = t.LlamaForCausalLM(t.LlamaConfig(**_tiny(vocab, tie)))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@functools.lru_cache(maxsize=4)
def _reference_model(folder: Path) -> torch.nn.Module:
    from transformers import AutoModel

    return AutoModel.from_pretrained(folder, dtype=torch.float32).eval()


def reference(folder: Path, ids: list[int], pooling: str) -> torch.Tensor:
    """``transformers.AutoModel``'s last hidden state of ``ids`` (the base model even of a causal
    LM's folder), pooled the same way, in float32."""
    with torch.no_grad():
        hidden = _reference_model(folder)(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return hidden[-1] if pooling == "last" else hidden.mean(dim=0)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))


def prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in INPUT_LENGTHS]


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


# --------------------------------------------------------------------------- served


class Served:
    """The embeddings-only stack: tokenizer, one prefill worker, a gateway without decode."""

    def __init__(self, url: str, folder: Path, tokenizer: Any, prefill: Any,
                 config: GatewayConfig) -> None:  # fmt: skip
        self.url, self.folder, self.tokenizer, self.prefill = url, folder, tokenizer, prefill
        self.config = config  # the gateway's, for another gateway over the same backend

    def client(self, key: str = API_KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    async def blocks_in_use(self) -> int:
        channel = open_channel(self.prefill.address, tls=tls_for("gateway"))
        try:
            stats = await prefill_pb2_grpc.PrefillStub(channel).GetStats(
                common_pb2.StatsRequest(), timeout=10)
        finally:
            await channel.close()
        return int(stats.kv_blocks_in_use)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    from services.prefill.server import start_prefill_worker
    from services.engine.runtime.worker_options import WorkerOptions
    from services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer
    from services.tokenizer.tokenizer import Tokenizer

    tokenizer = await asyncio.to_thread(Tokenizer.load, resolve_model("default"))
    tokenizer.context_length = CONTEXT
    folder = tmp_path_factory.mktemp("tiny-qwen3-embedding")
    await asyncio.to_thread(write_checkpoint, folder, "qwen3", tokenizer.vocab_size)
    loaded: LoadedModel = await asyncio.to_thread(load_model, str(folder), "float32")
    tok_server = await start_grpc_server(
        [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server,
          TokenizerServicer(tokenizer, served_name=SERVED, model_fingerprint=loaded.fingerprint),
          SERVICE_NAME)],
        tls=tls_for("tokenizer"), host="127.0.0.1", port=0, grace=0.1,
    )  # fmt: skip
    prefill = await start_prefill_worker(
        WorkerOptions(tls=tls_for("prefill"), host="127.0.0.1", port=0, model=str(folder),
                      threads=1, num_blocks=64, worker_id="prefill-embed",
                      max_batched_tokens=64, kv_cache_dtype="float32"),  # type: ignore[arg-type]
        loaded=loaded, metrics=TandemMetrics(process_metrics=False),
    )  # fmt: skip
    config = GatewayConfig(tokenizer_addresses=(tok_server.address,),
                           prefill_addresses=(prefill.address,), decode_addresses=(),
                           host="127.0.0.1", port=0, stats_interval_s=0.25,
                           tls=tls_for("gateway"))  # fmt: skip
    app, runner, url = await start_test_gateway(config, API_KEY)
    try:
        deadline = time.monotonic() + 30
        while True:
            async with aiohttp.ClientSession() as s, s.get(url + "/ready") as r:
                if r.status == 200:
                    break
            assert time.monotonic() < deadline, await r.text()
            await asyncio.sleep(0.1)
        yield Served(url, folder, tokenizer, prefill, config)
    finally:
        await runner.cleanup()
        await prefill.stop(0.5)
        await tok_server.stop(0)


pytest_asyncio_module = pytest.mark.asyncio(loop_scope="module")


def _unit(vector: list[float]) -> torch.Tensor:
    tensor = torch.tensor(vector)
    assert abs(float(tensor.norm()) - 1.0) < 1e-5
    return tensor


@pytest_asyncio_module
async def test_served_embeddings_match_transformers(served: Served) -> None:
    texts = ["The capital of France is Paris.", "Embeddings pool hidden states."]
    reply = await served.client().embeddings.create(model=SERVED, input=texts, user="tester")
    assert reply.object == "list" and reply.model == SERVED
    assert [d.index for d in reply.data] == [0, 1]
    ids = [served.tokenizer.encode(t, add_special_tokens=True) for t in texts]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(i) for i in ids)
    for item, token_ids in zip(reply.data, ids, strict=True):
        expected = torch.nn.functional.normalize(reference(served.folder, token_ids, "last"), dim=0)
        assert cosine(_unit(item.embedding), expected) >= COSINE

    one = await served.client().embeddings.create(model=SERVED, input=texts[0])
    alone, batched = one.data[0].embedding, reply.data[0].embedding
    assert len(one.data) == 1 and cosine(torch.tensor(alone), torch.tensor(batched)) >= COSINE
    by_ids = await served.client().embeddings.create(model=SERVED, input=ids[1])
    batch_ids = await served.client().embeddings.create(model=SERVED, input=ids)
    for got, want in ((by_ids.data[0], reply.data[1]), (batch_ids.data[1], reply.data[1])):
        assert cosine(torch.tensor(got.embedding), torch.tensor(want.embedding)) >= COSINE


@pytest_asyncio_module
async def test_base64_and_dimensions(served: Served) -> None:
    client = served.client()
    text = "Matryoshka vectors keep their head."
    floats = (await client.embeddings.create(model=SERVED, input=text,
                                             encoding_format="float")).data[0].embedding
    decoded_by_sdk = (await client.embeddings.create(model=SERVED, input=text)).data[0].embedding
    assert list(decoded_by_sdk) == floats  # the SDK asks for base64 and decodes it itself
    async with aiohttp.ClientSession() as s:  # the raw wire form, not the SDK's decoding
        async with s.post(served.url + "/v1/embeddings",
                          json={"model": SERVED, "input": text, "encoding_format": "base64"},
                          headers={"Authorization": f"Bearer {API_KEY}"}) as r:  # fmt: skip
            assert r.status == 200 and r.headers["X-Request-Id"].startswith("embd-")
            raw = (await r.json())["data"][0]["embedding"]
    decoded = struct.unpack(f"<{len(floats)}f", base64.b64decode(raw))
    assert list(decoded) == pytest.approx(floats, rel=0, abs=0)  # float32 both ways
    sdk = await client.embeddings.create(model=SERVED, input=text, encoding_format="base64")
    assert isinstance(sdk.data[0].embedding, str) and sdk.data[0].embedding == raw
    short = await client.embeddings.create(model=SERVED, input=text, dimensions=16)
    vector = _unit(short.data[0].embedding)
    assert vector.shape == (16,)
    assert torch.allclose(vector, torch.nn.functional.normalize(torch.tensor(floats[:16]), dim=0),
                          atol=1e-6)  # fmt: skip


@pytest_asyncio_module
async def test_concurrent_requests_share_the_worker(served: Served) -> None:
    client = served.client()
    texts = [f"request number {i} " * (1 + i % 5) for i in range(12)]
    alone = [(await client.embeddings.create(model=SERVED, input=t)).data[0].embedding
             for t in texts[:3]]  # fmt: skip
    together = await asyncio.gather(*(client.embeddings.create(model=SERVED, input=t)
                                      for t in texts))  # fmt: skip
    for got, want in zip(together[:3], alone, strict=True):
        assert cosine(torch.tensor(got.data[0].embedding), torch.tensor(want)) >= COSINE
    assert await served.blocks_in_use() == 0


@pytest_asyncio_module
async def test_bad_requests_are_400_naming_the_param_and_401_without_key(served: Served) -> None:
    client = served.client()
    cases: list[tuple[dict[str, Any], str, str | None]] = [
        ({"input": "hello", "dimensions": 65}, "dimensions", None),
        ({"input": "word " * (CONTEXT + 10)}, "input", "context_length_exceeded"),
        ({"input": [[5] * (CONTEXT + 1)]}, "input", "context_length_exceeded"),
        ({"input": [served.tokenizer.vocab_size]}, "input", "invalid_value"),
        ({"input": ""}, "input", "invalid_value"),
    ]  # fmt: skip
    for kwargs, param, code in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await client.embeddings.create(model=SERVED, **kwargs)
        error = info.value.body
        assert isinstance(error, dict) and error["param"] == param, error
        assert code is None or error["code"] == code, error
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(model="other", input="hi")
    with pytest.raises(openai.AuthenticationError):
        await served.client("wrong-key").embeddings.create(model=SERVED, input="hi")
    async with aiohttp.ClientSession() as s:
        async with s.post(served.url + "/v1/embeddings",
                          json={"model": SERVED, "input": "hi"}) as r:  # fmt: skip
            assert r.status == 401 and set((await r.json())["error"]) == {
                "message", "type", "param", "code"}
        async with s.post(served.url + "/v1/chat/completions",  # no decode pool: 503
                          json={"model": SERVED, "messages": [{"role": "user", "content": "x"}]},
                          headers={"Authorization": f"Bearer {API_KEY}"}) as r:  # fmt: skip
            assert r.status == 503
    assert await served.blocks_in_use() == 0


@pytest_asyncio_module
async def test_token_bucket_charges_inputs_and_refunds_failures(served: Served) -> None:
    config = dataclasses.replace(served.config, rate_limit_tpm=20)
    _, runner, url = await start_test_gateway(config, API_KEY)
    try:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        twelve = [5] * 12
        with pytest.raises(openai.BadRequestError):  # charged 12, failed on the worker: refunded
            await client.embeddings.create(model=SERVED, input=twelve, dimensions=65)
        await client.embeddings.create(model=SERVED, input=twelve)  # 12 of the 20
        with pytest.raises(openai.RateLimitError) as info:  # 12 more do not fit the 8 left
            await client.embeddings.create(model=SERVED, input=twelve)
        assert info.value.response.headers.get("Retry-After")
    finally:
        await runner.cleanup()


@pytest_asyncio_module
async def test_worker_refuses_prefill_and_drops_cancelled_inputs(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    channel = open_channel(served.prefill.address, tls=tls_for("gateway"))
    stub = prefill_pb2_grpc.PrefillStub(channel)
    try:
        import grpc

        with pytest.raises(grpc.aio.AioRpcError) as info:  # no LM head: embeddings only
            await stub.Prefill(prefill_pb2.PrefillRequest(
                request_id="p", token_ids=[5, 6], decode_address="127.0.0.1:1"), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Embed(prefill_pb2.EmbedRequest(request_id="e", inputs=[
                prefill_pb2.EmbedInput(token_ids=[5])], dimensions=65), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await channel.close()
    queue = served.prefill.worker.embeddings
    engine_loop = served.prefill.engine_loop
    calls: list[int] = []
    run = queue.embedder.run

    def counted(inputs: Any) -> list[torch.Tensor]:
        calls.append(len(inputs))
        return run(inputs)

    monkeypatch.setattr(queue.embedder, "run", counted)
    busy = threading.Event()
    blocker = asyncio.ensure_future(engine_loop.call(lambda engine: busy.wait(10)))
    many = [[5 + i % 50] * 100 for i in range(200)]  # one input per wave (a 64-token budget)
    task = asyncio.ensure_future(queue.embed(many))
    await asyncio.sleep(0.05)  # its first wave waits behind the busy engine thread
    assert queue.num_waiting == 200
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert queue.num_waiting == 0
    busy.set()
    await blocker
    deadline = time.monotonic() + 10
    while not queue.idle or await served.blocks_in_use():
        assert time.monotonic() < deadline, "cancelled inputs still queued or blocks held"
        await asyncio.sleep(0.05)
    assert calls == [200]  # the wave already submitted ran (and freed); no other one started


async def test_a_decode_worker_refuses_a_headless_model(tmp_path: Path) -> None:
    from services.decode.server import start_decode_worker
    from services.engine.runtime.worker_options import WorkerOptions

    folder = write_checkpoint(tmp_path / "e5", "llama")
    loaded = load_model(str(folder), "float32")
    with pytest.raises(ModelLoadError, match="embedding model"):
        await start_decode_worker(
            WorkerOptions(tls=tls_for("decode"), host="127.0.0.1", port=0, model=str(folder),
                          threads=1, num_blocks=16),  # type: ignore[arg-type]
            loaded=loaded, metrics=TandemMetrics(process_metrics=False),
        )  # fmt: skip
