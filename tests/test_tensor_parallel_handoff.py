"""KV hand-offs between tensor-parallel widths, and a rank dying mid-stream (issue 48, items 2-3).

Real ``tandem serve prefill`` / ``tandem serve decode`` processes on one random-weight Llama
written by transformers (4 query heads, 2 KV heads: split one per rank at width 2), float32,
each split worker's 2 ranks on one core each over Gloo:

* a prompt prefilled at width 2 and decoded at width 1, at 1 and 2, at 2 and 2 (and at 1 and 1)
  generates transformers' greedy tokens; every hand-off moves the same bytes (all the model's KV
  heads, whatever the widths), and every KV block is free on both workers afterwards;
* a hand-off whose header carries one rank's heads only (what a split prefill worker sent
  before hand-offs between widths) is refused as a layout mismatch naming both widths;
* under the real gateway with two width-2 decode workers, killing the follower rank of the worker
  that serves a stream makes that worker exit unhealthy, and the stream migrates to the other
  worker with its text intact (the text of an uninterrupted run), leaving no KV held there.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from aiohttp import web
import pytest
import torch

from services.common.grpc_channel import open_channel, wait_healthy
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.common.prefix_hash import reservation_digest
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_to_proto
from tests.test_disagg_processes import free_port
from tests.test_tensor_parallel_worker import alive, children_of
from tests.tls_identities import tls_flags, tls_for

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT = [(7 * i + 11) % 49000 + 3 for i in range(41)]  # three 16-token blocks
CONTEXT = 512
API_KEY = "tp-key"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random Llama, saved by transformers, with SmolLM2's tokenizer (its vocabulary is the
    model's) so the gateway and the workers can turn text into ids and back."""
    import transformers

    from services.common.model_source import resolve_model
    from services.tokenizer.tokenizer import Tokenizer

    torch.manual_seed(48)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        initializer_range=0.08, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tp-handoff")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    tokenizer = Tokenizer.load(resolve_model("default"))
    tokenizer._backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))  # fmt: skip
    return folder


def hf_greedy(folder: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (float32, no EOS stop)."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def serve(role: str, folder: Path, width: int, port: int, worker_id: str) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "services.cli", "--log-level", "INFO", "serve", role,
        "--model", str(folder), "--dtype", "float32", "--kv-cache-dtype", "float32", "--device",
        "cpu", "--host", "127.0.0.1",
        "--port", str(port), "--metrics-port", "-1", "--num-blocks", "64",
        "--worker-id", worker_id, "--tensor-parallel-size", str(width), *tls_flags(role),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TANDEM_AUTOTUNE": "fixed"}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


Workers = dict[str, tuple[subprocess.Popen[bytes], str]]


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait(10)


async def _wait_up(workers: Workers) -> None:
    for name, (proc, address) in workers.items():
        service = "tandem.v1.Prefill" if name.startswith("prefill") else "tandem.v1.Decode"
        try:
            await wait_healthy(address, service, timeout=180, tls=tls_for("operator"))
        except BaseException:
            proc.kill()
            output = proc.communicate()[0].decode(errors="replace")
            pytest.fail(f"{name} did not come up:\n{output}")


@pytest.fixture(scope="module")
def workers(checkpoint: Path) -> Iterator[Workers]:
    """A prefill and a decode worker at each width, 1 and 2."""
    started: Workers = {}
    try:
        for role in ("prefill", "decode"):
            for width in (1, 2):
                port = free_port()
                name = f"{role}{width}"
                started[name] = (serve(role, checkpoint, width, port, f"{role}-tp{width}"),
                                 f"127.0.0.1:{port}")  # fmt: skip
        yield started
    finally:
        _stop([proc for proc, _ in started.values()])


async def _blocks_in_use(address: str, stub_class: Any) -> int:
    channel = open_channel(address, tls=tls_for("gateway"))
    try:
        return int((await stub_class(channel).GetStats(common_pb2.StatsRequest())).kv_blocks_in_use)
    finally:
        await channel.close()


async def _wait_no_blocks(address: str, stub_class: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while (held := await _blocks_in_use(address, stub_class)) != 0:
        assert time.monotonic() < deadline, f"{address} still holds {held} KV blocks"
        await asyncio.sleep(0.05)


async def _reserve(decode: Any, rid: str) -> None:
    """The gateway's reservation of PROMPT's KV on a decode worker (``decode``: its stub)."""
    await decode.Reserve(decode_pb2.ReserveRequest(
        request_id=rid, num_tokens=len(PROMPT),
        prompt_digest=reservation_digest(PROMPT, GREEDY.cache_salt)))  # fmt: skip


async def _hand_off(prefill_address: str, decode_address: str, rid: str) -> tuple[list[int], int]:
    """Reserve on decode, prefill there, generate: the greedy tokens and the KV bytes moved."""
    prefill_channel = open_channel(prefill_address, tls=tls_for("gateway"))
    decode_channel = open_channel(decode_address, tls=tls_for("gateway"))
    try:
        prefill = prefill_pb2_grpc.PrefillStub(prefill_channel)
        decode = decode_pb2_grpc.DecodeStub(decode_channel)
        await _reserve(decode, rid)
        call = decode.Generate(decode_pb2.GenerateRequest(request_id=rid, wait_for_kv_seconds=30))
        response = await prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, token_ids=PROMPT, params=sampling_params_to_proto(GREEDY),
            decode_address=decode_address))  # fmt: skip
        tokens = [t async for message in call for t in message.token_ids]
        return tokens, int(response.kv_bytes)
    finally:
        await prefill_channel.close()
        await decode_channel.close()


