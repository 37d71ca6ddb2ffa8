from tandem.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "address", "model_id", "spec_mode", "mtp_depth", "block_size", "num_blocks", "vocab_size", "max_seq_len", "held_reservations", "held_sequences")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_MODE_FIELD_NUMBER: _ClassVar[int]
    MTP_DEPTH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    HELD_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    HELD_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    model_id: str
    spec_mode: _common_pb2.SpecMode
    mtp_depth: int
    block_size: int
    num_blocks: int
    vocab_size: int
    max_seq_len: int
    held_reservations: _containers.RepeatedCompositeFieldContainer[HeldReservation]
    held_sequences: _containers.RepeatedCompositeFieldContainer[HeldSequence]
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., model_id: _Optional[str] = ..., spec_mode: _Optional[_Union[_common_pb2.SpecMode, str]] = ..., mtp_depth: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., held_reservations: _Optional[_Iterable[_Union[HeldReservation, _Mapping]]] = ..., held_sequences: _Optional[_Iterable[_Union[HeldSequence, _Mapping]]] = ...) -> None: ...

class HeldReservation(_message.Message):
    __slots__ = ("reservation_id", "request_id", "tokens_packed", "cache_salt", "block_table", "published_blocks")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PACKED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    request_id: str
    tokens_packed: bytes
    cache_salt: bytes
    block_table: _containers.RepeatedScalarFieldContainer[int]
    published_blocks: int
    def __init__(self, reservation_id: _Optional[str] = ..., request_id: _Optional[str] = ..., tokens_packed: _Optional[bytes] = ..., cache_salt: _Optional[bytes] = ..., block_table: _Optional[_Iterable[int]] = ..., published_blocks: _Optional[int] = ...) -> None: ...

class HeldSequence(_message.Message):
    __slots__ = ("tokens_packed", "cache_salt", "block_ids")
    TOKENS_PACKED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    tokens_packed: bytes
    cache_salt: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens_packed: _Optional[bytes] = ..., cache_salt: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DroppedReservation(_message.Message):
    __slots__ = ("reservation_id", "reason")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    reason: str
    def __init__(self, reservation_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker", "restored", "dropped", "restored_cached_blocks")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    RESTORED_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    restored: _containers.RepeatedCompositeFieldContainer[Reservation]
    dropped: _containers.RepeatedCompositeFieldContainer[DroppedReservation]
    restored_cached_blocks: int
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., restored: _Optional[_Iterable[_Union[Reservation, _Mapping]]] = ..., dropped: _Optional[_Iterable[_Union[DroppedReservation, _Mapping]]] = ..., restored_cached_blocks: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "incarnation", "address", "model_id", "spec_mode", "mtp_depth", "span", "block_size", "vocab_size", "max_seq_len", "pool", "live_reservations", "lease_expires_in_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_MODE_FIELD_NUMBER: _ClassVar[int]
    MTP_DEPTH_FIELD_NUMBER: _ClassVar[int]
    SPAN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    LIVE_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    address: str
    model_id: str
    spec_mode: _common_pb2.SpecMode
    mtp_depth: int
    span: int
    block_size: int
    vocab_size: int
    max_seq_len: int
    pool: PoolUsage
    live_reservations: int
    lease_expires_in_s: float
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., address: _Optional[str] = ..., model_id: _Optional[str] = ..., spec_mode: _Optional[_Union[_common_pb2.SpecMode, str]] = ..., mtp_depth: _Optional[int] = ..., span: _Optional[int] = ..., block_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., pool: _Optional[_Union[PoolUsage, _Mapping]] = ..., live_reservations: _Optional[int] = ..., lease_expires_in_s: _Optional[float] = ...) -> None: ...

