"""A journal of committed kvstore transactions, replayed deterministically on recovery.

``JournaledStore`` wraps a :class:`~services.kvstore.store.KVStore` without changing it. The
core is deterministic given its inputs and its clock, so a transaction is fully described by
(verb, arguments, clock reading): replaying the same entries in the same order onto a store
built with the same constructor arguments reproduces the exact state — pools, free queues,
trie, pins, eviction order, ticks, incarnations, reservation ids. Each entry also carries the
verb's observable outcome (a digest), checked on replay, so a divergence (a core change that is
not deterministic, a corrupted journal) is an error at recovery, never a silent difference. The
one input that is no argument — the random reservation id the core draws — is journaled too, and
replay hands the core that id through its ``new_id`` hook.

    handler ─▶ JournaledStore.reserve(...) ─▶ clock frozen at t ─▶ KVStore.reserve(...)
                      │ success                                         │
                      └──▶ sink(seq, entry)  (verb, t, args, digest) ◀──┘   entry: journal_codec bytes
    recovery: snapshot (pickled store at seq S) + entries S+1.. ─▶ replay ─▶ same state

Only successful mutations are journaled: a rejected call changed nothing. Lease lapses happen at
the start of every verb (including reads); the wrapper runs ``expire_leases`` itself first with
the same frozen clock and journals an ``expire`` entry when it dropped anyone, so reads need no
journal entry otherwise.

The clock is *journal time*: seconds that continue from the last journaled reading across
restarts (``JournalClock``), so worker leases neither lapse during a kvstore outage nor depend
on which machine's monotonic clock recorded them.

Plain synchronous Python, no network: the Redis transport lives in ``redis_backend``.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import secrets
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from services.common.errors import TandemError

from .journal_codec import PICKLE_PROTOCOL, EntryError, bind, decode, encode, encoder, outcome, reservation_id
from .store import KVStore

# Verbs that may change state, with the arguments that describe them. Every public method of
# KVStore must be in exactly one of MUTATING / READ_ONLY (a test checks), so a verb added to the
# core cannot silently escape the journal.
MUTATING = frozenset(
    {"register_worker", "restore_worker", "heartbeat", "reserve", "reserve_first", "extend", "trim", "publish", "release", "suspend", "abort"}
)
READ_ONLY = frozenset(
    {"list_workers", "match", "get_reservation", "reservation_prompt", "reservation_salt", "ending_for", "stats", "check_invariants",
     "events_since", "view", "subscribe"}
)
# Bump when entries or snapshots change meaning: snapshots are the core's object graph, so a
# kvstore of another format must not load them (RedisLog.load refuses with what to do).
# 2: entries in ``journal_codec``'s compact encoding (1 pickled them).
FORMAT = 2


class JournalDiverged(RuntimeError):
    """Replay produced another outcome than the journal recorded, or an entry is missing: the
    recovered state cannot be trusted (internal; never shown to a client)."""


class JournalClock:
    """Journal time: ``base`` + seconds of this process's monotonic clock since ``resume``;
    ``freeze`` pins the reading for the duration of one verb (and for replay)."""

    def __init__(self, base: float = 0.0):
        self._base = base
        self._mono0 = time.monotonic()
        self._frozen: float | None = None

    def resume(self, base: float) -> None:
        """Continue from ``base`` (the last journaled reading) from now on."""
        self._base = base
        self._mono0 = time.monotonic()

    def live(self) -> float:
        return self._base + (time.monotonic() - self._mono0)

    def freeze(self, value: float | None) -> None:
        self._frozen = value

    def __call__(self) -> float:
        return self._frozen if self._frozen is not None else self.live()


Sink = Callable[[int, bytes], None]  # (seq, encoded entry)


class JournaledStore:
    """A KVStore whose every committed mutation goes to ``sink`` as (seq, entry) in order.

    ``store_args`` are the KVStore constructor arguments (part of the journal's genesis: replay
    needs the same). Attribute access falls through to the store for read-only verbs."""

    def __init__(self, store_args: dict, sink: Sink | None = None, *, clock: JournalClock | None = None,
                 seq: int = 0, store: KVStore | None = None, ids: Callable[[], str] | None = None):
        self.store_args = dict(store_args)
        self.clock = clock or JournalClock()
        self._replay_id: str | None = None  # the id the core must draw next, during replay
        self._ids = ids  # where fresh ids come from (default: 128 random bits; tests pass a counter)
        self.store = store if store is not None else KVStore(clock=self.clock, new_id=self._new_id, **self.store_args)
        self.sink = sink
        self.seq = seq  # entries committed to this store so far (a snapshot counts for its seq)
        self.last_time = 0.0  # the clock reading of the last entry
        self.waiter: Callable[[int], Any] | None = None  # seq -> awaitable | None (the backend's)

    def _new_id(self) -> str:
        """The core's reservation-id source: random (as the core's own), or during replay the
        journaled one."""
        rid, self._replay_id = self._replay_id, None
        if rid is not None:
            return rid
        return self._ids() if self._ids is not None else "r-" + secrets.token_hex(16)

    def durable(self):
        """An awaitable done once everything journaled so far is durable, or None if it is
        already (the servicer awaits it before replying to a mutation)."""
        return self.waiter(self.seq) if self.waiter is not None else None

    # ------------------------------------------------------------------------ live operation
    def _begin(self) -> float:
        now = max(self.clock.live(), self.last_time)  # journal time never runs backwards
        self.clock.freeze(now)
        if self.store.expire_leases():
            self._log("expire", now, {}, None)
        return now

    def _log(self, verb: str, now: float, kw: dict, result) -> None:
        self.seq += 1
        self.last_time = now
        if self.sink is not None:
            self.sink(self.seq, encode(verb, now, kw, result))

    def _read(self, verb: str, args: tuple, kwargs: dict):
        self._begin()
        try:
            return getattr(self.store, verb)(*args, **kwargs)
        finally:
            self.clock.freeze(None)

    def expire_leases(self) -> list[str]:
        now = max(self.clock.live(), self.last_time)
        self.clock.freeze(now)
        try:
            dropped = self.store.expire_leases()
        finally:
            self.clock.freeze(None)
        if dropped:
            self._log("expire", now, {}, None)
        return dropped

    def __getattr__(self, name: str):
        return getattr(self.store, name)  # attributes (lease_ttl_s, epoch, ...); verbs are methods

    # ------------------------------------------------------------------------ snapshots
    def snapshot(self) -> bytes:
        """The whole store state at ``self.seq``, pickled (read-only)."""
        buf = io.BytesIO()
        pickle.dump((self.seq, self.last_time, self.store_args), buf, protocol=PICKLE_PROTOCOL)
        store, events = self.store, self.store._events
        # The clock, id source and event subscribers are process-local callables, not state.
        clock, new_id, subscribers = store._clock, store._new_id, events._subscribers
        store._clock, store._new_id, events._subscribers = None, None, []
        try:
            with _deep_recursion():  # trie nodes and runs point at their parents: pickle recurses
                pickle.dump(store, buf, protocol=PICKLE_PROTOCOL)
        finally:
            store._clock, store._new_id, events._subscribers = clock, new_id, subscribers
        return buf.getvalue()

    # ------------------------------------------------------------------------ recovery
    @classmethod
    def recover(cls, store_args: dict, snapshot: bytes | None, entries: Iterable[tuple[int, bytes]],
                sink: Sink | None = None, *, clock: JournalClock | None = None,
                ids: Callable[[], str] | None = None) -> JournaledStore:
        """Rebuild the exact state: load ``snapshot`` (or start from genesis ``store_args``),
        then replay ``entries`` ((seq, entry), consecutive after the snapshot's seq). The clock
        resumes from the last journaled reading. JournalDiverged if an outcome differs or an
        entry is missing."""
        clock = clock or JournalClock()
        if snapshot:
            buf = io.BytesIO(snapshot)
            seq, last_time, store_args = pickle.load(buf)
            with _deep_recursion():
                store = pickle.load(buf)
            store._clock = clock
        else:
            seq, last_time, store = 0, 0.0, None
        journaled = cls(store_args, None, clock=clock, seq=seq, store=store, ids=ids)
        if store is not None:
            store._new_id = journaled._new_id
        journaled.last_time = last_time
        journaled.catch_up(entries)  # entries the snapshot covers are skipped
        clock.resume(journaled.last_time)
        journaled.sink = sink
        return journaled

    def catch_up(self, entries: Iterable[tuple[int, bytes]]) -> int:
        """Replay ``entries`` ((seq, entry), consecutive after ours) onto this store (a warm
        standby's copy). Returns how many. JournalDiverged on a gap or another outcome."""
        n = 0
        for entry_seq, raw in entries:
            if entry_seq <= self.seq:
                continue
            if entry_seq != self.seq + 1:
                raise JournalDiverged(f"journal gap: entry {entry_seq} follows {self.seq}")
            self._replay(raw)
            n += 1
        return n

    def _replay(self, raw: bytes) -> None:
        try:
            verb, now, kwargs, digest, rid = decode(raw)
        except EntryError as exc:
            raise JournalDiverged(f"entry {self.seq + 1}: {exc}") from None
        self.clock.freeze(now)
        try:
            self.store.expire_leases()
            if verb != "expire":
                self._replay_id = rid
                result = getattr(self.store, verb)(**kwargs)
                self._replay_id = None  # unused when Reserve was an idempotent retry
                if reservation_id(result) != rid or outcome(result) != digest:
                    raise JournalDiverged(f"replay of {verb} at entry {self.seq + 1} answered differently")
        except TandemError as exc:
            if isinstance(exc, JournalDiverged):
                raise
            raise JournalDiverged(f"replay of {verb} at entry {self.seq + 1} failed: {exc.message}") from None
        finally:
            self.clock.freeze(None)
        self.seq += 1
        self.last_time = now


def _verb(name: str, mutating: bool):
    if mutating:
        enc = encoder(name)

        def method(self, *args, **kwargs):
            # one frame for the whole transaction (``_begin``, the clock's freeze and ``_log``
            # written out, the encoder resolved once per verb): it runs for every mutation, and
            # each Python call of the wrapper costs about a microsecond on a small VM, a cost
            # the memory backend does not pay (issue 10's cost goal)
            clock = self.clock
            now = clock.live()
            if now < self.last_time:
                now = self.last_time  # journal time never runs backwards
            clock.freeze(now)
            store = self.store
            try:
                if store.expire_leases():
                    self._log("expire", now, {}, None)
                result = getattr(store, name)(*args, **kwargs)
            finally:
                clock.freeze(None)
            # Extend/Trim items that failed are outcomes too: the entry records the whole call.
            self.seq = seq = self.seq + 1
            self.last_time = now
            sink = self.sink
            if sink is not None:
                sink(seq, enc(now, bind(name, args, kwargs), result))
            return result
    else:
        def method(self, *args, **kwargs):
            return self._read(name, args, kwargs)
    method.__name__ = name
    method.__doc__ = getattr(KVStore, name).__doc__
    return method


for _name in MUTATING:
    setattr(JournaledStore, _name, _verb(_name, True))
for _name in READ_ONLY:
    setattr(JournaledStore, _name, _verb(_name, False))


@contextlib.contextmanager
def _deep_recursion(limit: int = 50_000):
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, limit))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)
