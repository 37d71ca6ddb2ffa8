"""Where the engine gets KV capacity from: the ``BlockSource`` protocol and a local allocator.

The engine never allocates block ids itself. Before a step it asks, in ONE batched call, for the
capacity that step will write (``extend``); after the step has completed it gives back, in ONE
batched call, whole blocks that hold only rejected draft positions and are not needed next step
(``trim``). The worker service implements the protocol with kvstore ``Extend``/``Trim`` RPCs;
``LocalBlockSource`` implements it in-process for tests and demos.

Capacity is counted in positions and always a whole number of blocks::

    logical length (accepted tokens)      reserved capacity = len(table) * block_size
    |<--------------- L --------------->|<-- draft/verify headroom -->|
    [ blk 7 ][ blk 2 ][ blk 9 ][ blk 4  ][ blk 11 ]
                                           ^ trim(keep=L) frees this once the step that wrote
                                             it has completed
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from services.common.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from services.gpuworker.engine.fence import COMPLETE, StepFence


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks needed to hold ``positions`` positions (ceil division)."""
    return -(-positions // block_size)


@runtime_checkable
class BlockSource(Protocol):
    """Capacity provider for the engine (request id → capacity in positions → new block table).

    * ``extend(wants)``: grow each listed request to at least ``wants[rid]`` positions. Each item
      is atomic: the answer per request is its full new block table (old blocks first, unchanged)
      or the exception that item failed with (``ResourceExhausted``, ``NotFound``); a failed item
      changes nothing. Mutates the source's allocation state.
    * ``trim(keeps, after=fence)``: shrink each listed request to ``ceil(keeps[rid] / block_size)``
      blocks, freeing the tail once ``after`` (the fence of the step that last wrote them,
      ``fence.py``) has completed; returns the new tables, or nothing when the trim is sent
      asynchronously (the engine then cuts its tables as asked). Mutates the allocation state.
    """

    def extend(self, wants: dict[str, int]) -> dict[str, list[int] | Exception]: ...

    def trim(self, keeps: dict[str, int], *, after: StepFence = COMPLETE) -> dict[str, list[int]]: ...


class LocalBlockSource:
    """A simple in-process allocator of paired block ids, for tests and demos.

    Blocks are refcounted so a second request can share the first blocks of an earlier one (prefix
    reuse). Every table the engine receives comes from here, and ``owner`` lets a test verify that a
    table the engine uses is exactly the one handed out. Not thread-safe.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise InvalidArgument("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._refs = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self.extend_calls: list[dict[str, int]] = []
        self.trim_calls: list[dict[str, int]] = []

    # -- reservations (what the router + kvstore do in production) ------------------------------

    def reserve(self, request_id: str, positions: int, prefix_blocks: Iterable[int] = ()) -> list[int]:
        """Create a reservation: share ``prefix_blocks`` (refcount +1) and allocate fresh blocks up
        to ``positions`` capacity. Atomic. Returns the table (a copy). Mutates."""
        if request_id in self._tables:
            raise AlreadyExists(f"request {request_id!r} already has a reservation")
        prefix = list(prefix_blocks)
        for b in prefix:
            if not 0 <= b < self.num_blocks or self._refs[b] == 0:
                raise InvalidArgument(f"prefix block {b} is not a live block")
        fresh = max(0, blocks_for(positions, self.block_size) - len(prefix))
        if fresh > len(self._free):
            raise ResourceExhausted(f"need {fresh} free blocks, have {len(self._free)}")
        for b in prefix:
            self._refs[b] += 1
        table = prefix + [self._take() for _ in range(fresh)]
        self._tables[request_id] = table
        return list(table)

    def release(self, request_id: str) -> None:
        """End a reservation: drop one reference from each of its blocks. Mutates."""
        table = self._tables.pop(request_id, None)
        if table is None:
            raise NotFound(f"unknown request {request_id!r}")
        for b in table:
            self._unref(b)

    def remap(self, request_id: str, table: list[int]) -> list[int]:
        """Swap blocks of a reservation for other live blocks (what kvstore ``Publish`` dedup
        does): references move from the old ids to the new ones. Mutates."""
        old = self._tables.get(request_id)
        if old is None:
            raise NotFound(f"unknown request {request_id!r}")
        if len(table) != len(old) or any(not 0 <= b < self.num_blocks or self._refs[b] == 0 for b in table):
            raise InvalidArgument("remap needs a table of the same length over live blocks")
        for b in table:
            self._refs[b] += 1
        for b in old:
            self._unref(b)
        self._tables[request_id] = list(table)
        return list(table)

    # -- the BlockSource protocol ---------------------------------------------------------------

    def extend(self, wants: dict[str, int]) -> dict[str, list[int] | Exception]:
        self.extend_calls.append(dict(wants))
        out: dict[str, list[int] | Exception] = {}
        for rid, positions in wants.items():
            table = self._tables.get(rid)
            if table is None:
                out[rid] = NotFound(f"unknown request {rid!r}")
                continue
            missing = blocks_for(positions, self.block_size) - len(table)
            if missing > len(self._free):
                out[rid] = ResourceExhausted(f"{rid}: need {missing} more blocks, {len(self._free)} free")
                continue
            for _ in range(max(0, missing)):
                table.append(self._take())
            out[rid] = list(table)
        return out

    def trim(self, keeps: dict[str, int], *, after: StepFence = COMPLETE) -> dict[str, list[int]]:
        # in-process and synchronous: free only what the device has finished with; on the
        # engine thread, which must not sleep past the step's end (step fences are blocking)
        after.wait_polling()
        self.trim_calls.append(dict(keeps))
        out: dict[str, list[int]] = {}
        for rid, positions in keeps.items():
            table = self._tables.get(rid)
            if table is None:
                raise NotFound(f"unknown request {rid!r}")
            keep = blocks_for(max(positions, 0), self.block_size)
            while len(table) > keep:
                self._unref(table.pop())
            out[rid] = list(table)
        return out

    # -- inspection -----------------------------------------------------------------------------

    def table(self, request_id: str) -> list[int]:
        if request_id not in self._tables:
            raise NotFound(f"unknown request {request_id!r}")
        return list(self._tables[request_id])

    def owner(self, table: list[int], kv_len: int = 0) -> str:
        """The request whose live table is exactly ``table``; raises ``InvalidArgument`` when
        there is none or ``kv_len`` positions do not fit in it. Read-only (tests call it on every
        table the engine plans with, so an overrun or a stale table cannot go unnoticed)."""
        for rid, t in self._tables.items():
            if t == table:
                if kv_len > len(t) * self.block_size:
                    raise InvalidArgument(f"{rid}: kv_len {kv_len} overruns capacity {len(t) * self.block_size}")
                return rid
        raise InvalidArgument(f"table {table} is not a live reservation's table")

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def refcount(self, block_id: int) -> int:
        return self._refs[block_id]

    def _take(self) -> int:
        b = self._free.pop()
        self._refs[b] = 1
        return b

    def _unref(self, b: int) -> None:
        self._refs[b] -= 1
        if self._refs[b] == 0:
            self._free.append(b)
