"""One worker's pool of paired blocks: block states, the free queue and the eviction order.

Block ``b`` names page ``b`` of the worker's target KV pool *and* page ``b`` of its draft KV pool,
so the two pools cannot disagree about which prefix they hold. Every block is in exactly one state::

        allocate                pin (reuse / dedup)
    FREE ─────────▶ IN_USE ◀───────────────────── CACHED
      ▲  free (unpublished,        │  unpin to ref 0,       │
      │  ref 0)                    │  published             │
      └────────────────────────────┴────────────────────────┘ evict (leaf, LRU)

* The **free queue** is FIFO: ids ``0 .. N-1`` initially, allocation pops the head, freed blocks go
  to the tail. Only this class touches it.
* **Evictable** blocks are cached (published, ref 0) *leaves*: a block whose trie node has children
  resident on this worker is pinned by them. They are ordered by last use on the store's logical
  clock, then deeper first, then lower block id, in a heap with lazy invalidation (an entry is live
  only while the block is still a cached leaf and its ``evict_epoch`` matches).

All methods mutate the pool unless they say otherwise; the store checks capacity
(``available_for``) *before* mutating anything, so these calls never fail halfway.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .radix_trie import Node


class BlockState(enum.IntEnum):
    FREE = 0
    CACHED = 1  # published, unreferenced: evictable once it is a leaf
    IN_USE = 2  # referenced by at least one live reservation


@dataclass(slots=True, eq=False)
class Block:
    """One paired block (target page + draft page with the same id)."""

    block_id: int
    state: BlockState = BlockState.FREE
    ref_count: int = 0
    node: Node | None = None  # trie node it holds (published blocks only)
    last_used: int = 0  # logical tick of the last pin/unpin
    resident_children: int = 0  # children of ``node`` resident on this worker (pin the block)
    evict_epoch: int = 0  # generation of its live heap entry


class BlockPool:
    """Blocks ``0 .. num_blocks-1`` of one worker with their counters."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[Block] = deque(self.blocks)
        self.num_cached = 0
        self.num_in_use = 0
        self._heap: list[tuple[int, int, int, int]] = []  # (last_used, -depth, block_id, epoch)

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

    def is_evictable(self, block: Block) -> bool:
        return block.state is BlockState.CACHED and block.resident_children == 0

    def eviction_order(self) -> list[int]:
        """Ids of the current evictable leaves in the order they would go (read-only)."""
        live = [e for e in self._heap if self._entry_live(e)]
        return [e[2] for e in sorted(live)]

    def _entry_live(self, entry: tuple[int, int, int, int]) -> bool:
        block = self.blocks[entry[2]]
        return (
            block.state is BlockState.CACHED
            and block.resident_children == 0
            and block.evict_epoch == entry[3]
        )

    # -- transitions -------------------------------------------------------------------------
    def allocate_free(self) -> Block:
        """Pop the head of the free queue: FREE -> IN_USE with one reference."""
        block = self._free.popleft()
        block.state = BlockState.IN_USE
        block.ref_count = 1
        self.num_in_use += 1
        return block

    def pop_eviction_victim(self) -> Block:
        """Remove and return the LRU evictable leaf (still CACHED; the caller detaches it from the
        trie and then calls ``free_cached``). Raises ``LookupError`` if none is evictable."""
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)
            if self._entry_live(entry):
                block = self.blocks[entry[2]]
                block.evict_epoch += 1  # its entry is consumed
                return block
        raise LookupError("no evictable block")

    def pin(self, block: Block, tick: int) -> None:
        """Add a reference to a published block (CACHED -> IN_USE on the first one)."""
        if block.state is BlockState.CACHED:
            block.state = BlockState.IN_USE
            self.num_cached -= 1
            self.num_in_use += 1
        block.ref_count += 1
        block.last_used = tick

    def unpin(self, block: Block, tick: int) -> bool:
        """Drop a reference. At zero, a published block becomes CACHED (evictable if a leaf) and
        an unpublished one FREE (tail of the free queue). Returns True if the block was freed."""
        block.ref_count -= 1
        block.last_used = tick
        if block.ref_count:
            return False
        self.num_in_use -= 1
        if block.node is None:
            block.state = BlockState.FREE
            self._free.append(block)
            return True
        block.state = BlockState.CACHED
        self.num_cached += 1
        if block.resident_children == 0:
            self._push(block)
        return False

    def free_cached(self, block: Block) -> None:
        """CACHED -> FREE for a victim the caller has detached from the trie (``node is None``)."""
        block.state = BlockState.FREE
        block.last_used = 0
        self.num_cached -= 1
        self._free.append(block)

    def child_added(self, block: Block) -> None:
        """A child of ``block.node`` became resident here: the block is no longer a leaf."""
        block.resident_children += 1  # any heap entry dies by the live-check

    def child_removed(self, block: Block) -> None:
        """A child of ``block.node`` left this worker: at zero children a cached block is a leaf."""
        block.resident_children -= 1
        if block.resident_children == 0 and block.state is BlockState.CACHED:
            self._push(block)

    def _push(self, block: Block) -> None:
        block.evict_epoch += 1
        heapq.heappush(self._heap, (block.last_used, -block.node.depth, block.block_id, block.evict_epoch))
        if len(self._heap) > 2 * self.num_blocks + 64:
            # Dead entries pile up under churn; rebuild from the live ones to bound memory.
            self._heap = [e for e in self._heap if self._entry_live(e)]
            heapq.heapify(self._heap)

    # -- audit -------------------------------------------------------------------------------
    def audit(self, prefix: str) -> list[str]:
        """Check the pool's own bookkeeping (read-only): counters match states, the free queue
        holds exactly the free blocks once each, and every evictable leaf has a live heap entry."""
        out: list[str] = []
        by_state = {s: 0 for s in BlockState}
        for b in self.blocks:
            by_state[b.state] += 1
            if b.state is BlockState.FREE and (b.ref_count or b.node is not None):
                out.append(f"{prefix}: free block {b.block_id} has ref {b.ref_count} / node")
            if b.state is BlockState.CACHED and (b.ref_count or b.node is None):
                out.append(f"{prefix}: cached block {b.block_id} has ref {b.ref_count} / no node")
            if b.state is BlockState.IN_USE and b.ref_count < 1:
                out.append(f"{prefix}: in-use block {b.block_id} has ref {b.ref_count}")
        free_ids = [b.block_id for b in self._free]
        if len(set(free_ids)) != len(free_ids):
            out.append(f"{prefix}: free queue holds a block twice")
        if any(self.blocks[i].state is not BlockState.FREE for i in free_ids):
            out.append(f"{prefix}: free queue holds a non-free block")
        if len(free_ids) != by_state[BlockState.FREE]:
            out.append(f"{prefix}: {by_state[BlockState.FREE]} free blocks but queue of {len(free_ids)}")
        if by_state[BlockState.CACHED] != self.num_cached or by_state[BlockState.IN_USE] != self.num_in_use:
            out.append(
                f"{prefix}: counters cached={self.num_cached} in_use={self.num_in_use} but states "
                f"cached={by_state[BlockState.CACHED]} in_use={by_state[BlockState.IN_USE]}"
            )
        if self.num_free + self.num_cached + self.num_in_use != self.num_blocks:
            out.append(f"{prefix}: free + cached + in_use != {self.num_blocks}")
        live = {e[2] for e in self._heap if self._entry_live(e)}
        leaves = {b.block_id for b in self.blocks if self.is_evictable(b)}
        if live != leaves:
            out.append(f"{prefix}: evictable leaves {sorted(leaves)} but live heap entries {sorted(live)}")
        return out
