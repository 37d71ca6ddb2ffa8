from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpecMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPEC_MODE_UNSPECIFIED: _ClassVar[SpecMode]
    SPEC_MODE_NONE: _ClassVar[SpecMode]
    SPEC_MODE_EAGLE3: _ClassVar[SpecMode]
    SPEC_MODE_MTP: _ClassVar[SpecMode]
    SPEC_MODE_PARD: _ClassVar[SpecMode]
SPEC_MODE_UNSPECIFIED: SpecMode
SPEC_MODE_NONE: SpecMode
SPEC_MODE_EAGLE3: SpecMode
SPEC_MODE_MTP: SpecMode
SPEC_MODE_PARD: SpecMode

class TokenIds(_message.Message):
    __slots__ = ("list", "packed")
    LIST_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    list: Uint32List
    packed: bytes
    def __init__(self, list: _Optional[_Union[Uint32List, _Mapping]] = ..., packed: _Optional[bytes] = ...) -> None: ...

class Uint32List(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Iterable[int]] = ...) -> None: ...
