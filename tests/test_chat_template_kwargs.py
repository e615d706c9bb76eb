"""``chat_template_kwargs`` (vLLM's per-request template variables) and ``--chat-template FILE``
(a template replacing the model's own), on the tokenizer service and through ``tandem up``'s plan.

Everything here runs the real tokenizer servicer on the default model's tokenizer (SmolLM2),
in-process, with a template that reads a variable."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from services.common.errors import InvalidArgumentError, ModelLoadError
from services.common.model_source import resolve_model
from services.common.pb import common_pb2, tokenizer_pb2
from services.gateway.openai_requests import parse_chat_request
from services.launch_plan import LaunchConfig, plan
from services.tokenizer.main import add_arguments, read_chat_template
from services.tokenizer.servicer import TokenizerServicer
from services.tokenizer.tokenizer import Tokenizer

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>"
            "\n\n{% endif %}{% endif %}{% if greeting %}{{ greeting }}{% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def servicer() -> TokenizerServicer:
    tokenizer = Tokenizer.load(resolve_model("default"))
    tokenizer.use_chat_template(TEMPLATE)
    return TokenizerServicer(tokenizer)


def tokenize(servicer: TokenizerServicer, kwargs: object = None) -> str:
    request = tokenizer_pb2.TokenizeRequest(
        chat=tokenizer_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="Hi")]),
        add_generation_prompt=True, max_tokens=1,
        chat_template_kwargs_json="" if kwargs is None else json.dumps(kwargs))  # fmt: skip
    reply = servicer.tokenize(request)
    assert servicer._tokenizer.encode(reply.prompt_text, add_special_tokens=False) == list(reply.token_ids)
    return reply.prompt_text


def test_the_kwargs_reach_the_template(servicer: TokenizerServicer) -> None:
    assert tokenize(servicer).endswith("<|im_start|>assistant\n")
    assert tokenize(servicer, {"enable_thinking": False}).endswith("assistant\n<think>\n\n</think>\n\n")
    assert tokenize(servicer, {"enable_thinking": True, "greeting": "Hello!"}).endswith("assistant\nHello!")
    assert servicer.model_info().chat_template == TEMPLATE  # the gateway reads the override too


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"tools": []}, {"add_generation_prompt": False}, [1]])
def test_the_request_own_variables_are_not_kwargs(servicer: TokenizerServicer, kwargs: object) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        tokenize(servicer, kwargs)
    assert info.value.param == "chat_template_kwargs"


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"messages": []}, "chat_template_kwargs.messages"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ("enable_thinking=false", "chat_template_kwargs"),
])  # fmt: skip
def test_the_gateway_refuses_bad_kwargs_naming_the_param(kwargs: object, param: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": kwargs}
    with pytest.raises(InvalidArgumentError) as info:
        parse_chat_request(body, served_models=["m"])
    assert info.value.param == param
    good = parse_chat_request({**body, "chat_template_kwargs": {"enable_thinking": False}},
                              served_models=["m"])  # fmt: skip
    assert good.chat_template_kwargs == {"enable_thinking": False}


def test_a_chat_template_file_replaces_the_models(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE
    with pytest.raises(ModelLoadError):
        read_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "bad.jinja").write_text("{% for %}")
    tokenizer = Tokenizer.load(resolve_model("default"))
    with pytest.raises(ModelLoadError):
        tokenizer.use_chat_template(read_chat_template(str(tmp_path / "bad.jinja")))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--chat-template", str(path)]).chat_template == str(path)
    specs = plan(LaunchConfig(num_prefill=1, num_decode=1, chat_template=str(path)))
    tokenizer_argv = next(s.argv for s in specs if s.name == "tokenizer")
    assert tokenizer_argv[tokenizer_argv.index("--chat-template") + 1] == str(path)
    assert all("--chat-template" not in s.argv for s in specs if s.name != "tokenizer")