class PoolUsage(_message.Message):
    __slots__ = ("total", "free", "cached", "in_use")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    total: int
    free: int
    cached: int
    in_use: int
    def __init__(self, total: _Optional[int] = ..., free: _Optional[int] = ..., cached: _Optional[int] = ..., in_use: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_expires_in_s", "ending_reservation_ids")
    LEASE_EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    ENDING_RESERVATION_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_expires_in_s: float
    ending_reservation_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_expires_in_s: _Optional[float] = ..., ending_reservation_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetReservationRequest(_message.Message):
    __slots__ = ("reservation_id", "incarnation")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    incarnation: int
    def __init__(self, reservation_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class GetReservationResponse(_message.Message):
    __slots__ = ("reservation", "prompt_packed", "cache_salt")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_PACKED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    reservation: Reservation
    prompt_packed: bytes
    cache_salt: bytes
    def __init__(self, reservation: _Optional[_Union[Reservation, _Mapping]] = ..., prompt_packed: _Optional[bytes] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("tokens", "cache_salt", "model_id")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    tokens: _common_pb2.TokenIds
    cache_salt: bytes
    model_id: str
    def __init__(self, tokens: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., cache_salt: _Optional[bytes] = ..., model_id: _Optional[str] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerMatch]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerMatch, _Mapping]]] = ...) -> None: ...

class WorkerMatch(_message.Message):
    __slots__ = ("worker_id", "incarnation", "reusable_positions", "reusable_blocks", "pool", "live_reservations")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REUSABLE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    REUSABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    LIVE_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    reusable_positions: int
    reusable_blocks: int
    pool: PoolUsage
    live_reservations: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., reusable_positions: _Optional[int] = ..., reusable_blocks: _Optional[int] = ..., pool: _Optional[_Union[PoolUsage, _Mapping]] = ..., live_reservations: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation", "request_id", "tokens", "cache_salt", "headroom_positions", "candidates")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    request_id: str
    tokens: _common_pb2.TokenIds
    cache_salt: bytes
    headroom_positions: int
    candidates: _containers.RepeatedCompositeFieldContainer[WorkerRef]
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., request_id: _Optional[str] = ..., tokens: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., cache_salt: _Optional[bytes] = ..., headroom_positions: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[WorkerRef, _Mapping]]] = ...) -> None: ...

class WorkerRef(_message.Message):
    __slots__ = ("worker_id", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("reservation_id", "request_id", "worker_id", "incarnation", "block_table", "reused_positions", "capacity_positions", "published_blocks")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    REUSED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    request_id: str
    worker_id: str
    incarnation: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    reused_positions: int
    capacity_positions: int
    published_blocks: int
    def __init__(self, reservation_id: _Optional[str] = ..., request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., reused_positions: _Optional[int] = ..., capacity_positions: _Optional[int] = ..., published_blocks: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation",)
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    reservation: Reservation
    def __init__(self, reservation: _Optional[_Union[Reservation, _Mapping]] = ...) -> None: ...

class CapacityItem(_message.Message):
    __slots__ = ("reservation_id", "incarnation", "capacity_positions")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    incarnation: int
    capacity_positions: int
    def __init__(self, reservation_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., capacity_positions: _Optional[int] = ...) -> None: ...

class CapacityResult(_message.Message):
    __slots__ = ("reservation_id", "code", "message", "block_table", "capacity_positions")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    code: int
    message: str
    block_table: _containers.RepeatedScalarFieldContainer[int]
    capacity_positions: int
    def __init__(self, reservation_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., block_table: _Optional[_Iterable[int]] = ..., capacity_positions: _Optional[int] = ...) -> None: ...

class ExtendRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[CapacityItem]
    def __init__(self, items: _Optional[_Iterable[_Union[CapacityItem, _Mapping]]] = ...) -> None: ...

class ExtendResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CapacityResult]
    def __init__(self, results: _Optional[_Iterable[_Union[CapacityResult, _Mapping]]] = ...) -> None: ...

class TrimRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[CapacityItem]
    def __init__(self, items: _Optional[_Iterable[_Union[CapacityItem, _Mapping]]] = ...) -> None: ...

class TrimResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CapacityResult]
    def __init__(self, results: _Optional[_Iterable[_Union[CapacityResult, _Mapping]]] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("reservation_id", "incarnation", "new_tokens", "final_positions", "known_tokens")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    incarnation: int
    new_tokens: _common_pb2.TokenIds
    final_positions: int
    known_tokens: int
    def __init__(self, reservation_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., new_tokens: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., final_positions: _Optional[int] = ..., known_tokens: _Optional[int] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("reservation", "newly_published", "deduplicated")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    NEWLY_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    reservation: Reservation
    newly_published: int
    deduplicated: int
    def __init__(self, reservation: _Optional[_Union[Reservation, _Mapping]] = ..., newly_published: _Optional[int] = ..., deduplicated: _Optional[int] = ...) -> None: ...

class PublishManyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PublishRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[PublishRequest, _Mapping]]] = ...) -> None: ...

