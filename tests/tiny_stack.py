"""A real Tandem stack in this process, small enough for CI: the tokenizer service with the
default SmolLM2 tokenizer, one prefill and one decode worker on a tiny random Llama with the
same vocabulary, and the real gateway, all on 127.0.0.1 (used by tests/test_gateway_fuzz.py).

The tiny model is written as a Hugging Face folder (``config.json`` + random safetensors from
the dummy loader), so the workers load it through the production loader; its context is
:data:`CONTEXT` tokens and the tokenizer service reports the same, so the gateway's context checks
and the workers' positions agree and a request "until the context is full" stays short.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from services.common.grpc_channel import open_channel
from services.common.grpc_server import start_grpc_server
from services.common.metrics import TandemMetrics
from services.common.model_config import ModelConfig
from services.common.model_source import resolve_model
from services.common.pb import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, tokenizer_pb2_grpc
from services.gateway.app import build_app
from services.gateway.auth import ApiKeyAuth
from services.gateway.config import GatewayConfig
from services.gateway.prefill_policy import PrefillPolicy
from services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer
from services.tokenizer.tokenizer import Tokenizer
from tests.tls_identities import tls_for

CONTEXT = 256
API_KEY = "fuzz-key"
REMOTE_PREFILL_MIN_TOKENS = 40  # longer prompts cross the KV hand-off, shorter ones do not


def write_tiny_model(
    folder: Path, vocab_size: int, *, context: int = CONTEXT, hidden: int = 64, layers: int = 2,
    heads: int = 4,
) -> Path:
    """A random Llama (2 layers of 64 by default; 2 KV heads, SwiGLU twice as wide) with
    ``vocab_size`` ids and ``context`` positions, as a Hugging Face folder: float32 weights made
    on the CPU, so every device loads the same ones through the production loader."""
    import torch
    from safetensors.torch import save_file

    from services.engine.core.loaders.dummy import iter_dummy_weights

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 2,
        "max_position_embeddings": context, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    shape = ModelConfig.from_hf_config(config)
    weights = dict(iter_dummy_weights(shape, torch.float32, "cpu", seed=0))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


@dataclass
class TinyStack:
    url: str
    app: web.Application
    prefill_address: str
    decode_address: str
    headers: dict[str, str]

    async def kv_in_use(self) -> tuple[int, int, int]:
        """(prefill KV blocks in use, decode KV blocks in use, decode running sequences)."""
        found = []
        for address, stub in ((self.prefill_address, prefill_pb2_grpc.PrefillStub),
                              (self.decode_address, decode_pb2_grpc.DecodeStub)):  # fmt: skip
            channel = open_channel(address, tls=tls_for("gateway"))
            try:
                found.append(await stub(channel).GetStats(common_pb2.StatsRequest(), timeout=10))
            finally:
                await channel.close()
        return found[0].kv_blocks_in_use, found[1].kv_blocks_in_use, found[1].num_running

    async def wait_idle(self, timeout: float = 20.0) -> None:
        """Until no KV block is in use on either worker and decode runs nothing."""
        deadline = time.monotonic() + timeout
        while any(held := await self.kv_in_use()):
            if time.monotonic() > deadline:
                raise AssertionError(f"KV in use at idle (prefill, decode, running): {held}")
            await asyncio.sleep(0.1)

    async def ready(self) -> dict[str, object]:
        """The gateway's /ready with its details (asked with the stack's key, when it has one:
        without one, a gateway with keys answers only its status)."""
        async with aiohttp.ClientSession() as s, s.get(self.url + "/ready", headers=self.headers) as r:
            body = await r.json()
            assert r.status == 200, body
            return body  # type: ignore[no-any-return]


async def start_tiny_model_and_tokenizer(
    model_dir: Path, chat_template: str | None = None
) -> tuple[Tokenizer, Any, Any]:
    """SmolLM2's tokenizer fitted to the tiny model's context (``chat_template`` replacing its
    template, as ``--chat-template`` does), the tiny random Llama (written to ``model_dir`` the
    first time) loaded, and a tokenizer gRPC server for them."""
    from services.engine.core.loaders import load_model

    tokenizer = await asyncio.to_thread(Tokenizer.load, resolve_model("default"))
    tokenizer.context_length = CONTEXT  # the tiny model's, not SmolLM2's
    if chat_template is not None:
        tokenizer.use_chat_template(chat_template)
    if not (model_dir / "config.json").is_file():
        await asyncio.to_thread(write_tiny_model, model_dir, tokenizer.vocab_size)
    loaded = await asyncio.to_thread(load_model, str(model_dir))
    tok_server = await start_grpc_server(
        [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server,
          TokenizerServicer(tokenizer, served_name="tiny", model_fingerprint=loaded.fingerprint),
          SERVICE_NAME)],
        tls=tls_for("tokenizer"), host="127.0.0.1", port=0, grace=0.1,
    )  # fmt: skip
    return tokenizer, loaded, tok_server


async def start_test_gateway(
    config: GatewayConfig, api_key: str = API_KEY, more_keys: tuple[str, ...] = ()
) -> tuple[web.Application, web.AppRunner, str]:
    """The real gateway app for ``config`` (one API key) on 127.0.0.1: the app, its runner (the
    caller cleans it up) and its base URL."""
    app = build_app(config, auth=ApiKeyAuth((api_key, *more_keys)),
                    metrics=TandemMetrics(process_metrics=False))  # fmt: skip
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return app, runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@contextlib.asynccontextmanager
async def tiny_stack(
    model_dir: Path, *, body_read_timeout_s: float = 30.0, chat_template: str | None = None,
    gateway_options: dict[str, Any] | None = None, more_keys: tuple[str, ...] = (),
) -> AsyncIterator[TinyStack]:
    """Start everything (see the module docstring); stop it all on exit. ``chat_template``
    replaces the tokenizer's; ``gateway_options`` are more GatewayConfig fields; ``more_keys``
    are API keys the gateway accepts besides ``API_KEY`` (other tenants)."""
    from services.decode.server import start_decode_worker
    from services.engine.runtime.worker_options import WorkerOptions
    from services.prefill.server import start_prefill_worker

    tokenizer, loaded, tok_server = await start_tiny_model_and_tokenizer(model_dir, chat_template)
    common = {"host": "127.0.0.1", "port": 0, "model": str(model_dir), "threads": 1}
    decode = await start_decode_worker(
        WorkerOptions(tls=tls_for("decode"),
                      **common, num_blocks=320, worker_id="decode-fuzz"),  # type: ignore[arg-type]
        loaded=loaded, tokenizer=tokenizer, metrics=TandemMetrics(process_metrics=False),
    )  # fmt: skip
    prefill = await start_prefill_worker(
        WorkerOptions(tls=tls_for("prefill"),
                      **common, num_blocks=64, worker_id="prefill-fuzz"),  # type: ignore[arg-type]
        loaded=loaded, metrics=TandemMetrics(process_metrics=False),
    )  # fmt: skip
    config = GatewayConfig(
        tokenizer_addresses=(tok_server.address,), prefill_addresses=(prefill.address,),
        decode_addresses=(decode.address,), host="127.0.0.1", port=0, stats_interval_s=0.25,
        body_read_timeout_s=body_read_timeout_s,
        prefill_policy=PrefillPolicy(remote_min_tokens=REMOTE_PREFILL_MIN_TOKENS),
        tls=tls_for("gateway"), **(gateway_options or {}),
    )  # fmt: skip
    app, runner, base_url = await start_test_gateway(config, more_keys=more_keys)
    stack = TinyStack(base_url, app, prefill.address, decode.address,
                      {"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            async with aiohttp.ClientSession() as s, s.get(stack.url + "/ready") as r:
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the tiny stack never got ready: {await r.text()}")
            await asyncio.sleep(0.1)
        yield stack
    finally:
        await runner.cleanup()
        await prefill.stop(0.5)
        await decode.stop(0.5)
        await tok_server.stop(0)
