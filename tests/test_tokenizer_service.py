"""The tokenizer gRPC service on a real grpc.aio server (127.0.0.1, a free port) with the default
SmolLM2 tokenizer: Tokenize (text, chat, context-window policy), Detokenize (stop strings split
across tokens, UTF-8, half-close flush), GetModelInfo, health, reflection, and the
``tandem serve tokenizer`` process itself (flags, env, SIGTERM, torch-free import)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.grpc_channel import open_channel, wait_healthy
from services.common.grpc_errors import ERROR_PARAM_KEY
from services.common.grpc_server import GrpcServerHandle, start_grpc_server
from services.common.model_source import resolve_model
from services.common.pb import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.main import model_fingerprint
from services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer
from services.tokenizer.tokenizer import Tokenizer
from tests.tls_identities import tls_flags, tls_for

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # loads the default SmolLM2 tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(resolve_model("default"))


@pytest.fixture
async def server(tok: Tokenizer) -> AsyncIterator[GrpcServerHandle]:
    servicer = TokenizerServicer(tok, model_fingerprint="fp-test")
    handle = await start_grpc_server(
        [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer, SERVICE_NAME)],
        tls=tls_for("tokenizer"), host="127.0.0.1",
        port=0,
    )
    yield handle
    await handle.stop(0)


@pytest.fixture
async def stub(server: GrpcServerHandle) -> AsyncIterator[tokenizer_pb2_grpc.TokenizerStub]:
    channel = open_channel(server.address, tls=tls_for("gateway"))
    yield tokenizer_pb2_grpc.TokenizerStub(channel)
    await channel.close()


def _chat(messages: Sequence[tuple[str, str]], **kwargs: Any) -> tokenizer_pb2.TokenizeRequest:
    chat = tokenizer_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages]
    )
    return tokenizer_pb2.TokenizeRequest(chat=chat, **kwargs)


def _as_dicts(messages: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in messages]


def _param(err: grpc.aio.AioRpcError) -> str | None:
    return dict(err.trailing_metadata() or ()).get(ERROR_PARAM_KEY)


SYSTEM = ("system", "You are terse.")
HISTORY = [
    (role, f"{'Question' if role == 'user' else 'Answer'} number {i}: " + "lorem ipsum " * 20)
    for i in range(6)
    for role in ("user", "assistant")
]
LAST = ("user", "And finally, what is two plus two?")


# --- Tokenize ----------------------------------------------------------------------------------


@pytest.mark.parametrize("add_special", [False, True])
async def test_text_ids_equal_the_library(
    stub: tokenizer_pb2_grpc.TokenizerStub, tok: Tokenizer, add_special: bool
) -> None:
    texts = ["Hello, world!", "Party 🎉 time, naïve café", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        reply = await stub.Tokenize(
            tokenizer_pb2.TokenizeRequest(text=text, add_special_tokens=add_special, max_tokens=16)
        )
        assert list(reply.token_ids) == tok.encode(text, add_special_tokens=add_special)
        assert reply.prompt_text == text
        assert reply.dropped_messages == 0


async def test_chat_with_system_prompt_and_history(
    stub: tokenizer_pb2_grpc.TokenizerStub, tok: Tokenizer
) -> None:
    messages = [SYSTEM, ("user", "Hi"), ("assistant", "Hello!"), ("user", "How are you?")]
    reply = await stub.Tokenize(_chat(messages, add_generation_prompt=True, max_tokens=32))
    expected = tok.apply_chat_template(_as_dicts(messages), add_generation_prompt=True)
    assert reply.prompt_text == expected
    assert list(reply.token_ids) == tok.encode_chat(_as_dicts(messages), True)
    assert expected.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert "<|im_start|>assistant\nHello!<|im_end|>" in expected
    assert expected.endswith("<|im_start|>assistant\n")
    assert reply.dropped_messages == 0

    bare = await stub.Tokenize(_chat(messages, add_generation_prompt=False, max_tokens=32))
    assert not bare.prompt_text.endswith("<|im_start|>assistant\n")
    assert list(bare.token_ids) == tok.encode_chat(_as_dicts(messages), False)


async def test_truncation_drops_the_oldest_whole_turns(
    stub: tokenizer_pb2_grpc.TokenizerStub, tok: Tokenizer
) -> None:
    messages = [SYSTEM, *HISTORY, LAST]
    full = len(tok.encode_chat(_as_dicts(messages)))
    context, max_tokens = 300, 40
    assert full + max_tokens > context  # the test needs a conversation that does not fit

    reply = await stub.Tokenize(
        _chat(messages, add_generation_prompt=True, max_tokens=max_tokens,
              context_length=context, truncate=True)  # fmt: skip
    )
    dropped = reply.dropped_messages
    assert dropped > 0 and dropped % 2 == 0  # whole user + assistant turns
    kept = [SYSTEM, *HISTORY[dropped:], LAST]
    assert reply.prompt_text == tok.apply_chat_template(_as_dicts(kept), True)
    assert list(reply.token_ids) == tok.encode_chat(_as_dicts(kept), True)
    assert len(reply.token_ids) + max_tokens <= context
    # The fewest turns were dropped: keeping one more would not fit.
    one_more = [SYSTEM, *HISTORY[dropped - 2 :], LAST]
    assert len(tok.encode_chat(_as_dicts(one_more))) + max_tokens > context
    assert "Question number 0" not in reply.prompt_text
    assert reply.prompt_text.startswith("<|im_start|>system\nYou are terse.")


async def test_too_long_is_invalid_argument_naming_the_limit(
    stub: tokenizer_pb2_grpc.TokenizerStub,
) -> None:
    messages = [SYSTEM, *HISTORY, LAST]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Tokenize(_chat(messages, max_tokens=40, context_length=300))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "context length is 300 tokens" in info.value.details()
    assert "max_tokens is 40" in info.value.details()
    assert _param(info.value) == "messages"

    # Raw text is never truncated, even when asked to.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Tokenize(tokenizer_pb2.TokenizeRequest(
            text="word " * 400, max_tokens=10, context_length=300, truncate=True))  # fmt: skip
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "context length is 300 tokens" in info.value.details()
    assert _param(info.value) == "prompt"

    # Even dropping every earlier turn cannot make room for a huge last message.
    huge = [SYSTEM, ("user", "hi"), ("assistant", "hello"), ("user", "word " * 400)]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Tokenize(_chat(huge, max_tokens=10, context_length=300, truncate=True))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "context length is 300 tokens" in info.value.details()
    assert "even after dropping" in info.value.details()

    # max_tokens alone fills the context.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Tokenize(_chat([LAST], max_tokens=300, context_length=300, truncate=True))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _param(info.value) == "max_tokens"


async def test_context_length_zero_means_the_models(
    stub: tokenizer_pb2_grpc.TokenizerStub,
) -> None:
    ok = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi", max_tokens=8000))
    assert len(ok.token_ids) == 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi", max_tokens=8192))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "8192" in info.value.details()


async def test_bad_tokenize_requests(stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
    cases = [
        (tokenizer_pb2.TokenizeRequest(max_tokens=4), "input"),
        (tokenizer_pb2.TokenizeRequest(text="", max_tokens=4), "prompt"),
        (_chat([("", "no role")], max_tokens=4), "messages"),
    ]
    for request, param in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Tokenize(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
        assert _param(info.value) == param


# --- Detokenize --------------------------------------------------------------------------------


def _config(**kwargs: Any) -> tokenizer_pb2.DetokenizeRequest:
    return tokenizer_pb2.DetokenizeRequest(config=tokenizer_pb2.DetokenizeConfig(**kwargs))


def _ids(ids: Sequence[int]) -> tokenizer_pb2.DetokenizeRequest:
    return tokenizer_pb2.DetokenizeRequest(ids=tokenizer_pb2.TokenIds(token_ids=list(ids)))


async def test_stop_string_split_across_tokens_is_never_emitted(
    stub: tokenizer_pb2_grpc.TokenizerStub, tok: Tokenizer
) -> None:
    text = "The answer is STOP_HERE and more"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "STOP_HERE"
    assert not any(stop in tok.decode([i]) for i in ids)  # it really spans several tokens

    call = stub.Detokenize()
    await call.write(_config(stop=["never", stop], skip_special_tokens=True))
    emitted = ""
    last: tokenizer_pb2.DetokenizeResponse | None = None
    for token in ids:
        await call.write(_ids([token]))
        last = await call.read()
        assert last is not grpc.aio.EOF
        emitted += last.text
        assert "S" not in emitted.removeprefix("The answer is ")  # no part of the stop string
        if last.stopped:
            break
    assert last is not None and last.stopped
    assert last.stop_string == stop
    assert emitted == "The answer is "
    assert await call.read() is grpc.aio.EOF  # the server ended the stream
    assert await call.code() == grpc.StatusCode.OK


async def test_utf8_split_and_half_close_flush(
    stub: tokenizer_pb2_grpc.TokenizerStub, tok: Tokenizer
) -> None:
    prompt = tok.encode("Say:", add_special_tokens=False)
    text = " Party 🎉 time ##"
    ids = tok.encode(text, add_special_tokens=False)

    async def requests() -> AsyncIterator[tokenizer_pb2.DetokenizeRequest]:
        yield _config(stop=["###"], prompt_token_ids=prompt)
        for token in ids:
            yield _ids([token])

    replies = [r async for r in stub.Detokenize(requests())]
    assert len(replies) == len(ids) + 1  # one answer per ids message, then the flush
    assert all("\ufffd" not in r.text for r in replies)
    assert "".join(r.text for r in replies) == tok.decode(ids)
    assert replies[-1].text.endswith("##")  # held back as a possible "###" until the flush
    assert not any(r.stopped for r in replies)


async def test_detokenize_protocol_errors(stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
    async def ids_first() -> AsyncIterator[tokenizer_pb2.DetokenizeRequest]:
        yield _ids([1, 2])

    async def two_configs() -> AsyncIterator[tokenizer_pb2.DetokenizeRequest]:
        yield _config()
        yield _config()

    async def out_of_vocab() -> AsyncIterator[tokenizer_pb2.DetokenizeRequest]:
        yield _config()
        yield _ids([10**6])

    for requests, needle in [
        (ids_first, "first Detokenize message must be a config"),
        (two_configs, "one config"),
        (out_of_vocab, "outside the vocabulary"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [r async for r in stub.Detokenize(requests())]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in info.value.details()


# --- GetModelInfo, health, reflection -----------------------------------------------------------


async def test_model_info(stub: tokenizer_pb2_grpc.TokenizerStub, tok: Tokenizer) -> None:
    info = await stub.GetModelInfo(tokenizer_pb2.ModelInfoRequest())
    assert info.name == "SmolLM2-135M-Instruct"
    assert info.vocab_size == 49152
    assert info.HasField("bos_token_id") and info.bos_token_id == 1
    assert list(info.eos_token_ids) == [2]
    assert info.special_tokens["<|im_end|>"] == 2
    assert info.context_length == 8192
    assert info.chat_template == tok.chat_template and "<|im_start|>" in info.chat_template
    assert info.model_fingerprint == "fp-test"


async def test_health_and_reflection(server: GrpcServerHandle) -> None:
    channel = open_channel(server.address, tls=tls_for("gateway"))
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = [r async for r in reflection.ServerReflectionInfo(iter([request]), timeout=5)]
        names = {s.name for s in replies[0].list_services_response.service}
        assert "tandem.v1.Tokenizer" in names
    finally:
        await channel.close()


def test_fingerprint_matches_the_engine() -> None:
    from services.engine.core.loaders.gguf_file import gguf_config, open_gguf

    from services.common.model_fingerprint import fingerprint, weights_digest

    source = resolve_model("default")
    shape = gguf_config(open_gguf(Path(source.path))).fingerprint()
    assert model_fingerprint(source) == fingerprint(shape, weights_digest(source))
    assert model_fingerprint(source) != fingerprint(shape, "other weights")  # covers the bytes


# --- the process ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_service_import_and_fingerprint_are_torch_free() -> None:
    code = (
        "import sys\n"
        "import services.tokenizer.main as m\n"
        "from services.common.model_source import resolve_model\n"
        "assert m.model_fingerprint(resolve_model('default'))\n"
        "bad = sorted(n for n in sys.modules if n == 'torch' or n.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_serve_tokenizer_process_starts_and_stops_on_sigterm() -> None:
    port, metrics_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_MODEL"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services", "serve", "tokenizer", "--host", "127.0.0.1",
         "--port", str(port), "--metrics-port", str(metrics_port),
         *tls_flags("tokenizer")],  # fmt: skip
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:

        async def check() -> tokenizer_pb2.ModelInfo:
            address = f"127.0.0.1:{port}"
            await wait_healthy(address, SERVICE_NAME, timeout=90, tls=tls_for("operator"))
            channel = open_channel(address, tls=tls_for("gateway"))
            try:
                stub = tokenizer_pb2_grpc.TokenizerStub(channel)
                return await stub.GetModelInfo(tokenizer_pb2.ModelInfoRequest(), timeout=10)
            finally:
                await channel.close()

        info = asyncio.run(check())
        assert info.name == "SmolLM2-135M-Instruct"
        assert len(info.model_fingerprint) == 16
        with socket.create_connection(("127.0.0.1", metrics_port), timeout=5) as conn:
            conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            body = b"".join(iter(lambda: conn.recv(65536), b""))
        assert b"200 OK" in body.split(b"\r\n", 1)[0]
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


def test_bad_model_env_is_a_one_line_error() -> None:
    env = dict(os.environ, TANDEM_MODEL="/nonexistent/model.gguf")
    result = subprocess.run(
        [sys.executable, "-m", "services", "serve", "tokenizer", "--port", "0",
         "--metrics-port", "0", *tls_flags("tokenizer")],  # fmt: skip
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "tandem: error: model path does not exist: /nonexistent/model.gguf" in result.stderr
