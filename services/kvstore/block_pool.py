"""One worker's pool of paired blocks: block states, the free queue and the eviction order.

Block ``b`` names page ``b`` of the worker's target KV pool *and* page ``b`` of its draft KV pool,
so the two pools cannot disagree about which prefix they hold. Every block is in exactly one state::

        allocate                pin (reuse / dedup)
    FREE ─────────▶ IN_USE ◀───────────────────── CACHED
      ▲  unpin to 0,               │  unpin to 0,           │
      │  unpublished               └──── published ────────▶│
      └─────────────────────────────────────────────────────┘ evict (leaf, LRU)

* The **free queue** is FIFO: ids ``0 .. N-1`` initially, allocation pops the head, freed blocks go
  to the tail. Only this class touches it. Eviction happens only when the queue is empty, and the
  victim is handed out directly.
* **Evictable** blocks are cached (published, ref 0) *leaves*: a block whose trie node has children
  resident on this worker is pinned by them. Order: least recently used on the store's logical
  clock, then deeper first, then lower block id. They sit in a heap of integer keys with lazy
  invalidation: an entry is live only while the block is still a cached leaf whose ``heap_key``
  equals it.

All methods mutate the pool unless they say otherwise. The store checks capacity
(``available_for``) *before* mutating anything, so these calls never fail halfway.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .radix_trie import Node

# Heap key = tick << 56 | (DEPTH_MAX - depth) << 24 | block_id: one int compare orders entries
# by (LRU tick, deeper first, lower id). num_blocks <= 2**24 is enforced at registration.
_ID_BITS = 24
_DEPTH_MAX = (1 << 32) - 1
_ID_MASK = (1 << _ID_BITS) - 1


class BlockState(enum.IntEnum):
    FREE = 0
    CACHED = 1  # published, unreferenced: evictable once it is a leaf
    IN_USE = 2  # referenced by at least one live reservation


_FREE, _CACHED, _IN_USE = BlockState.FREE, BlockState.CACHED, BlockState.IN_USE


class Block:
    """One paired block (target page + draft page with the same id)."""

    __slots__ = ("block_id", "state", "ref_count", "node", "parent", "last_used", "resident_children", "heap_key")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.state = _FREE
        self.ref_count = 0
        self.node: Node | None = None  # trie node it holds (published blocks only)
        self.parent: Block | None = None  # block holding node.parent here (meaningful while node is set)
        self.last_used = 0  # logical tick of the last pin/unpin
        self.resident_children = 0  # children of ``node`` resident on this worker (pin the block)
        self.heap_key = -1  # key of its live eviction-heap entry, -1 if none

    def __repr__(self) -> str:
        return f"Block({self.block_id}, {self.state.name}, ref={self.ref_count})"


class BlockPool:
    """Blocks ``0 .. num_blocks-1`` of one worker with their counters."""

    def __init__(self, num_blocks: int):
        if not 1 <= num_blocks <= 1 << _ID_BITS:
            raise ValueError(f"num_blocks must be in [1, 2**{_ID_BITS}]")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[Block] = deque(self.blocks)
        self.num_cached = 0
        self.num_in_use = 0
        self._heap: list[int] = []

    # -- read-only ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def available_for(self, pins_of_cached: int) -> int:
        """Blocks an allocation could obtain after pinning ``pins_of_cached`` cached blocks: free
        plus cached ones (read-only). Every cached block is evictable eventually, leaves first,
        because a pinned block's ancestors are pinned too (reservations pin whole prefixes)."""
        return len(self._free) + self.num_cached - pins_of_cached

    def free_ids(self) -> list[int]:
        """Free queue in allocation order (read-only; for tests and audits)."""
        return [b.block_id for b in self._free]

    @staticmethod
    def is_evictable(block: Block) -> bool:
        return block.state is _CACHED and block.resident_children == 0

    def eviction_order(self) -> list[int]:
        """Ids of the current evictable leaves in the order they would go now (read-only; the
        parents they expose would follow later)."""
        return [key & _ID_MASK for key in sorted(k for k in self._heap if self._live(k))]

    def _live(self, key: int) -> bool:
        block = self.blocks[key & _ID_MASK]
        return block.heap_key == key and block.state is _CACHED and block.resident_children == 0

    # -- transitions -------------------------------------------------------------------------
    def allocate(self, count: int, evicted: list[Node] | None = None) -> list[Block]:
        """Hand out ``count`` blocks (-> IN_USE, one reference each): the free queue's head
        first; once it is empty, LRU leaves are evicted, so the victims are the last
        ``len(evicted)`` blocks returned, in eviction order. Each victim's trie node is appended
        to ``evicted`` and its ``node`` cleared: the caller must then drop those nodes' residency
        on this worker (in that order, deepest first). The caller has checked ``available_for``;
        running out anyway is a bug (LookupError)."""
        free, heap, blocks = self._free, self._heap, self.blocks
        take = min(count, len(free))
        out = [free.popleft() for _ in range(take)]
        for block in out:
            block.state = _IN_USE
            block.ref_count = 1
        if take < count:
            if evicted is None:
                evicted = []
            append_node, append = evicted.append, out.append
            heappop, heappushpop = heapq.heappop, heapq.heappushpop
            # A parent exposed by an eviction is usually the next victim: keep its key aside and
            # let heappushpop return it without a round trip through the heap.
            pending = -1
            for _ in range(count - take):
                while True:
                    if pending >= 0:
                        key = heappushpop(heap, pending)
                        pending = -1
                    elif heap:
                        key = heappop(heap)
                    else:
                        raise LookupError("no evictable block left")
                    block = blocks[key & _ID_MASK]
                    if block.heap_key == key and block.state is _CACHED and block.resident_children == 0:
                        break
                append_node(block.node)
                block.node = None
                block.heap_key = -1
                block.state = _IN_USE
                block.ref_count = 1
                append(block)
                parent = block.parent
                if parent is not None:
                    left = parent.resident_children = parent.resident_children - 1
                    if left == 0 and parent.state is _CACHED:
                        pending = parent.heap_key = (
                            (parent.last_used << 56) | ((_DEPTH_MAX - parent.node.depth) << _ID_BITS) | parent.block_id
                        )  # == self._key(parent), inlined: this is the eviction hot loop
            if pending >= 0:
                self._push_key(pending)
            self.num_cached -= count - take
        self.num_in_use += count
        return out

    def pin(self, block: Block, tick: int) -> None:
        """Add a reference to a published block (CACHED -> IN_USE on the first one)."""
        self.pin_many((block,), tick)

    def pin_many(self, blocks, tick: int) -> None:
        """Add a reference to each published block (one call per prefix: Reserve's hot path)."""
        moved = 0
        for block in blocks:
            if block.state is _CACHED:
                block.state = _IN_USE
                moved += 1
            block.ref_count += 1
            block.last_used = tick
        self.num_cached -= moved
        self.num_in_use += moved

    def unpin_many(self, blocks, tick: int) -> int:
        """Drop one reference from each block. At zero, a published block becomes CACHED
        (evictable if a leaf) and an unpublished one FREE (tail of the free queue, in the given
        order). Returns how many were freed."""
        released = freed = 0
        free = self._free
        for block in blocks:
            block.ref_count -= 1
            block.last_used = tick
            if block.ref_count:
                continue
            released += 1
            if block.node is None:
                block.state = _FREE
                free.append(block)
                freed += 1
            else:
                block.state = _CACHED
                if block.resident_children == 0:
                    self._push(block)
        self.num_in_use -= released
        self.num_cached += released - freed
        return freed

    def chain_published(self, parent: Block | None, blocks) -> None:
        """``blocks`` now hold a chain of trie nodes below ``parent``'s node (None: below the
        root): link each to its parent block and count it as a resident child there (a parent
        is no longer a leaf; any heap entry of it dies by the live-check)."""
        for block in blocks:
            block.parent = parent
            if parent is not None:
                parent.resident_children += 1
            parent = block

    @staticmethod
    def _key(block: Block) -> int:
        return (block.last_used << 56) | ((_DEPTH_MAX - block.node.depth) << _ID_BITS) | block.block_id

    def _push(self, block: Block) -> None:
        block.heap_key = key = self._key(block)
        self._push_key(key)

    def _push_key(self, key: int) -> None:
        heap = self._heap
        heapq.heappush(heap, key)
        if len(heap) > 2 * self.num_blocks + 64:
            # Dead entries pile up under churn; rebuild from the live ones to bound memory.
            self._heap = [k for k in heap if self._live(k)]
            heapq.heapify(self._heap)

    # -- audit -------------------------------------------------------------------------------
    def audit(self, prefix: str) -> list[str]:
        """Check the pool's own bookkeeping (read-only): counters match states, the free queue
        holds exactly the free blocks once each, and every evictable leaf has a live heap entry."""
        out: list[str] = []
        by_state = {s: 0 for s in BlockState}
        for b in self.blocks:
            by_state[b.state] += 1
            if b.state is _FREE and (b.ref_count or b.node is not None):
                out.append(f"{prefix}: free block {b.block_id} has ref {b.ref_count} / node")
            if b.state is _CACHED and (b.ref_count or b.node is None):
                out.append(f"{prefix}: cached block {b.block_id} has ref {b.ref_count} / no node")
            if b.state is _IN_USE and b.ref_count < 1:
                out.append(f"{prefix}: in-use block {b.block_id} has ref {b.ref_count}")
        free_ids = [b.block_id for b in self._free]
        if len(set(free_ids)) != len(free_ids):
            out.append(f"{prefix}: free queue holds a block twice")
        if any(self.blocks[i].state is not _FREE for i in free_ids):
            out.append(f"{prefix}: free queue holds a non-free block")
        if len(free_ids) != by_state[_FREE]:
            out.append(f"{prefix}: {by_state[_FREE]} free blocks but queue of {len(free_ids)}")
        if by_state[_CACHED] != self.num_cached or by_state[_IN_USE] != self.num_in_use:
            out.append(
                f"{prefix}: counters cached={self.num_cached} in_use={self.num_in_use} but states "
                f"cached={by_state[_CACHED]} in_use={by_state[_IN_USE]}"
            )
        if self.num_free + self.num_cached + self.num_in_use != self.num_blocks:
            out.append(f"{prefix}: free + cached + in_use != {self.num_blocks}")
        live = {k & _ID_MASK for k in self._heap if self._live(k)}
        leaves = {b.block_id for b in self.blocks if self.is_evictable(b)}
        if live != leaves:
            out.append(f"{prefix}: evictable leaves {sorted(leaves)} but live heap entries {sorted(live)}")
        return out
