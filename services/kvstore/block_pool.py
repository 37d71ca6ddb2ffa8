"""One worker's pool of paired blocks: the free queue, the pin counts of its runs and the eviction
order. Block ``b`` names page ``b`` of the worker's target KV pool *and* page ``b`` of its draft KV
pool, so the two pools cannot disagree about which prefix they hold.

Blocks are plain ints. Published blocks live in **runs**: a ``Run`` is one worker's copy of one
trie node (a node holds a run of consecutive blocks, see ``radix_trie``), with one pin count and
one logical tick for all its blocks, because reservations pin and unpin whole prefixes. Every
block is in exactly one place, and its state follows from the place::

        take_free               pin_chain (reuse / dedup)
    FREE ─────────▶ own block ───publish──▶ run, ref > 0 (IN_USE) ◀─────────── run, ref 0 (CACHED)
      ▲  of a reservation (IN_USE)                │ unpin_chain to 0                ▲       │
      │                                            └────────────────────────────────┘       │
      └──────────── release_own (trim / release / dedup copy) ◀── evict (leaf run, LRU) ◀───┘

* The **free queue** is FIFO: ids ``0 .. N-1`` initially; allocation pops the head, freed blocks go
  to the tail. Eviction happens only when the queue is empty, and victims are handed out directly.
* **Evictable** runs are cached (ref 0) *leaves*: no child node is resident on this worker. The
  order is exact at block granularity: a block's key is (tick of its run, deeper first, lower
  id); a leaf run's only evictable block is its last one, and once it is gone the one before is
  next. ``evict`` takes as many tail blocks of the best run as come before the next-best run's
  key, so whole runs go in one step and the order is the per-block one.
* Heap entries are ints ``tick << 56 | (DEPTH_MAX - depth of last block) << 24 | last id`` with
  lazy invalidation: an entry is live while its run is still a cached leaf whose ``heap_key``
  equals it.

Field owners: this module writes ``Run.ref``, ``Run.tick`` and ``Run.heap_key``; the trie writes
``Run.ids``, ``Run.node``, ``Run.parent`` and ``Run.resident_children``. The store checks capacity
(``available``) before mutating anything, so nothing here fails halfway. Every method mutates the
pool unless it says it is read-only.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .radix_trie import Node, RadixTrie

_ID_BITS = 24
_DEPTH_MAX = (1 << 32) - 1
_ID_MASK = (1 << _ID_BITS) - 1
_NO_KEY = 1 << 120  # above every real key: "nothing else is evictable"


class Run:
    """One worker's copy of one trie node: block ``ids[i]`` holds the node's block ``i``."""

    __slots__ = ("ids", "node", "parent", "resident_children", "ref", "tick", "heap_key")

    def __init__(self, ids: list[int], node: Node, parent: Run | None, ref: int, tick: int):
        self.ids = ids
        self.node = node  # None once evicted or dropped
        self.parent = parent  # this worker's run of node.parent (None below a root)
        self.resident_children = 0  # child runs on this worker: while > 0 the run is no leaf
        self.ref = ref  # live reservations whose published prefix runs through this run
        self.tick = tick  # logical time of the last pin or unpin
        self.heap_key = -1  # key of its live eviction-heap entry, -1 if none

    def last_depth(self) -> int:
        node = self.node
        return node.depth + len(self.ids) - 1

    def __repr__(self) -> str:
        return f"Run({self.ids}, ref={self.ref}, tick={self.tick})"


def chain(run: Run | None) -> list[Run]:
    """The runs from the root down to ``run`` (read-only): a reservation's published prefix."""
    out = []
    while run is not None:
        out.append(run)
        run = run.parent
    out.reverse()
    return out


