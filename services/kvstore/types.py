"""Plain value types that cross the kvstore's API: what callers pass in and what they get back.

Everything here is an immutable snapshot; nothing refers back into the store's live state, so a
servicer may convert these to protobuf at leisure. Block tables are tuples of block ids in position
order (block ``b`` = page ``b`` of the target pool and page ``b`` of the draft pool).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from services.common.errors import TandemError
from services.common.spec import SpecMode

from .keys import BlockKey


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker declares when it registers (``RegisterWorker``).

    ``mtp_depth`` only matters for ``SpecMode.MTP`` (0 means 1, as on the wire); the store
    normalizes it to 1 for every other mode.
    """

    worker_id: str
    address: str
    model_id: str
    spec_mode: SpecMode
    mtp_depth: int
    block_size: int
    num_blocks: int
    vocab_size: int
    max_seq_len: int


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """Blocks per state on one worker; ``free + cached + in_use == total`` always."""

    total: int
    free: int
    cached: int
    in_use: int


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A registered worker as ``RegisterWorker`` / ``ListWorkers`` report it."""

    spec: WorkerSpec
    incarnation: int
    span: int  # lookahead span D derived from the spec mode
    lease_expires_in_s: float
    pool: PoolUsage
    live_reservations: int

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id


@dataclass(frozen=True, slots=True)
class MatchResult:
    """How much of one prompt a worker could reuse right now, and how loaded it is."""

    worker_id: str
    incarnation: int
    reusable_positions: int
    reusable_blocks: int
    pool: PoolUsage
    live_reservations: int


@dataclass(frozen=True, slots=True)
class Reservation:
    """Snapshot of a live reservation (a lease on blocks of one worker incarnation).

    ``capacity_positions == len(block_table) * block_size``; the first ``published_blocks`` blocks
    are published (shared, read-only); ``num_tokens`` is the length of the token sequence the
    store knows for the request (prompt + tokens appended by Publish/Release).
    """

    reservation_id: str
    request_id: str
    worker_id: str
    incarnation: int
    block_table: tuple[int, ...]
    reused_positions: int
    capacity_positions: int
    published_blocks: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class ExtendItem:
    """Grow ``reservation_id`` to hold at least ``capacity_positions`` positions."""

    reservation_id: str
    incarnation: int
    capacity_positions: int


@dataclass(frozen=True, slots=True)
class TrimItem:
    """Shrink ``reservation_id`` to the blocks needed for ``capacity_positions`` positions."""

    reservation_id: str
    incarnation: int
    capacity_positions: int


@dataclass(frozen=True, slots=True)
class ItemResult:
    """Outcome of one Extend/Trim item. On error nothing of that item changed and the table and
    capacity are the reservation's current ones (empty if the reservation is unknown)."""

    reservation_id: str
    error: TandemError | None
    block_table: tuple[int, ...]
    capacity_positions: int
    added_blocks: tuple[int, ...] = ()  # Extend: block ids appended by this item
    freed_blocks: tuple[int, ...] = ()  # Trim: block ids returned to the free queue

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What Publish did. ``reservation.block_table`` may differ from before (dedup remaps)."""

    reservation: Reservation
    newly_published: int  # blocks inserted into the trie (new node or new residency)
    deduplicated: int  # blocks replaced by the worker's existing copy of the same key


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    """What Release / Suspend did before the reservation ended."""

    reservation_id: str
    newly_published: int
    deduplicated: int
    freed_blocks: int  # blocks returned to the free queue: unpublished ones and deduplicated copies
    unpinned_blocks: int  # published blocks whose reference this reservation dropped


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """Counters of one worker incarnation (they restart at zero on re-registration)."""

    worker_id: str
    incarnation: int
    pool: PoolUsage
    live_reservations: int
    requested_positions: int  # prompt positions asked for by Reserve
    reused_positions: int  # of those, positions served from cache
    evictions: int
    published_blocks: int
    deduplicated_blocks: int
    ending_reservations: int = 0  # ended by the router, blocks held until the worker confirms


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Store-wide counters plus one ``WorkerStats`` per (selected) live worker."""

    workers: tuple[WorkerStats, ...]
    matches: int
    reservations_created: int
    live_reservations: int
    trie_nodes: int  # distinct published blocks in the index (one per block key)
    trie_runs: int = 0  # trie nodes proper: runs of blocks (path compression)
    ending_reservations: int = 0  # ended by the router, blocks held until their worker confirms


class EventKind(enum.Enum):
    """Kinds of block events (values match ``BlockEvent.Kind`` on the wire)."""

    STORED = 1  # blocks published on the worker
    REMOVED = 2  # blocks evicted from the worker
    CLEARED = 3  # everything of the worker dropped (re-registration or lease lapse)


@dataclass(frozen=True, slots=True)
class Event:
    """One change of a worker's cached blocks. ``seq`` counts from 1 per worker id and keeps
    counting across incarnations. STORED lists a chain of published blocks (parent of the first =
    ``parent_key``, the namespace root key for a first block); REMOVED lists evicted blocks,
    deepest first; CLEARED lists none. Keys are computed when the event is recorded. One publish
    or eviction larger than ``EventLog.max_blocks`` becomes several events (consecutive seqs,
    each STORED part chained to the previous one by ``parent_key``)."""

    seq: int
    kind: EventKind
    worker_id: str
    incarnation: int
    block_keys: tuple[BlockKey, ...] = ()
    block_ids: tuple[int, ...] = ()
    parent_key: BlockKey | None = None


@dataclass(frozen=True, slots=True)
class HeldReservation:
    """A reservation a worker still runs, as it re-announces it after a kvstore restart
    (``restore_worker``): the sequence the kvstore held for it (prompt + tokens sent since),
    its whole block table, and how many leading blocks its Publishes (sent or answered) made
    final. ``tokens`` is packed little-endian uint32 or a sequence of ints."""

    reservation_id: str
    request_id: str
    tokens: object
    cache_salt: bytes
    block_table: tuple[int, ...]
    published_blocks: int


@dataclass(frozen=True, slots=True)
class HeldSequence:
    """Published blocks a worker still holds unchanged: block ``block_ids[j]`` holds the KV of
    key block ``j`` of ``tokens`` (under ``cache_salt``); re-announced after a kvstore restart so
    the shared cache is rebuilt from the workers."""

    tokens: object
    cache_salt: bytes
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """What ``restore_worker`` did: the new registration, the reservations it re-created (their
    tables may differ in deduplicated final blocks, which the worker adopts), the ones it could
    not (id, why), and how many cached blocks it took back."""

    worker: WorkerInfo
    restored: tuple[Reservation, ...]
    dropped: tuple[tuple[str, str], ...]
    cached_blocks: int
