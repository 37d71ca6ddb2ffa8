"""The store's mutable records of live workers and live reservations (internal to the package).

A reservation's block table covers its capacity; the leading ``published`` blocks are the runs from
the root down to ``last`` (shared, read-only, pinned once by this reservation), the rest are its
``own`` unpublished blocks::

    block_size 4, D = 1, prompt n = 11, headroom 3  ->  capacity 14, rounded up to 16 positions
    positions   0..3    4..7  |  8..11   12..15
    blocks      [ 7 ]   [ 2 ] |  [ 9 ]   [ 4 ]
                published     |  own (prompt tail + headroom)
                (reused here)    key stream: 10 keyed positions -> 2 keyed blocks; cap 2 blocks

Records are only ever touched by ``store.KVStore``; callers see ``types.Reservation`` snapshots.
"""

from __future__ import annotations

from services.common.spec import lookahead_span

from .block_pool import BlockPool, Run, chain
from .keys import KeyStream, Namespace
from .types import PoolUsage, Reservation, WorkerSpec


class WorkerRecord:
    """One incarnation of a worker: its spec, lease, pool, reservations and counters."""

    __slots__ = (
        "spec", "incarnation", "span", "pool", "lease_deadline", "reservations",
        "requested_positions", "reused_positions", "evictions", "published_blocks",
        "deduplicated_blocks", "_namespaces", "ending",
    )

    def __init__(self, spec: WorkerSpec, incarnation: int, lease_deadline: float):
        self.spec = spec
        self.incarnation = incarnation
        self.span = lookahead_span(spec.spec_mode, spec.mtp_depth)
        self.pool = BlockPool(spec.num_blocks, spec.worker_id)
        self.lease_deadline = lease_deadline
        self.reservations: dict[str, ReservationRecord] = {}
        # Ended by someone other than this worker: blocks still held until it confirms (or its
        # lease lapses), because its GPU may still be writing them (two-phase end).
        self.ending: dict[str, ReservationRecord] = {}
        self.requested_positions = 0
        self.reused_positions = 0
        self.evictions = 0
        self.published_blocks = 0
        self.deduplicated_blocks = 0
        self._namespaces: dict[bytes, Namespace] = {}  # memo of ``namespace`` by cache salt

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    def namespace(self, cache_salt: bytes) -> Namespace:
        """The worker's namespace under ``cache_salt`` (read-only apart from a small memo: Match
        and Reserve ask on every call, for the trie's root lookup)."""
        memo = self._namespaces
        namespace = memo.get(cache_salt)
        if namespace is None:
            if len(memo) >= 64:  # salts come from tenants: keep the memo bounded
                memo.clear()
            spec = self.spec
            namespace = memo[cache_salt] = Namespace(spec.model_id, spec.block_size, spec.spec_mode, self.span, cache_salt)
        return namespace

    def usage(self) -> PoolUsage:
        pool = self.pool
        return PoolUsage(pool.num_blocks, pool.num_free, pool.num_cached, pool.num_in_use)


class ReservationRecord:
    """A live reservation: its token sequence (as a key stream), block table and namespace."""

    __slots__ = (
        "reservation_id", "request_id", "worker", "stream", "prompt", "cache_salt",
        "headroom", "namespace", "last", "own", "published", "reused_positions",
    )

    def __init__(
        self,
        reservation_id: str,
        request_id: str,
        worker: WorkerRecord,
        stream: KeyStream,
        cache_salt: bytes,
        headroom: int,
        last: Run | None,
        own: list[int],
        reused_blocks: int,
    ):
        self.reservation_id = reservation_id
        self.request_id = request_id
        self.worker = worker
        self.stream = stream  # prompt + tokens appended since; grows with generation
        self.prompt = stream.buf  # kept to recognise an idempotent Reserve retry
        self.cache_salt = cache_salt
        self.headroom = headroom
        self.namespace = worker.namespace(cache_salt)
        self.last = last  # deepest pinned run: the published prefix is chain(last)
        self.own = own  # unpublished blocks, in table order
        self.published = reused_blocks  # blocks in chain(last)
        self.reused_positions = reused_blocks * worker.spec.block_size

    @property
    def capacity_positions(self) -> int:
        return (self.published + len(self.own)) * self.worker.spec.block_size

    def block_table(self) -> tuple[int, ...]:
        """Block ids in position order (read-only)."""
        table: list[int] = []
        for run in chain(self.last):
            table += run.ids
        table += self.own
        return tuple(table)

    def snapshot(self) -> Reservation:
        return Reservation(
            reservation_id=self.reservation_id,
            request_id=self.request_id,
            worker_id=self.worker.worker_id,
            incarnation=self.worker.incarnation,
            block_table=self.block_table(),
            reused_positions=self.reused_positions,
            capacity_positions=self.capacity_positions,
            published_blocks=self.published,
            num_tokens=self.stream.n,
        )
