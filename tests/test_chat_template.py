"""Chat template rendering: parity with transformers (SmolLM2's ChatML template and a template
using every helper), the sandbox helpers, message validation and error mapping."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest

from services.common.errors import InvalidArgumentError, ModelLoadError
from services.common.model_source import ModelSource, resolve_model
from services.tokenizer.chat_template import ChatTemplate, validate_messages
from services.tokenizer.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hello!"}],
    [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    [
        SYSTEM,
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
    ],
    [
        {"role": "system", "content": "  spaced system\n"},
        {"role": "user", "content": "Ünïcödé 中文 😀👨‍👩‍👧 <|im_start|> and\n\ttabs\n"},
    ],
    [{"role": "user", "content": ""}],
]

# A template in the style of Llama 3 / Qwen exercising every helper transformers provides.
RICH_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='', count=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] %}{% continue %}{% endif %}"
    "{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% set ns.count = ns.count + 1 %}"
    "{% if ns.count == 1 and ns.system %}<<SYS>>{{ ns.system | trim }}<</SYS>>\n{% endif %}"
    "[{{ message['role'] | upper }}] "
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if tools %}TOOLS: {{ tools | tojson }}\n{% endif %}"
    "{% if meta is defined %}META: {{ meta | tojson(indent=2) }}\n{% endif %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
RICH_MESSAGES = [
    {"role": "system", "content": " Be brief. "},
    {"role": "user", "content": "Café <b>&</b> \"quotes\""},
    {"role": "assistant", "content": "Sure."},
    {"role": "user", "content": "再见"},
]


@pytest.fixture(scope="module")
def default_source() -> ModelSource:
    return resolve_model("default")


@pytest.fixture(scope="module")
def tok(default_source: ModelSource) -> Tokenizer:
    return Tokenizer.load(default_source)


@pytest.fixture(scope="module")
def hf_tok(default_source: ModelSource) -> Any:
    transformers = pytest.importorskip("transformers")
    path = Path(default_source.path)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_smollm2_chat_matches_transformers(
    tok: Tokenizer, hf_tok: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf_tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    ids = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == hf_tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_smollm2_chat_shape(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode_chat([SYSTEM, {"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert ids[0] == 1 and ids[-2:] == [2, 198] and ids.count(1) == 2


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rich_template_matches_transformers_renderer(add_generation_prompt: bool) -> None:
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = [{"type": "function", "function": {"name": "f", "description": "é <x>"}}]
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    for extra in ({}, {"tools": tools}, {"meta": {"k": ["ü", 1]}}):
        ours = ChatTemplate(RICH_TEMPLATE).render(
            RICH_MESSAGES, add_generation_prompt=add_generation_prompt, special_tokens=special, **extra
        )
        kwargs = {key: value for key, value in extra.items() if key != "tools"}
        (theirs,), _ = render_jinja_template(
            conversations=[RICH_MESSAGES],
            tools=extra.get("tools"),
            chat_template=RICH_TEMPLATE,
            add_generation_prompt=add_generation_prompt,
            **special,
            **kwargs,
        )
        assert ours == theirs


def test_rich_template_output() -> None:
    text = ChatTemplate(RICH_TEMPLATE).render(
        RICH_MESSAGES, special_tokens={"bos_token": "<s>", "eos_token": "</s>"}, meta={"a": "é"}
    )
    assert text.startswith("<s><<SYS>>Be brief.<</SYS>>\n")
    assert '[USER] Café <b>&</b> "quotes"</s>\n' in text
    assert "[ASSISTANT] Sure.</s>\n" in text
    assert 'META: {\n  "a": "é"\n}\n' in text  # tojson: no HTML escaping, non-ASCII kept
    assert text.endswith("[ASSISTANT] ")


def test_raise_exception_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="Unknown role: tool") as info:
        ChatTemplate(RICH_TEMPLATE).render([{"role": "tool", "content": "x"}])
    assert info.value.param == "messages"


def test_template_runtime_errors_are_invalid_argument() -> None:
    template = ChatTemplate("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(InvalidArgumentError) as info:
        template.render([{"role": "user", "content": "x"}])
    assert info.value.param == "messages"


def test_sandbox_blocks_unsafe_access() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}{% set ns = namespace() %}")
    with pytest.raises(InvalidArgumentError):
        template.render([{"role": "user", "content": "x"}])
    with pytest.raises(InvalidArgumentError):
        ChatTemplate("{% set ns = namespace(_secret=1) %}").render([{"role": "user", "content": "x"}])
    with pytest.raises(InvalidArgumentError):  # immutable sandbox: no mutating the messages
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])


def test_helpers_and_whitespace_control() -> None:
    template = ChatTemplate(
        "{% for m in messages %}\n"
        "    {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{{ m['content'] }}|{{ dict(a=1) | tojson }}|{{ strftime_now('%Y') }}\n"
        "{% endfor %}"
    )
    text = template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    year = datetime.datetime.now().strftime("%Y")
    assert text == f'a|{{"a": 1}}|{year}\n'  # trim_blocks + lstrip_blocks drop the tag lines


def test_variables_and_overrides() -> None:
    template = ChatTemplate("{{ bos_token }}{{ add_generation_prompt }}{{ extra }}{{ tools }}")
    messages = [{"role": "user", "content": "x"}]
    assert template.render(messages, special_tokens={"bos_token": "<s>"}, extra=1) == "<s>True1None"
    assert template.render(messages, add_generation_prompt=False, special_tokens={"bos_token": "<s>"}, bos_token="B") == "BFalseNone"


def test_compiled_once_per_template() -> None:
    first = ChatTemplate("{{ messages | length }}")
    second = ChatTemplate("{{ messages | length }}")
    assert first._template is second._template


def test_syntax_error_is_model_load_error() -> None:
    with pytest.raises(ModelLoadError):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ModelLoadError):
        ChatTemplate("")


@pytest.mark.parametrize(
    "messages",
    [
        None,
        "hello",
        [],
        ["not a dict"],
        [{"content": "no role"}],
        [{"role": "", "content": "x"}],
        [{"role": 3, "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": ["list"]}],
        [{"role": "user", "content": "ok"}, {"role": "assistant", "content": 5}],
    ],
)
def test_invalid_messages(tok: Tokenizer, messages: Any) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        tok.apply_chat_template(messages)
    assert info.value.param == "messages"
    with pytest.raises(InvalidArgumentError):
        tok.encode_chat(messages)


def test_validate_messages_drops_none_values() -> None:
    chat = validate_messages([{"role": "assistant", "content": "x", "tool_calls": None, "name": "bot"}])
    assert chat == [{"role": "assistant", "content": "x", "name": "bot"}]
