"""Embeddings served end to end (``POST /v1/embeddings``): the tokenizer service, one prefill
worker on a random ``Qwen3Model`` and the gateway with no decode pool, on 127.0.0.1, called with
the official ``openai`` SDK: float and base64 vectors equal to transformers' on the tokenizer's
ids, ``dimensions``, token-id inputs, concurrent requests, 400s naming the param, 401 without the
key, a cancelled call that leaves no block held, and no KV in use at the end.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
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
    ModelLoadError,
)
from services.common.grpc_channel import open_channel
from services.common.grpc_server import start_grpc_server
from services.common.metrics import TandemMetrics
from services.common.model_source import resolve_model
from services.common.pb import common_pb2, prefill_pb2, prefill_pb2_grpc, tokenizer_pb2_grpc
from services.engine.core.loaders import LoadedModel, load_model
from services.gateway.config import GatewayConfig
from tests.embedding_checkpoints import CONTEXT, COSINE, cosine, reference, write_checkpoint
from tests.tiny_stack import start_test_gateway
from tests.tls_identities import tls_for

pytestmark = pytest.mark.slow

API_KEY = "embed-key"
SERVED = "tiny-embed"


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
