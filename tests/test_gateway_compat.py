"""The gateway refuses peers it cannot trust to serve the same thing (issue 32, part 4), on the
real gateway over fake gRPC workers: a worker that speaks another internal protocol version
(services/common/protocol.py) or serves a model whose fingerprint (shape and weights' digest,
services/common/model_fingerprint.py) is not the tokenizer's gets no request, and a tokenizer of
another protocol leaves the gateway answering 503. The fingerprint covers a Hugging Face folder's
tokenizer and chat template, and the tokenizer's fails closed (issue 47)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from services.common.errors import ModelLoadError
from services.common.model_fingerprint import fingerprint, weights_digest
from services.common.model_source import resolve_model
from services.common.protocol import PROTOCOL_VERSION, check_peer
from services.engine.core.loaders import load_model
from services.gateway.state import STATE_KEY
from services.tokenizer.main import model_fingerprint
from tests.gateway_fakes import MODEL, StackFactory, make_stack, post_raw  # noqa: F401

CHAT = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


async def _ready(url: str) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as s, s.get(url + "/ready") as r:
        return r.status, await r.json()


async def _until_refused(stack: object, index: int, why: str = "refused") -> str:
    """The reason decode worker ``index`` is refused, once it contains ``why`` (a worker's
    fakes change after its first poll: the reason follows at the next one)."""
    router = stack.app[STATE_KEY].router  # type: ignore[attr-defined]
    for _ in range(100):
        worker = router.workers("decode")[index]
        if not worker.healthy and why in (worker.last_error or ""):
            return str(worker.last_error)
        await asyncio.sleep(0.05)
    raise AssertionError(f"the worker was never refused for {why!r}")


async def _until_served(url: str) -> None:
    """Post until a request is served (the workers' next poll after their fakes changed)."""
    for _ in range(100):
        if (await post_raw(url + "/v1/chat/completions", CHAT))[0] == 200:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("no request was served")


def test_protocol_versions() -> None:
    assert check_peer(PROTOCOL_VERSION) is None
    assert "older" in (check_peer(0) or "")
    assert "newer" in (check_peer(PROTOCOL_VERSION + 1) or "")


async def test_a_worker_of_another_protocol_gets_no_request(make_stack: StackFactory) -> None:
    stack = await make_stack(decode=2)
    stack.decodes[0].protocol_version = 0  # a worker from before the field existed
    why = await _until_refused(stack, 0, "protocol")
    assert "protocol 0" in why
    for _ in range(4):
        status, _, _ = await post_raw(stack.url + "/v1/chat/completions", CHAT)
        assert status == 200
    assert stack.decodes[0].generate_ids == [] and len(stack.decodes[1].generate_ids) == 4
    status, body = await _ready(stack.url)
    assert status == 200 and "refused" in json.dumps(body["decode"])


async def test_a_worker_with_other_weights_gets_no_request(make_stack: StackFactory) -> None:
    stack = await make_stack(decode=2)
    stack.tokenizer.model_fingerprint = "aaaaaaaaaaaaaaaa"
    stack.decodes[0].model_fingerprint = "aaaaaaaaaaaaaaaa"
    stack.decodes[1].model_fingerprint = "bbbbbbbbbbbbbbbb"  # same shape, a fine-tune, say
    await _until_served(stack.url)
    why = await _until_refused(stack, 1, "bbbbbbbbbbbbbbbb")
    assert "bbbbbbbbbbbbbbbb" in why and "aaaaaaaaaaaaaaaa" in why
    before = len(stack.decodes[1].generate_ids)
    for _ in range(4):
        assert (await post_raw(stack.url + "/v1/chat/completions", CHAT))[0] == 200
    assert len(stack.decodes[1].generate_ids) == before


async def test_a_worker_reporting_no_fingerprint_gets_no_request(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Fail closed (issue 47): a worker that does not say which model it serves is refused like
    one serving another model, with a warning and the reason in /ready."""
    stack = await make_stack(decode=2)
    stack.decodes[0].model_fingerprint = ""  # an old or hostile worker, or a broken one
    with caplog.at_level("WARNING", logger="services.gateway.router"):
        await _until_served(stack.url)
        why = await _until_refused(stack, 0, "no model fingerprint")
    assert "reports no model fingerprint" in why
    assert any("not routing to decode worker" in r.getMessage() and "no model fingerprint"
               in r.getMessage() for r in caplog.records)  # fmt: skip
    before = [len(d.generate_ids) for d in stack.decodes]
    for _ in range(4):
        assert (await post_raw(stack.url + "/v1/chat/completions", CHAT))[0] == 200
    assert len(stack.decodes[0].generate_ids) == before[0]
    assert len(stack.decodes[1].generate_ids) == before[1] + 4
    status, body = await _ready(stack.url)
    assert status == 200 and "reports no model fingerprint" in json.dumps(body["decode"])


async def test_a_tokenizer_reporting_no_fingerprint_leaves_every_worker_refused(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(decode=1)
    stack.tokenizer.model_fingerprint = ""  # nothing to check the workers against
    status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", CHAT)
    assert status == 503, raw
    assert stack.decodes[0].generate_ids == []
    why = await _until_refused(stack, 0, "the tokenizer reports no model fingerprint")
    status, body = await _ready(stack.url)
    assert status == 503 and "decode: no healthy worker" in json.dumps(body["problems"])


async def test_a_tokenizer_of_another_protocol_is_refused(make_stack: StackFactory) -> None:
    stack = await make_stack()
    stack.tokenizer.protocol_version = PROTOCOL_VERSION + 1
    status, raw, _ = await post_raw(stack.url + "/v1/chat/completions", CHAT)
    error = json.loads(raw)["error"]
    assert status == 503 and "newer" in error["message"]
    assert stack.decodes[0].generate_ids == []


def test_workers_and_tokenizer_agree_and_the_weights_count(tiny_llama_dir: Path) -> None:
    source = resolve_model(str(tiny_llama_dir))
    loaded = load_model(str(tiny_llama_dir))
    assert loaded.fingerprint == model_fingerprint(source) != ""
    assert loaded.fingerprint == fingerprint(loaded.config.fingerprint(), weights_digest(source))
    # one byte of the weights changes the fingerprint
    copy = tiny_llama_dir.parent / "tiny-copy"
    if not copy.exists():
        copy.mkdir()
        for f in tiny_llama_dir.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        weights = sorted(copy.glob("*.safetensors"))[0]
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1
        weights.write_bytes(bytes(data))
    other = resolve_model(str(copy))
    assert model_fingerprint(other) != model_fingerprint(source)
    assert load_model(str(copy)).config.fingerprint() == loaded.config.fingerprint()


def _copy_folder(source: Path, target: Path) -> Path:
    target.mkdir()
    for f in source.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target


def test_the_fingerprint_covers_the_tokenizer_and_the_chat_template(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """One set of weights with another vocabulary or chat template is another model: they
    tokenize or render prompts differently, so their KV and prefix keys must not mix."""
    folder = _copy_folder(tiny_llama_dir, tmp_path / "with-tokenizer")
    bare = model_fingerprint(resolve_model(str(folder)))
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    config = {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    source = resolve_model(str(folder))
    with_tokenizer = model_fingerprint(source)
    assert with_tokenizer != bare
    # the engine's loader computes the same value (the workers and the tokenizer agree)
    assert load_model(str(folder)).fingerprint == with_tokenizer
    # another chat template, same weights and vocabulary: another fingerprint
    config["chat_template"] = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert model_fingerprint(source) not in (with_tokenizer, bare)
    # a template in its own file counts too
    (folder / "chat_template.jinja").write_text("{{ messages[0].content }}")
    with_file = model_fingerprint(source)
    (folder / "chat_template.jinja").write_text("{{ messages[-1].content }}")
    assert model_fingerprint(source) != with_file
    # and another vocabulary, same template
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 1, "b": 0}}}))
    assert model_fingerprint(source) != with_file


def test_the_tokenizer_fingerprint_fails_closed(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """No fingerprint means the gateway could not check its workers: the tokenizer refuses to
    start (ModelLoadError) instead of serving with an empty one."""
    for name in ("tokenizer.json", "extra.safetensors"):  # there, but cannot be read
        unreadable = _copy_folder(tiny_llama_dir, tmp_path / f"unreadable-{name}")
        (unreadable / name).symlink_to(tmp_path / f"nowhere-{name}")
        with pytest.raises(ModelLoadError, match="cannot compute the model fingerprint"):
            model_fingerprint(resolve_model(str(unreadable)))
    unknown = _copy_folder(tiny_llama_dir, tmp_path / "unknown-architecture")
    config = json.loads((unknown / "config.json").read_text())
    config["architectures"], config["model_type"] = ["NoSuchForCausalLM"], "no-such"
    (unknown / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="cannot compute the model fingerprint"):
        model_fingerprint(resolve_model(str(unknown)))
