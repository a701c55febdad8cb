from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ManifestRequest(_message.Message):
    __slots__ = ("channel", "format", "current_version")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    channel: str
    format: str
    current_version: int
    def __init__(self, channel: _Optional[str] = ..., format: _Optional[str] = ..., current_version: _Optional[int] = ...) -> None: ...

class ManifestReply(_message.Message):
    __slots__ = ("available", "newer", "manifest", "signature", "key_chain", "deltas")
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    NEWER_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    KEY_CHAIN_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    available: bool
    newer: bool
    manifest: bytes
    signature: bytes
    key_chain: _containers.RepeatedCompositeFieldContainer[KeyEndorsement]
    deltas: bool
    def __init__(self, available: _Optional[bool] = ..., newer: _Optional[bool] = ..., manifest: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., key_chain: _Optional[_Iterable[_Union[KeyEndorsement, _Mapping]]] = ..., deltas: _Optional[bool] = ...) -> None: ...

class KeyEndorsement(_message.Message):
    __slots__ = ("statement", "signature")
    STATEMENT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    statement: bytes
    signature: bytes
    def __init__(self, statement: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("version", "format", "offset", "base_version", "compressed")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    version: int
    format: str
    offset: int
    base_version: int
    compressed: bool
    def __init__(self, version: _Optional[int] = ..., format: _Optional[str] = ..., offset: _Optional[int] = ..., base_version: _Optional[int] = ..., compressed: _Optional[bool] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