async def test_kv_handed_between_widths_keeps_greedy_parity(
    checkpoint: Path, workers: Workers
) -> None:
    expected = hf_greedy(checkpoint, PROMPT, MAX_TOKENS)
    await _wait_up(workers)
    moved = {}
    for source, target in (("prefill2", "decode1"), ("prefill1", "decode2"),
                           ("prefill2", "decode2"), ("prefill1", "decode1")):  # fmt: skip
        tokens, moved[source, target] = await _hand_off(
            workers[source][1], workers[target][1], f"{source}-{target}")
        assert tokens == expected, f"{source} -> {target}"
        await _wait_no_blocks(workers[source][1], prefill_pb2_grpc.PrefillStub)
        await _wait_no_blocks(workers[target][1], decode_pb2_grpc.DecodeStub)
    # all the model's KV heads travel, whatever the widths: 3 blocks of 2 layers x K, V x 16
    # slots x 2 heads x 16 dims x 4 bytes
    assert set(moved.values()) == {3 * 2 * 2 * 16 * 2 * 16 * 4}, moved


async def test_one_ranks_heads_are_refused_naming_both_widths(
    checkpoint: Path, workers: Workers
) -> None:
    """A header of one rank's heads (what a split prefill worker sent before) is a layout
    mismatch: FAILED_PRECONDITION naming both widths, and the reservation is freed by abort."""
    from services.engine.core.loaders import load_model

    await _wait_up(workers)
    loaded = load_model(str(checkpoint))
    address = workers["decode2"][1]
    channel = open_channel(address, tls=tls_for("prefill"))
    gateway_channel = open_channel(address, tls=tls_for("gateway"))
    try:
        decode = decode_pb2_grpc.DecodeStub(channel)
        gateway = decode_pb2_grpc.DecodeStub(gateway_channel)
        await _reserve(gateway, "old")
        layout = common_pb2.KVLayout(
            model_fingerprint=loaded.fingerprint, dtype="float32", block_size=16, num_layers=2,
            num_kv_heads=1, head_dim=16, tensor_parallel_size=2,
        )  # fmt: skip
        header = decode_pb2.KVHeader(
            request_id="old", layout=layout, num_tokens=len(PROMPT), num_blocks=3,
            total_bytes=3 * 2 * 2 * 16 * 16 * 4, prompt_token_ids=PROMPT, first_token_id=5,
            params=sampling_params_to_proto(GREEDY), num_prompt_tokens=len(PROMPT),
        )  # fmt: skip

        async def messages() -> AsyncIterator[decode_pb2.KVTransferMessage]:
            yield decode_pb2.KVTransferMessage(header=header)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await decode.TransferKV(messages())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = err.value.details() or ""
        assert "num_kv_heads 1" in details
        assert "--tensor-parallel-size 2 and this worker 2" in details, details
        await gateway.Abort(common_pb2.AbortRequest(request_id="old", reason="test"))
    finally:
        await channel.close()
        await gateway_channel.close()
    await _wait_no_blocks(address, decode_pb2_grpc.DecodeStub)


# ---- a rank that dies mid-stream --------------------------------------------------------------


async def _stream_text(url: str, body: dict[str, Any], on_chunk: Any = None) -> str:
    """The streamed completion's text; ``on_chunk(index)`` is awaited after each chunk."""
    text, index = [], 0
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession() as session, session.post(
        url + "/v1/completions", json=body, headers=headers
    ) as reply:
        assert reply.status == 200, await reply.text()
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text.extend(c.get("text", "") for c in event["choices"])
            index += 1
            if on_chunk is not None:
                await on_chunk(index)
    return "".join(text)


