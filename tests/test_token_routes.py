"""``/tokenize``, ``/detokenize`` and ``/version`` on the real gateway over fake services (a
character-level tokenizer): vLLM's request and response shapes, authentication, and OpenAI-shaped
errors for bad input."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from tests.gateway_fakes import CONTEXT, MODEL, StackFactory


async def _post(url: str, body: object, headers: dict[str, str] | None = None
                ) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_tokenize_a_prompt_and_a_chat_and_detokenize(make_stack: StackFactory) -> None:
    stack = await make_stack()
    status, body = await _post(stack.url + "/tokenize", {"model": MODEL, "prompt": "hey"})
    assert status == 200
    assert body == {"count": 3, "max_model_len": CONTEXT, "tokens": [104, 101, 121],
                    "token_strs": None}
    status, body = await _post(stack.url + "/tokenize", {
        "messages": [{"role": "user", "content": "hi"}], "return_token_strs": True})
    prompt = "user: hi\nassistant:"  # the template the completions route renders
    assert status == 200 and body["tokens"] == [ord(c) for c in prompt]
    assert body["count"] == len(prompt) and len(body["token_strs"]) == len(prompt)
    request = stack.tokenizer.requests[-1]
    assert request.add_generation_prompt and not request.truncate  # counted whole
    status, body = await _post(stack.url + "/tokenize", {
        "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False})
    assert body["tokens"] == [ord(c) for c in "user: hi\n"]
    status, body = await _post(stack.url + "/detokenize", {"tokens": [104, 105]})
    assert (status, body) == (200, {"prompt": "hi"})



async def test_tokenize_passes_chat_template_kwargs_as_a_chat_completion_does(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack()
    chat = [{"role": "user", "content": "hi"}]
    status, _ = await _post(stack.url + "/tokenize", {
        "messages": chat, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200
    assert json.loads(stack.tokenizer.requests[-1].chat_template_kwargs_json) == {
        "enable_thinking": False}
    status, body = await _post(stack.url + "/tokenize", {
        "messages": chat, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs.add_generation_prompt"

async def test_version_needs_no_key_but_tokenize_does(make_stack: StackFactory) -> None:
    stack = await make_stack(keys=("sekrit",))
    async with aiohttp.ClientSession() as s, s.get(stack.url + "/version") as r:
        assert r.status == 200 and isinstance((await r.json())["version"], str)
    status, body = await _post(stack.url + "/tokenize", {"prompt": "x"})
    assert status == 401 and body["error"]["type"]
    status, body = await _post(stack.url + "/tokenize", {"prompt": "x"},
                               {"Authorization": "Bearer sekrit"})  # fmt: skip
    assert status == 200 and body["tokens"] == [120]


async def test_bad_token_requests_are_openai_errors(make_stack: StackFactory) -> None:
    stack = await make_stack()
    cases: list[tuple[str, object, int, str | None]] = [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": 3}, 400, "prompt"),
        ("/tokenize", {"messages": "hi"}, 400, "messages"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
        ("/tokenize", {"prompt": "a", "temperature": 1}, 400, "temperature"),
        ("/tokenize", [1, 2], 400, None),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [0x110000]}, 400, "tokens"),
    ]
    for path, body, status, param in cases:
        got, answer = await _post(stack.url + path, body)
        assert got == status, (path, body, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
        assert answer["error"]["param"] == param, (path, body, answer)
