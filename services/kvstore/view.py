"""A read-only window on the store's live state, for tests, audits and debugging tools.

``KVStore.view()`` returns a ``StoreView``; every method answers from the live state at call time
and returns plain values (lists, dicts, snapshots), so nothing a caller does with them can change
the store. Tests use it instead of reaching into private attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .block_pool import chain
from .keys import Namespace
from .types import Reservation

if TYPE_CHECKING:
    from .store import KVStore


class StoreView:
    """Read-only accessors over one ``KVStore`` (no method mutates anything)."""

    __slots__ = ("_store",)

    def __init__(self, store: KVStore):
        self._store = store

    def worker_ids(self) -> list[str]:
        return sorted(self._store._workers)

    def lease_deadline(self, worker_id: str) -> float:
        return self._store._workers[worker_id].lease_deadline

    def free_ids(self, worker_id: str) -> list[int]:
        """The worker's free queue in allocation order."""
        return self._store._workers[worker_id].pool.free_ids()

    def eviction_order(self, worker_id: str) -> list[int]:
        """Last block ids of the worker's evictable leaf runs, in the order they would go now."""
        return self._store._workers[worker_id].pool.eviction_order()

    def pins(self, worker_id: str) -> list[int]:
        """Per block id of the worker: live reservations holding it (0 = free or cached)."""
        worker = self._store._workers[worker_id]
        out = [0] * worker.pool.num_blocks
        for record in worker.reservations.values():
            for run in chain(record.last):
                for i in run.ids:
                    out[i] += 1
            for i in record.own:
                out[i] += 1
        return out

    def runs(self, worker_id: str) -> list[tuple[int, tuple[int, ...]]]:
        """The worker's published runs as (depth of first block, block ids), shallowest first."""
        wid = worker_id
        found = [(n.depth, tuple(n.residency[wid].ids)) for n in self._store._trie.iter_nodes() if wid in n.residency]
        return sorted(found)

    def namespace(self, worker_id: str, cache_salt: bytes = b"") -> Namespace:
        return self._store._workers[worker_id].namespace(cache_salt)

    def reservations(self) -> list[Reservation]:
        """Snapshots of every live reservation, by id."""
        return [r.snapshot() for _, r in sorted(self._store._reservations.items())]

    def last_seq(self, worker_id: str) -> int:
        """Sequence number of the worker's latest event (0 if none)."""
        return self._store._events.last_seq(worker_id)

    def tick(self) -> int:
        """The store's logical clock (advanced by every mutating verb)."""
        return self._store.tick
