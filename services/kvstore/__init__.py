"""The kvstore: the single source of truth about every worker's KV-cache blocks.

Each registered worker owns a pool of *paired* blocks (block ``b`` = page ``b`` of its target KV
pool and page ``b`` of its draft KV pool), every block being free, cached (published and
unreferenced, evictable) or in use (pinned by at least one reservation). Published blocks live in
one path-compressed radix trie shared by all workers, keyed by the exact content of the shifted key
stream of DESIGN §1 (``keys``): each node holds a run of blocks and records, per worker, the block
ids holding it there (``radix_trie``). ``block_pool`` holds the per-worker free queue, the pin
counts of runs and the least-recently-used-leaf eviction order; ``store.KVStore`` is the facade with
the transaction verbs (register, heartbeat, match, reserve, extend, trim, publish, release, suspend,
abort, stats, invariant audit, events), each atomic: it happens completely or raises a typed error
having changed nothing. ``validation`` checks inputs before anything mutates, ``records`` holds the
mutable worker/reservation records, ``audit`` is the full invariant check, ``events`` buffers the
per-worker stored/removed/cleared event stream (opt-in), ``view`` is a read-only window on the live
state and ``types`` holds the immutable values that cross the API. The core is plain synchronous
Python with no network imports; ``servicer``/``server`` put it behind gRPC.

Durability (``--backend redis``): ``journal`` wraps the core unchanged and records every committed
transaction (verb, arguments, clock reading, outcome; ``journal_codec`` writes each as compact
bytes) for deterministic replay, plus pickled snapshots; ``redis_backend`` writes them to Redis with fenced Lua scripts (group commit) and
loads them back; ``leader`` holds the Redis lease, recovers, serves, and stands by otherwise.
"""

from .keys import BlockKey, KeyStream, Namespace
from .store import KVStore
from .types import (
    Event,
    EventKind,
    ExtendItem,
    HeldReservation,
    HeldSequence,
    ItemResult,
    MatchResult,
    PoolUsage,
    PublishResult,
    ReleaseResult,
    Reservation,
    RestoreResult,
    StoreStats,
    TrimItem,
    WorkerInfo,
    WorkerSpec,
    WorkerStats,
)

__all__ = [
    "BlockKey", "Event", "EventKind", "ExtendItem", "HeldReservation", "HeldSequence", "ItemResult", "KVStore", "KeyStream",
    "MatchResult", "Namespace", "PoolUsage", "PublishResult", "ReleaseResult", "Reservation", "RestoreResult",
    "StoreStats", "TrimItem", "WorkerInfo", "WorkerSpec", "WorkerStats",
]
