from services.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat", "add_special_tokens", "add_generation_prompt", "max_tokens", "context_length", "truncate", "tools_json", "chat_template_kwargs_json")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatMessages
    add_special_tokens: bool
    add_generation_prompt: bool
    max_tokens: int
    context_length: int
    truncate: bool
    tools_json: str
    chat_template_kwargs_json: str
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., context_length: _Optional[int] = ..., truncate: _Optional[bool] = ..., tools_json: _Optional[str] = ..., chat_template_kwargs_json: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "dropped_messages", "prompt_text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    dropped_messages: int
    prompt_text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., dropped_messages: _Optional[int] = ..., prompt_text: _Optional[str] = ...) -> None: ...

class DetokenizeConfig(_message.Message):
    __slots__ = ("skip_special_tokens", "stop", "prompt_token_ids")
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    skip_special_tokens: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, skip_special_tokens: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("config", "ids")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    config: DetokenizeConfig
    ids: TokenIds
    def __init__(self, config: _Optional[_Union[DetokenizeConfig, _Mapping]] = ..., ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text", "stopped", "stop_string")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    text: str
    stopped: bool
    stop_string: str
    def __init__(self, text: _Optional[str] = ..., stopped: _Optional[bool] = ..., stop_string: _Optional[str] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "bos_token_id", "eos_token_ids", "pad_token_id", "special_tokens", "context_length", "chat_template", "model_fingerprint", "protocol_version")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    bos_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pad_token_id: int
    special_tokens: _containers.ScalarMap[str, int]
    context_length: int
    chat_template: str
    model_fingerprint: str
    protocol_version: int
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., pad_token_id: _Optional[int] = ..., special_tokens: _Optional[_Mapping[str, int]] = ..., context_length: _Optional[int] = ..., chat_template: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...
