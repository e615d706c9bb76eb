from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WatchPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefixCacheUpdate(_message.Message):
    __slots__ = ("snapshot", "stored", "removed", "block_size", "worker_id", "sequence")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    worker_id: str
    sequence: int
    def __init__(self, snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., worker_id: _Optional[str] = ..., sequence: _Optional[int] = ...) -> None: ...