class BlockPool:
    """Blocks ``0 .. num_blocks-1`` of one worker: free queue, counters and eviction heap."""

    def __init__(self, num_blocks: int, worker_id: str = ""):
        if not 1 <= num_blocks <= 1 << _ID_BITS:
            raise ValueError(f"num_blocks must be in [1, 2**{_ID_BITS}]")
        self.num_blocks = num_blocks
        self.worker_id = worker_id
        self._free: deque[int] = deque(range(num_blocks))
        self.num_cached = 0  # blocks in runs with ref 0
        self.num_in_use = 0  # blocks in pinned runs + own blocks of reservations
        self._heap: list[int] = []
        self._heap_runs: dict[int, Run] = {}

    # -- read-only ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def available(self, pins_of_cached: int) -> int:
        """Blocks an allocation could obtain after pinning ``pins_of_cached`` cached blocks: free
        plus cached ones (read-only). Every cached block is evictable eventually, leaves first,
        because a pinned run's ancestors are pinned too (reservations pin whole prefixes)."""
        return len(self._free) + self.num_cached - pins_of_cached

    def free_ids(self) -> list[int]:
        """Free queue in allocation order (read-only)."""
        return list(self._free)

    def eviction_order(self) -> list[int]:
        """Last block ids of the current evictable leaf runs in the order they would go now
        (read-only; the blocks before them and the parents they expose follow later)."""
        return [k & _ID_MASK for k in sorted(k for k in self._heap if self._live(k))]

    def _live(self, key: int) -> bool:
        run = self._heap_runs.get(key)
        return run is not None and run.heap_key == key and run.ref == 0 and run.resident_children == 0

    @staticmethod
    def key_of(run: Run) -> int:
        """Eviction key of a leaf run's last block (read-only)."""
        return (run.tick << 56) | ((_DEPTH_MAX - run.last_depth()) << _ID_BITS) | run.ids[-1]

    # -- transitions -------------------------------------------------------------------------
    def take_free(self, count: int) -> list[int]:
        """Pop up to ``count`` ids from the head of the free queue (they become own blocks)."""
        free = self._free
        if count >= len(free):
            out = list(free)
            free.clear()
        else:
            popleft = free.popleft
            out = [popleft() for _ in range(count)]
        self.num_in_use += len(out)
        return out

    def take_ids(self, ids: set[int]) -> None:
        """Take these free ids out of the free queue (they become own blocks); the caller checked
        that every one is free. One pass over the queue: for a restore, not the hot path."""
        if ids:
            self._free = deque(b for b in self._free if b not in ids)
            self.num_in_use += len(ids)

    def release_own(self, ids: list[int]) -> None:
        """Own (unpublished) blocks go back to the tail of the free queue, in order."""
        self._free.extend(ids)
        self.num_in_use -= len(ids)

    def pin_chain(self, run: Run | None, tick: int) -> None:
        """Add one reference to ``run`` and every run above it (a reservation's new prefix)."""
        moved = 0
        while run is not None:
            if not run.ref:
                moved += len(run.ids)
            run.ref += 1
            run.tick = tick
            run = run.parent
        self.num_cached -= moved
        self.num_in_use += moved

    def pin_one(self, run: Run, tick: int) -> None:
        """Add one reference to ``run`` alone (its parents are pinned by the same reservation)."""
        if not run.ref:
            self.num_cached -= len(run.ids)
            self.num_in_use += len(run.ids)
        run.ref += 1
        run.tick = tick

    def unpin_chain(self, run: Run | None, tick: int) -> int:
        """Drop one reference from ``run`` and every run above it; runs reaching 0 become cached
        (evictable if leaves). Returns how many blocks were unpinned."""
        unpinned = moved = 0
        while run is not None:
            n = len(run.ids)
            unpinned += n
            run.ref -= 1
            run.tick = tick
            if not run.ref:
                moved += n
                if not run.resident_children:
                    self.push(run)
            run = run.parent
        self.num_in_use -= moved
        self.num_cached += moved
        return unpinned

    def push(self, run: Run) -> None:
        """(Re)enter a cached leaf run into the eviction heap under its current key."""
        run.heap_key = key = self.key_of(run)
        self._heap_runs[key] = run
        heap = self._heap
        heapq.heappush(heap, key)
        if len(heap) > 2 * self.num_blocks + 64:
            # Dead entries pile up under churn; rebuild from the live ones to bound memory.
            live = [k for k in heap if self._live(k)]
            heapq.heapify(live)
            self._heap = live
            self._heap_runs = {k: self._heap_runs[k] for k in live}

    def _pop_live(self) -> Run:
        heap, runs = self._heap, self._heap_runs
        heappop = heapq.heappop
        while heap:
            key = heappop(heap)
            run = runs.pop(key, None)
            if run is not None and run.heap_key == key and run.ref == 0 and run.resident_children == 0:
                run.heap_key = -1
                return run
        raise LookupError("no evictable block left")

    def _peek_live(self) -> int:
        heap, runs = self._heap, self._heap_runs
        while heap:
            key = heap[0]
            run = runs.get(key)
            if run is not None and run.heap_key == key and run.ref == 0 and run.resident_children == 0:
                return key
            heapq.heappop(heap)  # dead: its run was pinned, re-keyed, grew a child or left
            if run is not None:
                del runs[key]
                if run.heap_key == key:
                    run.heap_key = -1
        return _NO_KEY

    def evict(self, count: int, trie: RadixTrie, victims: list[int], keys: list | None) -> None:
        """Evict ``count`` cached blocks in exact LRU-leaf order into ``victims`` (then own blocks
        of the caller: in use). Their keys go to ``keys`` when events are on. The caller checked
        ``available``; running out anyway is a bug (LookupError)."""
        while count:
            run = self._pop_live()
            size = len(run.ids)
            nxt = self._peek_live()
            if run.tick < nxt >> 56:
                take = size  # older than every other leaf: the whole run goes first
            else:
                # Same tick as the next-best leaf: blocks deeper than its block go first, then at
                # equal depth the lower id (the per-block order, computed in one step).
                depth = run.last_depth()
                other = _DEPTH_MAX - ((nxt >> _ID_BITS) & _DEPTH_MAX)
                take = max(depth - other, 0)
                if take < size and run.ids[size - 1 - take] < (nxt & _ID_MASK):
                    take += 1
                take = max(take, 1)  # run's own last block is the minimum
            take = min(take, size, count)
            rest = trie.evict_tail(run, take, self.worker_id, victims, keys)
            count -= take
            self.num_cached -= take
            self.num_in_use += take
            if rest is not None:
                self.push(rest)  # a shorter leaf: its next block competes again
            else:
                parent = run.parent
                if parent is not None and not parent.resident_children and not parent.ref:
                    self.push(parent)

    # -- audit -------------------------------------------------------------------------------
    def audit(self, prefix: str, runs: list[Run], own: list[list[int]]) -> list[str]:
        """Check the pool against the runs resident on the worker and the reservations' own
        blocks (read-only): every block in exactly one place, counters right, every cached leaf
        run in the heap."""
        out: list[str] = []
        where = [0] * self.num_blocks
        for i in self._free:
            where[i] += 1
        cached = in_use = 0
        for run in runs:
            for i in run.ids:
                where[i] += 1
            if run.ref:
                in_use += len(run.ids)
            else:
                cached += len(run.ids)
        for ids in own:
            in_use += len(ids)
            for i in ids:
                where[i] += 1
        lost = [i for i, n in enumerate(where) if n != 1]
        if lost:
            out.append(f"{prefix}: blocks {lost[:8]} are held {[where[i] for i in lost[:8]]} times (free/run/own)")
        if cached != self.num_cached or in_use != self.num_in_use:
            out.append(
                f"{prefix}: counters cached={self.num_cached} in_use={self.num_in_use} but runs and "
                f"reservations hold cached={cached} in_use={in_use}"
            )
        if self.num_free + self.num_cached + self.num_in_use != self.num_blocks:
            out.append(f"{prefix}: free + cached + in_use != {self.num_blocks}")
        live = {self._heap_runs[k].ids[-1] for k in self._heap if self._live(k)}
        leaves = {r.ids[-1] for r in runs if not r.ref and not r.resident_children}
        if live != leaves:
            out.append(f"{prefix}: evictable leaf runs end in {sorted(leaves)} but live heap entries {sorted(live)}")
        for run in runs:
            if run.heap_key >= 0 and self._live(run.heap_key) and run.heap_key != self.key_of(run):
                out.append(f"{prefix}: run ending in {run.ids[-1]} sits in the heap under a stale key")
        return out