async def test_a_dead_follower_rank_migrates_its_stream_intact(checkpoint: Path) -> None:
    from services.common.grpc_server import start_grpc_server
    from services.common.metrics import TandemMetrics
    from services.common.model_source import resolve_model
    from services.common.pb import tokenizer_pb2_grpc
    from services.engine.runtime.worker_runtime import UNHEALTHY_EXIT_CODE
    from services.gateway.app import build_app
    from services.gateway.auth import ApiKeyAuth
    from services.gateway.config import GatewayConfig
    from services.tokenizer.main import model_fingerprint
    from services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer
    from services.tokenizer.tokenizer import Tokenizer

    source = resolve_model(str(checkpoint))
    tokenizer = Tokenizer.load(source)
    servicer = TokenizerServicer(tokenizer, served_name="tiny", model_fingerprint=model_fingerprint(source))
    tok_server = await start_grpc_server(
        [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer, SERVICE_NAME)],
        tls=tls_for("tokenizer"), host="127.0.0.1", port=0, grace=0.1,
    )  # fmt: skip
    decodes: Workers = {}
    for i in range(2):
        port = free_port()
        decodes[f"decode{i}"] = (serve("decode", checkpoint, 2, port, f"decode-tp-{i}"),
                                 f"127.0.0.1:{port}")  # fmt: skip
    runner = None
    try:
        await _wait_up(decodes)
        config = GatewayConfig(
            tokenizer_addresses=(tok_server.address,), prefill_addresses=(),
            decode_addresses=tuple(address for _, address in decodes.values()),
            host="127.0.0.1", port=0, stats_interval_s=0.2, tls=tls_for("gateway"),
        )  # fmt: skip
        metrics = TandemMetrics(process_metrics=False)
        app = build_app(config, auth=ApiKeyAuth((API_KEY,)), metrics=metrics)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        await _wait_ready(url)
        body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 200,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        uninterrupted = await _stream_text(url, body)
        assert len(uninterrupted) > 100
        for _, address in decodes.values():
            await _wait_no_blocks(address, decode_pb2_grpc.DecodeStub)

        killed: list[str] = []

        async def kill_the_serving_follower(index: int) -> None:
            if index != 5 or killed:
                return
            for name, (proc, address) in decodes.items():
                channel = open_channel(address, tls=tls_for("gateway"))
                try:
                    stats = await decode_pb2_grpc.DecodeStub(channel).GetStats(
                        common_pb2.StatsRequest())
                finally:
                    await channel.close()
                if stats.num_running:
                    (follower,) = children_of(proc.pid)
                    os.kill(follower, signal.SIGKILL)
                    killed.append(name)
                    return
            raise AssertionError("no decode worker runs the stream after 5 chunks")

        migrated = await _stream_text(url, body, kill_the_serving_follower)
        assert killed, "the stream ended before a follower could be killed"
        assert migrated == uninterrupted
        assert metrics.registry.get_sample_value("tandem:migrations_total") == 1
        dead, _ = decodes[killed[0]]
        output = (await asyncio.to_thread(dead.communicate, None, 60))[0].decode(errors="replace")
        assert dead.returncode == UNHEALTHY_EXIT_CODE, output
        (survivor,) = [a for name, (_, a) in decodes.items() if name != killed[0]]
        await _wait_no_blocks(survivor, decode_pb2_grpc.DecodeStub)
    finally:
        if runner is not None:
            await runner.cleanup()
        _stop([proc for proc, _ in decodes.values()])
        await tok_server.stop(0)
        for proc, _ in decodes.values():
            assert not any(alive(pid) for pid in children_of(proc.pid))


async def _wait_ready(url: str, timeout: float = 30.0) -> None:
    """Until the gateway is ready and has polled both decode workers healthy."""
    deadline = time.monotonic() + timeout
    while True:
        async with aiohttp.ClientSession() as s, s.get(url + "/ready") as r:
            if r.status == 200:
                break
        assert time.monotonic() < deadline, "the gateway never got ready"
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)


def test_the_whole_width_view_round_trips_a_replicated_head(
    tmp_path: Path,
) -> None:
    """One KV head replicated on both ranks: a payload written through rank 0's whole-width view
    in chunks that cut blocks reads back the same, whole or cut, and rank 0's pool holds the
    head's bytes (so each rank got its copy through the scatter, and the gather takes one)."""
    import multiprocessing as mp

    import transformers

    from tests import tp_driver

    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    context = mp.get_context("spawn")
    results = context.Queue()
    driver = context.Process(target=tp_driver.run_kv_roundtrip, args=(str(tmp_path), 2, results))
    driver.start()
    try:
        reply = results.get(timeout=240)
    finally:
        driver.join(60)
        if driver.is_alive():
            driver.kill()
    assert reply[0] == "ok", reply[1]
    _, payload, whole, parts, mine, run = reply
    assert whole == payload and parts == payload
    assert run == (0, 1)
    # one KV head: the whole-width block is rank 0's block, byte for byte
    assert mine.reshape(-1).view(torch.uint8).numpy().tobytes() == payload
