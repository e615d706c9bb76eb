from services.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVStoreRequest(_message.Message):
    __slots__ = ("group", "op", "keys", "value", "expected", "amount", "timeout_seconds")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OP_UNSPECIFIED: _ClassVar[KVStoreRequest.Op]
        SET: _ClassVar[KVStoreRequest.Op]
        GET: _ClassVar[KVStoreRequest.Op]
        ADD: _ClassVar[KVStoreRequest.Op]
        CHECK: _ClassVar[KVStoreRequest.Op]
        WAIT: _ClassVar[KVStoreRequest.Op]
        COMPARE_SET: _ClassVar[KVStoreRequest.Op]
        DELETE_KEY: _ClassVar[KVStoreRequest.Op]
        NUM_KEYS: _ClassVar[KVStoreRequest.Op]
    OP_UNSPECIFIED: KVStoreRequest.Op
    SET: KVStoreRequest.Op
    GET: KVStoreRequest.Op
    ADD: KVStoreRequest.Op
    CHECK: KVStoreRequest.Op
    WAIT: KVStoreRequest.Op
    COMPARE_SET: KVStoreRequest.Op
    DELETE_KEY: KVStoreRequest.Op
    NUM_KEYS: KVStoreRequest.Op
    GROUP_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    group: str
    op: KVStoreRequest.Op
    keys: _containers.RepeatedScalarFieldContainer[str]
    value: bytes
    expected: bytes
    amount: int
    timeout_seconds: float
    def __init__(self, group: _Optional[str] = ..., op: _Optional[_Union[KVStoreRequest.Op, str]] = ..., keys: _Optional[_Iterable[str]] = ..., value: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., amount: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class KVStoreResponse(_message.Message):
    __slots__ = ("value", "number", "ok")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    number: int
    ok: bool
    def __init__(self, value: _Optional[bytes] = ..., number: _Optional[int] = ..., ok: _Optional[bool] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_tokens", "lease_seconds", "prompt_digest", "renew")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RENEW_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    lease_seconds: float
    prompt_digest: bytes
    renew: bool
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., prompt_digest: _Optional[bytes] = ..., renew: _Optional[bool] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("request_id", "num_blocks", "lease_seconds", "kv_blocks_free")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_blocks: int
    lease_seconds: float
    kv_blocks_free: int
    def __init__(self, request_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., kv_blocks_free: _Optional[int] = ...) -> None: ...

class KVTransferMessage(_message.Message):
    __slots__ = ("header", "chunk", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    chunk: KVChunk
    commit: KVCommit
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., commit: _Optional[_Union[KVCommit, _Mapping]] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("request_id", "layout", "num_tokens", "num_blocks", "total_bytes", "prompt_token_ids", "first_token_id", "first_logprob", "params", "num_prompt_tokens", "num_cached_tokens", "channel")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: _common_pb2.KVLayout
    num_tokens: int
    num_blocks: int
    total_bytes: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    params: _common_pb2.SamplingParams
    num_prompt_tokens: int
    num_cached_tokens: int
    channel: KVChannelOffer
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., total_bytes: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., channel: _Optional[_Union[KVChannelOffer, _Mapping]] = ...) -> None: ...

class KVChannelOffer(_message.Message):
    __slots__ = ("peer_id", "peer_instance", "device", "retired_group", "gpu_uuid", "cuda_ipc", "source_blocks", "payload_key")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RETIRED_GROUP_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_KEY_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    peer_instance: str
    device: str
    retired_group: str
    gpu_uuid: str
    cuda_ipc: CudaIpcPool
    source_blocks: _containers.RepeatedScalarFieldContainer[int]
    payload_key: bytes
    def __init__(self, peer_id: _Optional[str] = ..., peer_instance: _Optional[str] = ..., device: _Optional[str] = ..., retired_group: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., cuda_ipc: _Optional[_Union[CudaIpcPool, _Mapping]] = ..., source_blocks: _Optional[_Iterable[int]] = ..., payload_key: _Optional[bytes] = ...) -> None: ...

class CudaIpcPool(_message.Message):
    __slots__ = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "dtype", "shape")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("first_block", "num_blocks", "data", "crc32", "offset", "channel_bytes", "seal_tag")
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEAL_TAG_FIELD_NUMBER: _ClassVar[int]
    first_block: int
    num_blocks: int
    data: bytes
    crc32: int
    offset: int
    channel_bytes: int
    seal_tag: bytes
    def __init__(self, first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., offset: _Optional[int] = ..., channel_bytes: _Optional[int] = ..., seal_tag: _Optional[bytes] = ...) -> None: ...

class KVCommit(_message.Message):
    __slots__ = ("num_chunks", "total_bytes")
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    total_bytes: int
    def __init__(self, num_chunks: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class KVTransferAck(_message.Message):
    __slots__ = ("request_id", "accepted", "error", "num_blocks", "bytes_received")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    accepted: bool
    error: str
    num_blocks: int
    bytes_received: int
    def __init__(self, request_id: _Optional[str] = ..., accepted: _Optional[bool] = ..., error: _Optional[str] = ..., num_blocks: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "wait_for_kv_seconds", "prompt_token_ids", "params", "output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_KV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    wait_for_kv_seconds: float
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., wait_for_kv_seconds: _Optional[float] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "text", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "completion_tokens", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    text: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    completion_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