class PublishResult(_message.Message):
    __slots__ = ("code", "message", "response")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    response: PublishResponse
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., response: _Optional[_Union[PublishResponse, _Mapping]] = ...) -> None: ...

class PublishManyResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PublishResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PublishResult, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("reservation_id", "incarnation", "new_tokens", "final_positions")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    incarnation: int
    new_tokens: _common_pb2.TokenIds
    final_positions: int
    def __init__(self, reservation_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., new_tokens: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., final_positions: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("newly_published", "freed_blocks", "deduplicated")
    NEWLY_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    newly_published: int
    freed_blocks: int
    deduplicated: int
    def __init__(self, newly_published: _Optional[int] = ..., freed_blocks: _Optional[int] = ..., deduplicated: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("reservation_id", "incarnation", "worker_id")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    incarnation: int
    worker_id: str
    def __init__(self, reservation_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("workers", "matches", "reservations_created", "live_reservations", "ending_reservations", "trie_nodes")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_CREATED_FIELD_NUMBER: _ClassVar[int]
    LIVE_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    ENDING_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    TRIE_NODES_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    matches: int
    reservations_created: int
    live_reservations: int
    ending_reservations: int
    trie_nodes: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., matches: _Optional[int] = ..., reservations_created: _Optional[int] = ..., live_reservations: _Optional[int] = ..., ending_reservations: _Optional[int] = ..., trie_nodes: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "pool", "live_reservations", "requested_positions", "reused_positions", "evictions", "published_blocks", "deduplicated_blocks", "ending_reservations")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    LIVE_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    REUSED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENDING_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    pool: PoolUsage
    live_reservations: int
    requested_positions: int
    reused_positions: int
    evictions: int
    published_blocks: int
    deduplicated_blocks: int
    ending_reservations: int
    def __init__(self, worker_id: _Optional[str] = ..., pool: _Optional[_Union[PoolUsage, _Mapping]] = ..., live_reservations: _Optional[int] = ..., requested_positions: _Optional[int] = ..., reused_positions: _Optional[int] = ..., evictions: _Optional[int] = ..., published_blocks: _Optional[int] = ..., deduplicated_blocks: _Optional[int] = ..., ending_reservations: _Optional[int] = ...) -> None: ...

class CheckInvariantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckInvariantsResponse(_message.Message):
    __slots__ = ("ok", "violations")
    OK_FIELD_NUMBER: _ClassVar[int]
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    violations: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ok: _Optional[bool] = ..., violations: _Optional[_Iterable[str]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("worker_id", "after_seq")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    after_seq: int
    def __init__(self, worker_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("seq", "worker_id", "incarnation", "kind", "block_keys", "block_ids", "parent_key")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[BlockEvent.Kind]
        KIND_STORED: _ClassVar[BlockEvent.Kind]
        KIND_REMOVED: _ClassVar[BlockEvent.Kind]
        KIND_CLEARED: _ClassVar[BlockEvent.Kind]
    KIND_UNSPECIFIED: BlockEvent.Kind
    KIND_STORED: BlockEvent.Kind
    KIND_REMOVED: BlockEvent.Kind
    KIND_CLEARED: BlockEvent.Kind
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    seq: int
    worker_id: str
    incarnation: int
    kind: BlockEvent.Kind
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    parent_key: bytes
    def __init__(self, seq: _Optional[int] = ..., worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., kind: _Optional[_Union[BlockEvent.Kind, str]] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[int]] = ..., parent_key: _Optional[bytes] = ...) -> None: ...
