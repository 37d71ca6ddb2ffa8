"""The kvstore facade: every transaction verb of DESIGN §2 over per-worker pools and one trie.

``KVStore`` is synchronous and single-threaded (the servicer serializes calls). Every verb first
drops workers whose lease lapsed, then validates *everything* (raising a typed error having
changed nothing), and only then mutates; the mutation phase cannot fail. Extend and Trim apply
this per item. Mutating verbs advance a logical clock (``tick``) that orders eviction (LRU).

Lifecycle of one request on worker w::

    Match ──▶ Reserve ──▶ (Extend | Trim | Publish)* ──▶ Release | Suspend | Abort
     read     pin the reusable prefix,     grow / shrink capacity,      end: unpin, free own
     only     allocate the rest            publish final full blocks    blocks (Abort: publish
                                                                        nothing new)

Ended reservation ids are remembered (bounded ``tombstones``) so Abort is idempotent and late
calls get FAILED_PRECONDITION rather than NOT_FOUND.

Who may end a reservation (two-phase end, DESIGN §2): the owning worker (``worker_id`` given and
equal to the reservation's) ends it at once — it calls only after the GPU step that last wrote the
blocks completed. Anyone else (``worker_id`` None: the router) only *marks it ended*: it stops
being live (no Extend/Publish; its request id is free again) but its blocks stay held, listed by
:meth:`ending_for` until the worker confirms (Abort or Release) or its lease lapses::

    live ──Abort(router)──▶ ending ──Abort/Release(owner) or lease lapse──▶ gone (blocks freed)
      └────────Abort/Release(owner)──────────────────────────────────────▶ gone

Verbs that act on a reservation take ``worker_id`` (the authenticated caller, when it is a
worker): a reservation of another worker is PermissionDenied. None = not checked (insecure mode,
or a router). Reservation ids are 128 random bits: knowing one is the capability to name it.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from collections import OrderedDict
from typing import Callable

from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TandemError,
)

from . import audit, validation
from .block_pool import Run, chain
from .events import MAX_BLOCKS_PER_EVENT, EventLog
from .keys import KeyStream
from .radix_trie import Node, RadixTrie, common_blocks
from .records import ReservationRecord, WorkerRecord
from .types import (
    Event,
    EventKind,
    ExtendItem,
    HeldReservation,
    HeldSequence,
    ItemResult,
    MatchResult,
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
from .view import StoreView


class KVStore:
    """The kvstore core. See the module docstring; each verb's docstring says if it mutates."""

    def __init__(
        self,
        *,
        lease_ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        max_tokens: int = 1 << 20,
        tombstones: int = 65536,
        events_per_worker: int = 0,
        max_blocks_per_event: int = MAX_BLOCKS_PER_EVENT,
        epoch: int | None = None,
        max_num_blocks: int = validation.MAX_BLOCKS_PER_WORKER,
        max_items: int = validation.MAX_ITEMS_PER_CALL,
        new_id: Callable[[], str] | None = None,
        max_workers: int = 1024,
    ):
        """``epoch`` tells this store's life apart from earlier ones (default: wall-clock µs):
        incarnations count up from ``epoch + 1`` and reservation ids embed it, so ids handed out
        by a previous, non-durable store are never mistaken for live ones. Block events are
        opt-in: ``events_per_worker`` > 0 buffers that many per worker and makes the trie keep
        every block's 256-bit key (hashed at publish); 0 records none and hashes nothing. Larger
        publishes and evictions are cut into events of at most ``max_blocks_per_event`` blocks."""
        if not lease_ttl_s > 0:
            raise InvalidArgument("lease_ttl_s must be > 0")
        self.lease_ttl_s = float(lease_ttl_s)
        self.max_tokens = validation.count("max_tokens", max_tokens, minimum=1)
        self._clock = clock
        self._max_tombstones = validation.count("tombstones", tombstones)
        self.epoch = time.time_ns() // 1000 if epoch is None else validation.count("epoch", epoch)
        self._workers: dict[str, WorkerRecord] = {}
        self._events = EventLog(
            validation.count("events_per_worker", events_per_worker),
            validation.count("max_blocks_per_event", max_blocks_per_event, minimum=1),
        )
        self._trie = RadixTrie(keyed=self._events.enabled)
        self._reservations: dict[str, ReservationRecord] = {}
        self._ending: dict[str, ReservationRecord] = {}  # see "two-phase end" above
        self.max_num_blocks = validation.count("max_num_blocks", max_num_blocks, minimum=1)
        # 128 random bits per reservation id: unguessable. Tests that replay runs inject a counter.
        self._new_id = new_id or (lambda: "r-" + secrets.token_hex(16))
        self.max_items = validation.count("max_items", max_items, minimum=1)
        self.max_workers = validation.count("max_workers", max_workers, minimum=1)  # bounds Match replies
        self._by_request: dict[str, ReservationRecord] = {}
        self._tombstones: OrderedDict[str, tuple[str, int]] = OrderedDict()  # id -> (worker, incarnation)
        self._last_incarnation = self.epoch
        self._next_lapse = math.inf  # no lease can lapse before this journal time (expire_leases)
        self.tick = 0
        self._matches = 0
        self._reservations_created = 0

    # ---------------------------------------------------------------------------------- registry
    def register_worker(self, spec: WorkerSpec) -> WorkerInfo:
        """Create or replace a worker's pool (mutates). A previous incarnation's blocks,
        reservations and trie residency are dropped (CLEARED event). Returns the new incarnation."""
        self.expire_leases()
        spec = validation.worker_spec(spec, self.max_num_blocks)
        old = self._workers.get(spec.worker_id)
        if old is None and len(self._workers) >= self.max_workers:
            raise ResourceExhausted(f"the kvstore holds its limit of {self.max_workers} workers")
        self.tick += 1
        if old is not None:
            self._drop_worker(old)
        self._last_incarnation += 1
        worker = WorkerRecord(spec, self._last_incarnation, self._clock() + self.lease_ttl_s)
        self._workers[spec.worker_id] = worker
        self._next_lapse = min(self._next_lapse, worker.lease_deadline)
        self._events.flush()
        return self._info(worker)

    def restore_worker(self, spec: WorkerSpec, reservations=(), cached=()) -> RestoreResult:
        """Register a new incarnation of a worker that outlived the kvstore's memory (a restart
        of the memory backend, or a lapsed lease) and re-create what it still holds (mutates):
        ``reservations`` (:class:`HeldReservation`, the requests it runs, under their ids, now
        tied to the new incarnation) and ``cached`` (:class:`HeldSequence`, published blocks
        whose content it still holds), so running streams go on and the cache is rebuilt from
        the worker. The worker alone knows what its pages hold; the store only refuses what
        would break its own rules: every id is in range, a block lands in exactly one place
        (one reservation's own blocks, or one trie run), and a key already resident on the
        worker under another id stays as it is (a reservation's copy is then deduplicated as
        Publish does, which the worker adopts from ``restored``; a cached copy is left free).
        Registration is the transaction; each reservation is restored whole or dropped (with
        why), each sequence up to its first block that cannot be taken. Calls of the previous
        incarnation stay stale (DESIGN §2): only the new incarnation names these reservations;
        until the worker re-registered they are unknown (NOT_FOUND), and the worker resends them
        (``kvstore_courier``)."""
        reservations, cached = list(reservations), list(cached)
        if len(reservations) > self.max_items or len(cached) > self.max_items:
            raise InvalidArgument(f"restore_worker takes at most {self.max_items} reservations and sequences")
        info = self.register_worker(spec)
        worker = self._workers[info.worker_id]
        free = set(worker.pool.free_ids())
        restored: list[Reservation] = []
        dropped: list[tuple[str, str]] = []
        for held in reservations:
            rid = getattr(held, "reservation_id", None)
            try:
                record = self._restore_reservation(worker, held, free)
            except TandemError as err:
                dropped.append((str(rid)[: validation.MAX_ID_BYTES], err.message))
                continue
            restored.append(record.snapshot())
        cached_blocks = 0
        for seq in cached:
            try:
                cached_blocks += self._restore_sequence(worker, seq, free)
            except TandemError:
                continue  # stale or malformed: the blocks stay free, the cache a little colder
        self._events.flush()
        return RestoreResult(self._info(worker), tuple(restored), tuple(dropped), cached_blocks)

    def _held(self, worker: WorkerRecord, tokens, salt, table, free: set[int]):
        """Validate one re-announced sequence (read-only): its key stream, block ids, and how
        many leading blocks are already resident on the worker under exactly these ids.
        Returns (stream, salt, table, resident path, matched blocks)."""
        spec = worker.spec
        buf, arr = validation.prompt(tokens, self.max_tokens)
        validation.fits_worker(spec, arr, len(arr) - 1)  # the last sampled token has no position
        salt = validation.salt(salt)
        table = [validation.count("block id", b) for b in table]
        if any(b >= spec.num_blocks for b in table):
            raise InvalidArgument(f"a block id is not below num_blocks {spec.num_blocks}")
        if len(set(table)) != len(table):
            raise InvalidArgument("a block id appears twice in one table")
        stream = KeyStream(buf, worker.span, spec.block_size)
        # walk() caps at the reusable blocks (n - 1 positions when D = 0); a resend names every
        # keyed block, so walk a stream one token longer, which reads no key past them
        probe = stream if worker.span else KeyStream(buf + b"\0\0\0\0", 0, spec.block_size)
        path, ends = self._trie.walk(self._trie.root(worker.namespace(salt)), probe)
        wid = worker.worker_id
        k = self._resident_prefix(path, wid)
        resident: list[int] = []
        if k:
            for run in chain(path[k - 1].residency[wid]):
                resident += run.ids
            del resident[ends[k - 1]:]
        m = 0
        limit = min(len(resident), len(table), stream.num_keyed_blocks)
        while m < limit and resident[m] == table[m]:
            m += 1
        return stream, salt, table, path[:k], ends[:k], m

    def _pin_held(self, worker: WorkerRecord, path, ends, m: int) -> Run | None:
        """Pin the worker's first ``m`` resident blocks along ``path`` (cutting a run where they
        end, as Reserve does); returns the deepest pinned run (mutates)."""
        if not m:
            return None
        i = next(i for i, end in enumerate(ends) if end >= m)
        node = path[i]
        used = m - (ends[i - 1] if i else 0)
        if used < node.size:
            node = self._trie.split(node, used)
        last = node.residency[worker.worker_id]
        worker.pool.pin_chain(last, self.tick)
        return last

    def _restore_reservation(self, worker: WorkerRecord, held, free: set[int]) -> ReservationRecord:
        if not isinstance(held, HeldReservation):
            raise InvalidArgument("a held reservation is expected")
        rid = validation.ident("reservation_id", held.reservation_id)
        request_id = validation.ident("request_id", held.request_id)
        if rid in self._reservations or rid in self._ending or request_id in self._by_request:
            raise InvalidArgument(f"reservation {validation.shown(rid)} or its request is live already")
        stream, salt, table, path, ends, m = self._held(worker, held.tokens, held.cache_salt, held.block_table, free)
        bs = worker.spec.block_size
        # a worker counts blocks with final KV; only keyed ones were published (as Publish clamps)
        published = min(validation.count("published_blocks", held.published_blocks), len(table), stream.num_keyed_blocks)
        # the last token of a sequence is sampled, never fed: it has no KV position yet
        if len(table) * bs < min(stream.n - 1, worker.spec.max_seq_len) or len(table) > -(-worker.spec.max_seq_len // bs):
            raise InvalidArgument(f"a table of {len(table)} blocks does not fit {stream.n} tokens and max_seq_len")
        m = min(m, published)
        own = table[m:]
        if any(b not in free for b in own):
            raise FailedPrecondition(f"reservation {validation.shown(rid)} names blocks held elsewhere")
        # validated: mutate
        self.tick += 1
        free.difference_update(own)
        worker.pool.take_ids(set(own))
        last = self._pin_held(worker, path, ends, m)
        record = ReservationRecord(rid, request_id, worker, stream, salt, 0, last, list(own), m)
        self._reservations[rid] = worker.reservations[rid] = self._by_request[request_id] = record
        self._tombstones.pop(rid, None)
        self._publish_blocks(record, published * bs)  # may deduplicate: the worker adopts the table
        return record

    def _restore_sequence(self, worker: WorkerRecord, held, free: set[int]) -> int:
        """Cached blocks back into the trie at ref 0, up to the first block not free (mutates).
        Returns how many were added."""
        if not isinstance(held, HeldSequence):
            raise InvalidArgument("a held sequence is expected")
        stream, salt, table, path, ends, m = self._held(worker, held.tokens, held.cache_salt, held.block_ids, free)
        n = min(len(table), stream.num_keyed_blocks)
        end = m
        while end < n and table[end] in free:
            end += 1
        own = table[m:end]
        if not own:
            return 0
        self.tick += 1
        free.difference_update(own)
        worker.pool.take_ids(set(own))
        last = self._pin_held(worker, path, ends, m)
        record = ReservationRecord("", "", worker, stream, salt, 0, last, list(own), m)
        newly, _dedup = self._publish_blocks(record, end * worker.spec.block_size)
        self._unpin_all(record)  # published blocks become cached (ref 0); dedup copies free
        return newly

    def list_workers(self) -> list[WorkerInfo]:
        """Every live worker, ordered by worker id (read-only apart from lapsing leases)."""
        self.expire_leases()
        return [self._info(self._workers[wid]) for wid in sorted(self._workers)]

    def heartbeat(self, worker_id: str, incarnation: int) -> float:
        """Extend the worker's lease (mutates); returns the seconds left."""
        self.expire_leases()
        worker = self._worker(worker_id, incarnation)
        worker.lease_deadline = self._clock() + self.lease_ttl_s
        self._next_lapse = min(self._next_lapse, worker.lease_deadline)  # a clock that stepped back
        return self.lease_ttl_s

    def expire_leases(self) -> list[str]:
        """Drop every worker whose lease lapsed, like a re-registration would (mutates). Returns
        their ids. Called at the start of every verb."""
        if not self._workers:
            return []
        now = self._clock()
        if now < self._next_lapse:  # every verb calls this: most calls need not look at anyone
            return []
        lapsed = [w for w in self._workers.values() if w.lease_deadline <= now]
        for worker in lapsed:
            self._drop_worker(worker)
            del self._workers[worker.worker_id]
        # deadlines only move later (Heartbeat) or arrive with a registration (which lowers
        # this), so the earliest one seen now bounds when anyone can lapse next
        self._next_lapse = min((w.lease_deadline for w in self._workers.values()), default=math.inf)
        if lapsed:
            self._events.flush()
        return [w.worker_id for w in lapsed]

    # ------------------------------------------------------------------------------------ lookup
    def match(self, tokens, *, cache_salt: bytes = b"", model_id: str | None = None) -> list[MatchResult]:
        """Per compatible live worker (same ``model_id`` if given, prompt within its
        ``max_seq_len`` and vocabulary), how many prompt positions are reusable there now.
        Read-only: pins nothing, touches no LRU clock."""
        self.expire_leases()
        buf, arr = validation.prompt(tokens, self.max_tokens)
        salt = validation.salt(cache_salt)
        n = len(arr)
        self._matches += 1
        max_id = -1
        walks: dict[object, tuple[list[Node], list[int]]] = {}
        results = []
        for wid in sorted(self._workers):
            worker = self._workers[wid]
            spec = worker.spec
            if (model_id and spec.model_id != model_id) or n > spec.max_seq_len:
                continue
            if max_id < 0:
                max_id = int(arr.max())
            if max_id >= spec.vocab_size:
                continue
            namespace = worker.namespace(salt)
            walk = walks.get(namespace)
            if walk is None:
                stream = KeyStream(buf, worker.span, spec.block_size)
                walk = walks[namespace] = self._trie.walk(self._trie.root(namespace), stream)
            path, ends = walk
            k = self._resident_prefix(path, wid)
            blocks = ends[k - 1] if k else 0
            results.append(
                MatchResult(
                    worker_id=wid,
                    incarnation=worker.incarnation,
                    reusable_positions=blocks * spec.block_size,
                    reusable_blocks=blocks,
                    pool=worker.usage(),
                    live_reservations=len(worker.reservations),
                )
            )
        return results

    @staticmethod
    def _resident_prefix(path: list[Node], worker_id: str) -> int:
        """How many leading nodes of ``path`` are resident on ``worker_id`` (read-only).
        Residency is prefix-closed per worker, so a binary search suffices."""
        lo, hi = 0, len(path)
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if worker_id in path[mid - 1].residency:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ------------------------------------------------------------------------------ reservations
    def reserve(
        self,
        *,
        worker_id: str,
        incarnation: int,
        request_id: str,
        tokens,
        cache_salt: bytes = b"",
        headroom_positions: int = 0,
    ) -> Reservation:
        """Pin the reusable prefix of ``tokens`` on the worker and allocate fresh blocks for the
        rest of the prompt plus ``headroom_positions`` (capacity clamped to ``max_seq_len``),
        evicting LRU cached leaves as needed (mutates). Idempotent per ``request_id``: a retry
        with the same arguments returns the live reservation; different arguments are
        InvalidArgument. ResourceExhausted (nothing changed) if the blocks cannot be had."""
        self.expire_leases()
        worker = self._worker(worker_id, incarnation)
        validation.ident("request_id", request_id)
        buf, arr = validation.prompt(tokens, self.max_tokens)
        salt = validation.salt(cache_salt)
        headroom = validation.count("headroom_positions", headroom_positions)
        validation.fits_worker(worker.spec, arr, len(arr))
        live = self._by_request.get(request_id)
        if live is not None:
            if (
                live.worker is worker
                and live.prompt == buf
                and live.cache_salt == salt
                and live.headroom == headroom
            ):
                return live.snapshot()
            raise InvalidArgument(f"request {validation.shown(request_id)} already holds a different live reservation")

        spec, pool = worker.spec, worker.pool
        n = len(arr)
        stream = KeyStream(buf, worker.span, spec.block_size)
        trie = self._trie
        path, ends = trie.walk(trie.root(worker.namespace(salt)), stream)
        wid = worker.worker_id
        k = self._resident_prefix(path, wid)
        reused = ends[k - 1] if k else 0
        capacity = min(n + headroom, spec.max_seq_len)
        fresh = -(-capacity // spec.block_size) - reused
        cached_pins = 0  # blocks of the prefix that are cached now: pinning takes them off the table
        start = 0
        for node, end in zip(path[:k], ends):
            if not node.residency[wid].ref:
                cached_pins += end - start
            start = end
        available = pool.available(cached_pins)
        if available < fresh:
            raise ResourceExhausted(
                f"worker {worker.worker_id!r} needs {fresh} free blocks for {capacity} positions "
                f"({reused} reused) but only {available} can be had"
            )

        self.tick += 1
        last: Run | None = None
        if k:
            node = path[k - 1]
            used = reused - (ends[k - 2] if k > 1 else 0)
            if used < node.size:  # the prefix ends inside a run: cut it there, runs pin whole
                node = trie.split(node, used)
            last = node.residency[wid]
            pool.pin_chain(last, self.tick)
        own = self._allocate(worker, fresh)
        rid = self._new_id()
        record = ReservationRecord(rid, request_id, worker, stream, salt, headroom, last, own, reused)
        self._reservations[rid] = worker.reservations[rid] = self._by_request[request_id] = record
        self._reservations_created += 1
        worker.requested_positions += n
        worker.reused_positions += record.reused_positions
        self._events.flush()
        return record.snapshot()

    def reserve_first(
        self,
        *,
        candidates,
        request_id: str,
        tokens,
        cache_salt: bytes = b"",
        headroom_positions: int = 0,
    ) -> Reservation:
        """``reserve`` on the first of ``candidates`` ((worker id, incarnation) pairs, in order
        of preference) that is live at that incarnation and has room (mutates: one reservation
        or nothing). Saves a router the round trip per full worker. A retry with the same
        request id returns the live reservation wherever it landed. ResourceExhausted if every
        live candidate is full, FailedPrecondition if none is live; other errors (bad input) are
        raised at once."""
        candidates = list(candidates)
        if not candidates:
            raise InvalidArgument("candidates must name at least one worker")
        live = self._by_request.get(request_id) if isinstance(request_id, str) else None
        if live is not None and (live.worker.worker_id, live.worker.incarnation) in candidates:
            candidates = [(live.worker.worker_id, live.worker.incarnation)]  # idempotent retry
        full: list[str] = []
        gone: list[str] = []
        for worker_id, incarnation in candidates:
            try:
                return self.reserve(worker_id=worker_id, incarnation=incarnation, request_id=request_id, tokens=tokens,
                                    cache_salt=cache_salt, headroom_positions=headroom_positions)
            except ResourceExhausted as err:
                full.append(err.message)
            except (NotFound, FailedPrecondition) as err:
                gone.append(err.message)
        if full:
            raise ResourceExhausted("; ".join(full))
        raise FailedPrecondition("no candidate worker is live: " + "; ".join(gone))

    def get_reservation(self, reservation_id: str, incarnation: int | None = None, *,
                        worker_id: str | None = None) -> Reservation:
        """Snapshot of a live reservation (read-only). NotFound / FailedPrecondition if ended;
        with ``worker_id``, PermissionDenied unless it lives on that worker; with
        ``incarnation``, FailedPrecondition unless it is the worker's."""
        self.expire_leases()
        if incarnation is None:
            record = self._reservations.get(reservation_id) if isinstance(reservation_id, str) else None
            if record is None:
                self._raise_not_live(reservation_id)
            self._check_owner(record, worker_id)
        else:
            record = self._live(reservation_id, incarnation, worker_id)
        return record.snapshot()

    def reservation_prompt(self, reservation_id: str, incarnation: int, *, worker_id: str | None = None) -> bytes:
        """The packed prompt a live reservation was made for (read-only; checks as
        :meth:`get_reservation`): a worker asked to run it compares it with what it was sent."""
        return self._live(reservation_id, incarnation, worker_id).prompt

    def reservation_salt(self, reservation_id: str, incarnation: int, *, worker_id: str | None = None) -> bytes:
        """The cache salt of a live reservation (read-only; checks as :meth:`get_reservation`):
        its worker re-announces it with the reservation after a kvstore restart."""
        return self._live(reservation_id, incarnation, worker_id).cache_salt

    def ending_for(self, worker_id: str, incarnation: int, limit: int = 1024) -> list[str]:
        """Ids of the worker's reservations ended by someone else and waiting for it to confirm
        (read-only; at most ``limit``). The worker cancels those it runs and confirms the rest."""
        worker = self._worker(worker_id, incarnation)
        return list(worker.ending)[:limit]

    def extend(self, items: list[ExtendItem], *, worker_id: str | None = None) -> list[ItemResult]:
        """Grow each reservation to at least ``capacity_positions`` (rounded up to blocks) by
        allocating tail blocks (mutates). Each item is atomic and gets its own result; asking
        for no more than the current capacity is a successful no-op. At most ``max_items``."""
        self.expire_leases()
        validation.items(items, self.max_items)
        results = [self._apply_item(item, self._extend_one, worker_id) for item in items]
        self._events.flush()
        return results

    def _extend_one(self, record: ReservationRecord, capacity: int) -> ItemResult:
        worker = record.worker
        spec = worker.spec
        wanted = -(-capacity // spec.block_size)
        if wanted > -(-spec.max_seq_len // spec.block_size):
            raise InvalidArgument(f"capacity {capacity} exceeds max_seq_len {spec.max_seq_len}")
        need = wanted - record.published - len(record.own)
        added: tuple[int, ...] = ()
        if need > 0:
            available = worker.pool.available(0)
            if available < need:
                raise ResourceExhausted(
                    f"worker {worker.worker_id!r} needs {need} more blocks for {capacity} positions "
                    f"but only {available} can be had"
                )
            new = self._allocate(worker, need)
            record.own += new
            added = tuple(new)
        return self._item_result(record, added_blocks=added)

    def trim(self, items: list[TrimItem], *, worker_id: str | None = None) -> list[ItemResult]:
        """Shrink each reservation to the blocks that ``capacity_positions`` needs, returning its
        tail blocks to the free queue (mutates; the worker calls this only after the GPU step
        that last wrote them completed). Never below the published blocks (FailedPrecondition)
        nor below the request's known length (InvalidArgument). Each item atomic."""
        self.expire_leases()
        validation.items(items, self.max_items)
        results = [self._apply_item(item, self._trim_one, worker_id) for item in items]
        self._events.flush()
        return results

    def _trim_one(self, record: ReservationRecord, capacity: int) -> ItemResult:
        bs = record.worker.spec.block_size
        keep = -(-capacity // bs)
        if keep < record.published:
            raise FailedPrecondition(
                f"cannot trim {record.reservation_id} to {capacity} positions: its first "
                f"{record.published * bs} positions are published"
            )
        if capacity < record.stream.n:
            raise InvalidArgument(
                f"capacity {capacity} is below the current length {record.stream.n} of {record.reservation_id}"
            )
        own = record.own
        cut = keep - record.published
        tail = own[cut:]
        del own[cut:]
        record.worker.pool.release_own(tail)
        return self._item_result(record, freed_blocks=tuple(tail))

    def _apply_item(self, item, apply, worker_id: str | None) -> ItemResult:
        rid = getattr(item, "reservation_id", None)
        try:
            capacity = validation.count("capacity_positions", item.capacity_positions)
            record = self._live(rid, item.incarnation, worker_id)
            return apply(record, capacity)
        except TandemError as err:
            record = self._reservations.get(rid) if isinstance(rid, str) else None
            if record is None or isinstance(err, PermissionDenied):
                return ItemResult(str(rid)[: validation.MAX_ID_BYTES], err, (), 0)
            return dataclasses.replace(self._item_result(record), error=err)

    @staticmethod
    def _item_result(record: ReservationRecord, **changes) -> ItemResult:
        return ItemResult(record.reservation_id, None, record.block_table(), record.capacity_positions, **changes)

    def publish(self, *, reservation_id: str, incarnation: int, new_tokens=(), final_positions: int,
                worker_id: str | None = None, known_tokens: int = 0) -> PublishResult:
        """Append ``new_tokens`` (accepted since the last call) to the reservation's sequence and
        publish every full keyed block ``j`` with ``(j+1) * block_size <= final_positions``
        (mutates). ``final_positions`` = leading positions whose target *and* draft KV are final.
        Dedup: a block already resident on the worker under another id replaces the
        reservation's own copy (which is freed), so the returned block table may change.
        ``known_tokens`` > 0 makes a resend safe: the sequence must hold that many tokens, or
        already ``known_tokens + len(new_tokens)`` (the call landed before: nothing is appended)."""
        self.expire_leases()
        record = self._live(reservation_id, incarnation, worker_id)
        known = validation.count("known_tokens", known_tokens)
        if known:
            new_tokens = validation.resent_tokens(record.stream, new_tokens, known)
        stream = validation.appended(record.stream, new_tokens, record.worker.spec, self.max_tokens)
        final = validation.final_positions(final_positions, stream, record.capacity_positions)
        self.tick += 1
        record.stream = stream
        newly, dedup = self._publish_blocks(record, final)
        self._events.flush()
        return PublishResult(record.snapshot(), newly, dedup)

    def release(self, *, reservation_id: str, incarnation: int, new_tokens=(),
                final_positions: int | None = None, worker_id: str | None = None) -> ReleaseResult:
        """End the reservation (mutates): publish like ``publish`` (``final_positions`` None or 0
        publishes nothing new: only the worker knows what its GPU computed), then unpin every
        block: published ones become cached at ref 0, the others are freed. Only the owning
        worker releases (it knows what it computed); a reservation ended meanwhile by the
        router is freed publishing nothing (the worker's Release confirms it)."""
        return self._finish(reservation_id, incarnation, new_tokens, final_positions, worker_id)

    def suspend(self, *, reservation_id: str, incarnation: int, new_tokens=(),
                final_positions: int | None = None, worker_id: str | None = None) -> ReleaseResult:
        """Preempt the reservation (mutates): exactly ``release``; the request may ``reserve``
        again with the same request id and will hit the prefix published here."""
        return self._finish(reservation_id, incarnation, new_tokens, final_positions, worker_id)

    def _finish(self, reservation_id, incarnation, new_tokens, final_positions, worker_id) -> ReleaseResult:
        self.expire_leases()
        ending = self._ending.get(reservation_id) if isinstance(reservation_id, str) else None
        if ending is not None:  # the worker confirms an end someone else asked for
            self._check_ending(ending, incarnation, worker_id)
            self.tick += 1
            freed, unpinned = self._unpin_all(ending)
            self._end(ending)
            return ReleaseResult(ending.reservation_id, 0, 0, freed, unpinned)
        record = self._live(reservation_id, incarnation, worker_id)
        stream = validation.appended(record.stream, new_tokens, record.worker.spec, self.max_tokens)
        if final_positions is None:
            final = 0
        else:
            final = validation.final_positions(final_positions, stream, record.capacity_positions)
        self.tick += 1
        record.stream = stream
        newly, dedup = self._publish_blocks(record, final)
        freed, unpinned = self._unpin_all(record)
        self._end(record)
        self._events.flush()
        # Deduplicated copies went back to the free queue too: freed counts them.
        return ReleaseResult(record.reservation_id, newly, dedup, freed + dedup, unpinned)

    def abort(self, *, reservation_id: str, incarnation: int, worker_id: str | None = None) -> bool:
        """End the reservation publishing nothing new (mutates). ``worker_id`` = the owning
        worker confirming its last step finished with the blocks: they are freed now (also for a
        reservation already marked ended). Anyone else (None) only marks it ended; its blocks
        are freed when the worker confirms or its lease lapses (see the module docstring).
        Returns True if the call changed something, False if it had already ended (idempotent,
        for ids still remembered). NotFound for an unknown id; FailedPrecondition for an
        incarnation other than the reservation's; PermissionDenied for another worker's."""
        self.expire_leases()
        incarnation = validation.count("incarnation", incarnation)
        record = self._reservations.get(reservation_id) if isinstance(reservation_id, str) else None
        if record is None:
            ending = self._ending.get(reservation_id) if isinstance(reservation_id, str) else None
            if ending is not None:
                self._check_ending(ending, incarnation, worker_id)
                if worker_id is None:
                    return False
                self.tick += 1
                self._unpin_all(ending)
                self._end(ending)
                return True
            ended = self._tombstones.get(reservation_id) if isinstance(reservation_id, str) else None
            if ended is None:
                raise NotFound(f"unknown reservation {validation.shown(reservation_id)}")
            if worker_id is not None and ended[0] != worker_id:
                raise PermissionDenied(f"reservation {validation.shown(reservation_id)} is not worker {validation.shown(worker_id)}'s")
            if ended[1] != incarnation:
                raise FailedPrecondition(
                    f"reservation {validation.shown(reservation_id)} belongs to incarnation {ended[1]}, not {incarnation}"
                )
            return False
        self._check_owner(record, worker_id)
        if record.worker.incarnation != incarnation:
            raise FailedPrecondition(
                f"stale incarnation {incarnation} for {validation.shown(reservation_id)} (worker is at {record.worker.incarnation})"
            )
        self.tick += 1
        if worker_id is None:
            self._mark_ending(record)
            return True
        self._unpin_all(record)
        self._end(record)
        return True

    # ------------------------------------------------------------------------------ introspection
    def stats(self, worker_id: str | None = None) -> StoreStats:
        """Counters and pool usage of all workers or one (read-only). NotFound for an unknown id."""
        self.expire_leases()
        if worker_id:
            if worker_id not in self._workers:
                raise NotFound(f"unknown worker {validation.shown(worker_id)}")
            selected = [self._workers[worker_id]]
        else:
            selected = [self._workers[wid] for wid in sorted(self._workers)]
        return StoreStats(
            workers=tuple(
                WorkerStats(
                    worker_id=w.worker_id,
                    incarnation=w.incarnation,
                    pool=w.usage(),
                    live_reservations=len(w.reservations),
                    ending_reservations=len(w.ending),
                    requested_positions=w.requested_positions,
                    reused_positions=w.reused_positions,
                    evictions=w.evictions,
                    published_blocks=w.published_blocks,
                    deduplicated_blocks=w.deduplicated_blocks,
                )
                for w in selected
            ),
            matches=self._matches,
            reservations_created=self._reservations_created,
            live_reservations=len(self._reservations),
            ending_reservations=len(self._ending),
            trie_nodes=self._trie.num_blocks,
            trie_runs=self._trie.num_nodes,
        )

    def check_invariants(self) -> list[str]:
        """Full audit of pools, trie and reservations (read-only); an empty list means healthy."""
        self.expire_leases()
        return audit.check(self._workers, self._trie, self._reservations, self._by_request, self._ending)

    def events_since(self, worker_id: str, after_seq: int) -> list[Event]:
        """Buffered events of ``worker_id`` with ``seq > after_seq`` (read-only). NotFound if the
        store never saw that worker."""
        self.expire_leases()
        after_seq = validation.count("after_seq", after_seq)
        if not self._events.knows(worker_id) and worker_id not in self._workers:
            raise NotFound(f"unknown worker {validation.shown(worker_id)}")
        return self._events.since(worker_id, after_seq)

    def view(self) -> StoreView:
        """A read-only window on the live state (see ``view``)."""
        return StoreView(self)

    def subscribe(self, callback: Callable[[str, Event], None]) -> Callable[[], None]:
        """Call ``callback(worker_id, event)`` for every future event, after the verb that caused
        it has completed. Returns a function that unsubscribes."""
        return self._events.subscribe(callback)

    # ---------------------------------------------------------------------------------- helpers
    def _info(self, worker: WorkerRecord) -> WorkerInfo:
        return WorkerInfo(
            spec=worker.spec,
            incarnation=worker.incarnation,
            span=worker.span,
            lease_expires_in_s=max(0.0, worker.lease_deadline - self._clock()),
            pool=worker.usage(),
            live_reservations=len(worker.reservations),
        )

    def _worker(self, worker_id: str, incarnation: int) -> WorkerRecord:
        incarnation = validation.count("incarnation", incarnation)
        worker = self._workers.get(worker_id)
        if worker is None:
            raise NotFound(f"unknown worker {validation.shown(worker_id)}")
        if worker.incarnation != incarnation:
            raise FailedPrecondition(
                f"stale incarnation {incarnation} for worker {validation.shown(worker_id)} (current {worker.incarnation})"
            )
        return worker

    def _live(self, reservation_id: str, incarnation: int, worker_id: str | None = None) -> ReservationRecord:
        incarnation = validation.count("incarnation", incarnation)
        record = self._reservations.get(reservation_id) if isinstance(reservation_id, str) else None
        if record is None:
            ending = self._ending.get(reservation_id) if isinstance(reservation_id, str) else None
            if ending is not None:
                self._check_owner(ending, worker_id)
                raise FailedPrecondition(
                    f"reservation {validation.shown(reservation_id)} was ended by the router; "
                    "confirm with Abort once no step writes its blocks"
                )
            self._raise_not_live(reservation_id)
        self._check_owner(record, worker_id)
        if record.worker.incarnation != incarnation:
            raise FailedPrecondition(
                f"stale incarnation {incarnation} for {validation.shown(reservation_id)} (worker is at {record.worker.incarnation})"
            )
        return record

    @staticmethod
    def _check_owner(record: ReservationRecord, worker_id: str | None) -> None:
        if worker_id is not None and record.worker.worker_id != worker_id:
            raise PermissionDenied(
                f"reservation {validation.shown(record.reservation_id)} is not worker {validation.shown(worker_id)}'s"
            )

    def _check_ending(self, record: ReservationRecord, incarnation: int, worker_id: str | None) -> None:
        self._check_owner(record, worker_id)
        if record.worker.incarnation != validation.count("incarnation", incarnation):
            raise FailedPrecondition(
                f"stale incarnation {incarnation} for {validation.shown(record.reservation_id)} "
                f"(worker is at {record.worker.incarnation})"
            )

    def _mark_ending(self, record: ReservationRecord) -> None:
        """Live → ending (mutates): no longer live, its request id free, its blocks still held."""
        rid = record.reservation_id
        del self._reservations[rid]
        del record.worker.reservations[rid]
        del self._by_request[record.request_id]
        self._ending[rid] = record.worker.ending[rid] = record

    def _raise_not_live(self, reservation_id) -> None:
        if isinstance(reservation_id, str) and reservation_id in self._tombstones:
            raise FailedPrecondition(f"reservation {validation.shown(reservation_id)} has ended")
        raise NotFound(f"unknown reservation {validation.shown(reservation_id)}")

    def _allocate(self, worker: WorkerRecord, count: int) -> list[int]:
        """Take ``count`` blocks from the free queue, evicting LRU cached leaves when it runs dry
        (mutates; the caller checked ``available``). Evictions make one REMOVED event."""
        pool = worker.pool
        out = pool.take_free(count)
        need = count - len(out)
        if need:
            keys: list | None = [] if self._events.enabled else None
            victims: list[int] = []
            pool.evict(need, self._trie, victims, keys)
            worker.evictions += need
            self._events.record(worker.worker_id, worker.incarnation, EventKind.REMOVED, victims, keys or ())
            out += victims
        return out

    def _publish_blocks(self, record: ReservationRecord, final: int) -> tuple[int, int]:
        """Insert the reservation's blocks up to ``final`` positions into the trie (mutates).
        Returns (newly published, deduplicated).

        Walks down from the reservation's last run, run by run, splitting a node where our
        blocks part from it. Residency is prefix-closed, so runs already resident on the worker
        (published by a concurrent twin request) come first: each is pinned and our copies are
        freed (dedup). Then runs published only by other workers get our blocks as this
        worker's copy, and the rest becomes one new node. One STORED event covers the blocks
        that were not deduplicated::

            published   dedup (pinned, ours freed)   other workers' nodes   new node
            [........] [..........................] [....................] [.........]
            0      start                                                          target
        """
        worker = record.worker
        stream = record.stream
        bs = worker.spec.block_size
        target = min(final // bs, stream.num_keyed_blocks)
        start = record.published
        if target <= start:
            return 0, 0
        pool, wid, trie, tick = worker.pool, worker.worker_id, self._trie, self.tick
        last = record.last
        node = last.node if last is not None else trie.root_or_create(record.namespace)
        buf, d4 = stream.buf, worker.span << 2
        pos = 0 if start == 0 else (start * bs << 2) + d4
        end = (target * bs << 2) + d4
        own = record.own
        j = start
        dedup = 0
        first_new = -1  # index in the table of the first block not deduplicated
        while j < target:
            head = (bs << 2) + (d4 if node.parent is None else 0)
            child = node.children.get(buf[pos : pos + head])
            if child is None:
                break
            m = common_blocks(child, buf, pos, min(child.size, target - j))
            if m < child.size:
                child = trie.split(child, m)
            run = child.residency.get(wid)
            taken = own[:m]
            del own[:m]
            if run is not None:  # our copy of a block the worker already holds: share it
                pool.pin_one(run, tick)
                pool.release_own(taken)
                dedup += m
            else:
                if first_new < 0:
                    first_new = j
                run = trie.add_residency(child, last, taken, wid, tick)
            last = run
            node = child
            j += m
            pos += child.end_of(m)
        if j < target:
            if first_new < 0:
                first_new = j
            taken = own[: target - j]
            del own[: target - j]
            last = trie.attach(node, last, buf[pos:end], taken, wid, tick)
        record.last = last
        record.published = target
        newly = target - start - dedup
        if newly and self._events.enabled:
            self._stored_event(worker, last, first_new, target)
        worker.published_blocks += newly
        worker.deduplicated_blocks += dedup
        return newly, dedup

    def _stored_event(self, worker: WorkerRecord, last: Run, first: int, target: int) -> None:
        """One STORED event for table blocks ``first .. target-1`` (keys read off the trie)."""
        ids: list[int] = []
        keys: list = []
        parent_key = None
        for run in chain(last):
            node = run.node
            lo = node.depth - 1  # table index of the run's first block
            if lo + len(run.ids) <= first:
                continue
            skip = max(first - lo, 0)
            if parent_key is None:
                parent_key = node.keys[skip - 1] if skip else (node.parent.keys[-1])
            ids += run.ids[skip:]
            keys += node.keys[skip:]
        self._events.record(worker.worker_id, worker.incarnation, EventKind.STORED, ids, keys, parent_key)

    def _unpin_all(self, record: ReservationRecord) -> tuple[int, int]:
        """Drop the reservation's references (mutates): (own blocks freed, published blocks unpinned)."""
        pool = record.worker.pool
        unpinned = pool.unpin_chain(record.last, self.tick)
        freed = len(record.own)
        pool.release_own(record.own)
        record.last = None
        record.own = []
        return freed, unpinned

    def _end(self, record: ReservationRecord) -> None:
        """Forget a live or ending reservation whose blocks were already dealt with; remember
        its id (mutates)."""
        rid = record.reservation_id
        if self._ending.pop(rid, None) is not None:
            del record.worker.ending[rid]
        else:
            del self._reservations[rid]
            del record.worker.reservations[rid]
            del self._by_request[record.request_id]
        if self._max_tombstones:
            self._tombstones[rid] = (record.worker.worker_id, record.worker.incarnation)
            if len(self._tombstones) > self._max_tombstones:
                self._tombstones.popitem(last=False)

    def _drop_worker(self, worker: WorkerRecord) -> None:
        """Drop every reservation and trie residency of a worker incarnation and emit CLEARED
        (mutates). The caller removes or replaces the record itself."""
        for record in [*worker.reservations.values(), *worker.ending.values()]:
            record.last = None
            record.own = []
            self._end(record)
        self._trie.drop_worker(worker.worker_id)
        self._events.record(worker.worker_id, worker.incarnation, EventKind.CLEARED)
