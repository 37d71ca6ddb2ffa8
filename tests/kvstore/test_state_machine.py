"""Stateful property test: random sequences of every kvstore verb on several workers with tiny
pools (so eviction, exhaustion, dedup and lease lapses all happen), checked against a simple
reference model after every step.

The model knows no block ids and no eviction order. Per worker it keeps the live reservations
(token sequence, salt, table length, published block count) and derives from them alone:

* the exact outcome of every call (success, or which error) including ResourceExhausted, since
  ``free + cached = total - in_use`` and in use = the distinct published prefixes pinned by live
  reservations + their own unpublished blocks;
* bounds on Match (at least what live reservations pin, at most what was ever published on the
  worker, exactly that while nothing was evicted);
* that every rejected call left the store's state untouched.

Two-phase end: an Abort from anyone but the owning worker only marks a reservation *ending*
(blocks still in use, listed by ``ending_for``) until the worker confirms (Abort with its id, or
Release) or its lease lapses; a worker acting on another worker's reservation is refused.

After every step: the store's own audit is clean, in-use counts equal the model's (so nothing is
leaked once every reservation has ended), and block tables are consistent (one block per
published prefix per worker, private blocks never shared).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from services.common.spec import SpecMode
from services.kvstore import ExtendItem, KVStore, TrimItem, WorkerSpec

TTL = 10.0
WORKER_IDS = ["a", "b", "c"]
MODES = [(SpecMode.NONE, 0, 0), (SpecMode.EAGLE3, 0, 1), (SpecMode.MTP, 2, 2), (SpecMode.PARD, 0, 0)]
SALTS = [b"", b"t"]
VOCAB = 3
# Prompts share prefixes often: a cut of one of three related bases plus a short random tail.
BASES = [
    [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2],
    [0, 1, 2, 0, 1, 2, 2, 2, 1, 1, 0, 0],
    [1, 1, 0, 2, 0, 2, 1, 0, 0, 1, 2, 2],
]
TOKENS = st.builds(
    lambda base, cut, tail: (BASES[base][:cut] + tail)[:12],
    st.integers(0, 2),
    st.integers(0, 12),
    st.lists(st.integers(0, 2), max_size=3),
).filter(bool)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def path_keys(salt: bytes, tokens: list[int], bs: int, span: int) -> list[tuple]:
    """DESIGN §1 from scratch: key 0 = digest of t[0..D], key i = t[i+D] for i < n - D; block j
    groups keys [j*bs, (j+1)*bs); a block's identity is its whole chain from the root."""
    n = len(tokens)
    if n <= span:
        return []
    keys = [hashlib.sha256(bytes(tokens[: span + 1])).digest()] + tokens[span + 1 :]
    out, chain = [], (salt,)
    for j in range(len(keys) // bs):
        chain = chain + (tuple(keys[j * bs : (j + 1) * bs]),)
        out.append(chain)
    return out


def reuse_cap(n: int, bs: int, span: int) -> int:
    return max(0, n - max(span, 1)) // bs


@dataclass
class MWorker:
    spec: WorkerSpec
    incarnation: int
    span: int
    deadline: float
    ever: set = field(default_factory=set)  # published chains in this incarnation

    @property
    def bs(self) -> int:
        return self.spec.block_size


@dataclass
class MRes:
    rid: str
    request_id: str
    worker_id: str
    incarnation: int
    prompt: list[int]
    tokens: list[int]
    salt: bytes
    headroom: int
    nblocks: int
    published: int


def fingerprint(store: KVStore) -> tuple:
    view = store.view()
    return (
        store.stats(),
        {
            wid: (view.lease_deadline(wid), view.free_ids(wid), view.eviction_order(wid), view.pins(wid), view.runs(wid))
            for wid in view.worker_ids()
        },
        view.reservations(),
        {wid: view.last_seq(wid) for wid in view.worker_ids()},
        view.tick(),
    )


class KVStoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        ids = iter(range(1, 1 << 30))
        # deterministic ids: hypothesis replays runs and picks reservations in sorted order
        self.store = KVStore(clock=self.clock, lease_ttl_s=TTL, epoch=0, events_per_worker=16,
                             new_id=lambda: f"r-{next(ids):06d}")
        self.workers: dict[str, MWorker] = {}
        self.live: dict[str, MRes] = {}
        self.ending: dict[str, MRes] = {}  # ended by the router, blocks held until the worker confirms
        self.ended: dict[str, int] = {}  # reservation id -> incarnation it belonged to
        self.last_incarnation = 0
        self.history: list[tuple[str, bytes, list[int]]] = []  # (worker, salt, tokens) published
        self.requests = 0

    # ------------------------------------------------------------------------------ model
    def expire(self) -> None:
        for wid in [wid for wid, w in self.workers.items() if w.deadline <= self.clock.now]:
            self.drop(wid)

    def drop(self, wid: str) -> None:
        del self.workers[wid]
        for rid in [rid for rid, r in self.live.items() if r.worker_id == wid]:
            self.ended[rid] = self.live.pop(rid).incarnation
        for rid in [rid for rid, r in self.ending.items() if r.worker_id == wid]:
            self.ended[rid] = self.ending.pop(rid).incarnation

    def chains(self, r: MRes) -> list[tuple]:
        w = self.workers[r.worker_id]
        return path_keys(r.salt, r.tokens, w.bs, w.span)

    def holders(self, wid: str) -> list[MRes]:
        """Reservations holding blocks of ``wid``: live and ending ones."""
        return [r for r in (*self.live.values(), *self.ending.values()) if r.worker_id == wid]

    def pinned(self, wid: str) -> set:
        return {c for r in self.holders(wid) for c in self.chains(r)[: r.published]}

    def in_use(self, wid: str) -> int:
        own = sum(r.nblocks - r.published for r in self.holders(wid))
        return len(self.pinned(wid)) + own

    def pick_live(self, data) -> MRes:
        return self.live[data.draw(st.sampled_from(sorted(self.live)), label="reservation")]

    def expect_unchanged(self, error: type, call) -> None:
        before = fingerprint(self.store)
        try:
            call()
        except error:
            pass
        else:
            raise AssertionError(f"expected {error.__name__}")
        assert fingerprint(self.store) == before, "a rejected call changed the store"

    # ------------------------------------------------------------------------------ rules
    SPECS = dict(
        mode=st.sampled_from(MODES),
        bs=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(1, 10),
        max_seq_len=st.sampled_from([10, 16]),
    )

    @initialize(specs=st.lists(st.fixed_dictionaries(SPECS), min_size=len(WORKER_IDS), max_size=len(WORKER_IDS)))
    def register_all(self, specs):
        for wid, spec in zip(WORKER_IDS, specs):
            self.register(wid, **spec)

    @rule(wid=st.sampled_from(WORKER_IDS), **SPECS)
    def register(self, wid, mode, bs, num_blocks, max_seq_len):
        spec = WorkerSpec(wid, "", "m", mode[0], mode[1], bs, num_blocks, VOCAB, max_seq_len)
        info = self.store.register_worker(spec)
        assert info.incarnation > self.last_incarnation and info.span == mode[2]
        self.last_incarnation = info.incarnation
        if wid in self.workers:
            self.drop(wid)
        self.workers[wid] = MWorker(info.spec, info.incarnation, mode[2], self.clock.now + TTL)
        assert (info.pool.free, info.pool.in_use) == (num_blocks, 0)

    @precondition(lambda self: self.workers)
    @rule(data=st.data(), stale=st.booleans())
    def heartbeat(self, data, stale):
        """A stale heartbeat for one worker, or a fresh one for all but one (so leases lapse)."""
        skipped = data.draw(st.sampled_from(sorted(self.workers)))
        if stale:
            w = self.workers[skipped]
            self.expect_unchanged(FailedPrecondition, lambda: self.store.heartbeat(skipped, w.incarnation - 1))
            return
        for wid, w in self.workers.items():
            if wid != skipped:
                assert self.store.heartbeat(wid, w.incarnation) == TTL
                w.deadline = self.clock.now + TTL

    @rule(dt=st.sampled_from([0.5, 2.0, 4.0]))
    def advance_clock(self, dt):
        self.clock.now += dt
        self.expire()

    @precondition(lambda self: self.workers)
    @rule(data=st.data(), tokens=TOKENS, salt=st.sampled_from(SALTS), headroom=st.integers(0, 4))
    def match_then_reserve(self, data, tokens, salt, headroom, worker_id=None):
        wid = worker_id or data.draw(st.sampled_from(sorted(self.workers)))
        w = self.workers[wid]
        self.requests += 1
        request_id = f"q{self.requests}"
        found = {m.worker_id: m for m in self.store.match(tokens, cache_salt=salt)}
        assert sorted(found) == sorted(x for x, mw in self.workers.items() if len(tokens) <= mw.spec.max_seq_len)
        call = lambda: self.store.reserve(  # noqa: E731
            worker_id=wid, incarnation=w.incarnation, request_id=request_id, tokens=tokens,
            cache_salt=salt, headroom_positions=headroom,
        )
        if len(tokens) > w.spec.max_seq_len:
            self.expect_unchanged(InvalidArgument, call)
            return
        reused = self.check_match(wid, tokens, salt, found[wid])
        chains = path_keys(salt, tokens, w.bs, w.span)
        pinned = self.pinned(wid)
        nblocks = ceil_div(min(len(tokens) + headroom, w.spec.max_seq_len), w.bs)
        cached_pins = sum(1 for c in chains[:reused] if c not in pinned)
        available = w.spec.num_blocks - self.in_use(wid) - cached_pins
        if nblocks - reused > available:
            self.expect_unchanged(ResourceExhausted, call)
            return
        r = call()
        assert (r.reused_positions, r.published_blocks, len(r.block_table)) == (reused * w.bs, reused, nblocks)
        self.live[r.reservation_id] = MRes(
            r.reservation_id, request_id, wid, w.incarnation, list(tokens), list(tokens), salt, headroom, nblocks, reused
        )

    @precondition(lambda self: self.workers)
    @rule(data=st.data(), tokens=TOKENS, salt=st.sampled_from(SALTS), new=st.lists(st.integers(0, 2), max_size=2))
    def serve_request(self, data, tokens, salt, new):
        """Reserve, publish everything computed, release: fills the cache in one step."""
        before = set(self.live)
        self.match_then_reserve(data, tokens, salt, len(new))
        [rid] = set(self.live) - before or [None]
        if rid is None:
            return
        r = self.live[rid]
        final = len(r.tokens) + len(new) - 1  # the last sampled token has no KV yet
        error, published = self._expected_publish(r, new, final)
        if error is None:
            res = self.store.release(reservation_id=rid, incarnation=r.incarnation, new_tokens=new, final_positions=final)
            assert res.newly_published + res.deduplicated == published - r.published
            self._published(r, new, published)
        else:
            self.store.abort(reservation_id=rid, incarnation=r.incarnation, worker_id=r.worker_id)
        del self.live[rid]
        self.ended[rid] = r.incarnation

    def check_match(self, wid: str, tokens: list[int], salt: bytes, found) -> int:
        """Match on ``wid`` reuses at least what live reservations pin, at most what was ever
        published there (exactly that while nothing was evicted), within the reuse cap."""
        w = self.workers[wid]
        chains = path_keys(salt, tokens, w.bs, w.span)[: reuse_cap(len(tokens), w.bs, w.span)]
        pinned = self.pinned(wid)
        lower = next((j for j, c in enumerate(chains) if c not in pinned), len(chains))
        upper = next((j for j, c in enumerate(chains) if c not in w.ever), len(chains))
        reused = found.reusable_blocks
        assert lower <= reused <= upper and found.reusable_positions == reused * w.bs
        if self.store.stats(wid).workers[0].evictions == 0:
            assert reused == upper
        return reused

    @precondition(lambda self: self.history)
    @rule(data=st.data(), cut=st.integers(0, 3))
    def rematch_published(self, data, cut):
        """Match a sequence that was published (or a prefix of it): this is where the n - 1
        cap and the unpublished tail of D positions show."""
        wid, salt, tokens = data.draw(st.sampled_from(self.history), label="published sequence")
        tokens = tokens[: max(1, len(tokens) - cut)]
        found = {m.worker_id: m for m in self.store.match(tokens, cache_salt=salt)}
        if wid in self.workers and wid in found:
            self.check_match(wid, tokens, salt, found[wid])

    @precondition(lambda self: self.history)
    @rule(data=st.data(), over=st.booleans())
    def reserve_at_the_limit(self, data, over):
        """Reserve a cached sequence again with headroom chosen so that it needs exactly the
        blocks that can be had, or one more: the blocks it pins itself must not count twice."""
        wid, salt, tokens = data.draw(st.sampled_from(self.history), label="published sequence")
        if wid not in self.workers or len(tokens) > self.workers[wid].spec.max_seq_len:
            return
        w = self.workers[wid]
        [found] = [m for m in self.store.match(tokens, cache_salt=salt) if m.worker_id == wid]
        chains, pinned = path_keys(salt, tokens, w.bs, w.span), self.pinned(wid)
        cached_pins = sum(1 for c in chains[: found.reusable_blocks] if c not in pinned)
        available = w.spec.num_blocks - self.in_use(wid) - cached_pins
        capacity = (found.reusable_blocks + available + over) * w.bs
        if len(tokens) <= capacity <= w.spec.max_seq_len:
            self.match_then_reserve(data, tokens, salt, capacity - len(tokens), worker_id=wid)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), over=st.booleans())
    def extend_at_the_limit(self, data, over):
        r = self.pick_live(data)
        w = self.workers[r.worker_id]
        capacity = (r.nblocks + w.spec.num_blocks - self.in_use(r.worker_id) + over) * w.bs
        if capacity <= w.spec.max_seq_len:
            self.extend(data, [capacity], picked=[r])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def reserve_retry_is_idempotent(self, data):
        r = self.pick_live(data)
        args = dict(worker_id=r.worker_id, incarnation=r.incarnation, request_id=r.request_id, tokens=r.prompt, cache_salt=r.salt)
        before = fingerprint(self.store)
        again = self.store.reserve(headroom_positions=r.headroom, **args)
        assert again == self.store.get_reservation(r.rid) and fingerprint(self.store) == before
        self.expect_unchanged(InvalidArgument, lambda: self.store.reserve(headroom_positions=r.headroom + 1, **args))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), capacities=st.lists(st.integers(0, 20), min_size=1, max_size=3))
    def extend(self, data, capacities, picked=None):
        picked = picked or [self.pick_live(data) for _ in capacities]
        results = self.store.extend([ExtendItem(r.rid, r.incarnation, c) for r, c in zip(picked, capacities)])
        for r, c, res in zip(picked, capacities, results):
            w = self.workers[r.worker_id]
            wanted = ceil_div(c, w.bs)
            if wanted > ceil_div(w.spec.max_seq_len, w.bs):
                assert isinstance(res.error, InvalidArgument)
            elif wanted - r.nblocks > w.spec.num_blocks - self.in_use(r.worker_id):
                assert isinstance(res.error, ResourceExhausted)
            else:
                assert res.ok
                r.nblocks = max(r.nblocks, wanted)
            assert len(res.block_table) == r.nblocks

    @precondition(lambda self: self.live)
    @rule(data=st.data(), capacities=st.lists(st.integers(0, 20), min_size=1, max_size=3))
    def trim(self, data, capacities):
        picked = [self.pick_live(data) for _ in capacities]
        results = self.store.trim([TrimItem(r.rid, r.incarnation, c) for r, c in zip(picked, capacities)])
        for r, c, res in zip(picked, capacities, results):
            keep = ceil_div(c, self.workers[r.worker_id].bs)
            if keep < r.published:
                assert isinstance(res.error, FailedPrecondition)
            elif c < len(r.tokens):
                assert isinstance(res.error, InvalidArgument)
            else:
                assert res.ok
                r.nblocks = min(r.nblocks, keep)
            assert len(res.block_table) == r.nblocks

    def _expected_publish(self, r: MRes, new: list[int], final: int | None) -> tuple[type | None, int]:
        w = self.workers[r.worker_id]
        total = len(r.tokens) + len(new)
        if total > w.spec.max_seq_len + 1:
            return InvalidArgument, r.published
        if final is None:
            return None, r.published
        if final > total or final > r.nblocks * w.bs:
            return InvalidArgument, r.published
        keyed = len(path_keys(r.salt, r.tokens + new, w.bs, w.span))
        return None, max(r.published, min(final // w.bs, keyed))

    def _published(self, r: MRes, new: list[int], published: int) -> None:
        r.tokens = r.tokens + new
        r.published = published
        self.history = (self.history + [(r.worker_id, r.salt, r.tokens)])[-20:]
        self.workers[r.worker_id].ever.update(self.chains(r)[:published])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), max_size=3), final_extra=st.integers(-12, 2))
    def publish(self, data, new, final_extra):
        r = self.pick_live(data)
        final = max(0, len(r.tokens) + len(new) + final_extra)
        error, published = self._expected_publish(r, new, final)
        call = lambda: self.store.publish(reservation_id=r.rid, incarnation=r.incarnation, new_tokens=new, final_positions=final)  # noqa: E731
        if error:
            self.expect_unchanged(error, call)
            return
        before = r.published
        res = call()
        assert res.reservation.published_blocks == published
        assert res.newly_published + res.deduplicated == published - before
        assert len(res.reservation.block_table) == r.nblocks and res.reservation.num_tokens == len(r.tokens) + len(new)
        self._published(r, new, published)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), verb=st.sampled_from(["release", "suspend", "abort"]),
          new=st.lists(st.integers(0, 2), max_size=3), final_extra=st.one_of(st.none(), st.integers(-12, 0)))
    def finish(self, data, verb, new, final_extra):
        r = self.pick_live(data)
        if verb == "abort":
            assert self.store.abort(reservation_id=r.rid, incarnation=r.incarnation, worker_id=r.worker_id) is True
            assert self.store.abort(reservation_id=r.rid, incarnation=r.incarnation, worker_id=r.worker_id) is False
        else:
            final = None if final_extra is None else max(0, len(r.tokens) + len(new) + final_extra)
            error, published = self._expected_publish(r, new, final)
            call = lambda: getattr(self.store, verb)(  # noqa: E731
                reservation_id=r.rid, incarnation=r.incarnation, new_tokens=new, final_positions=final
            )
            if error:
                self.expect_unchanged(error, call)
                return
            res = call()
            assert res.newly_published + res.deduplicated == published - r.published
            self._published(r, new, published)
            # Freed: the unpublished blocks and the copies that dedup replaced.
            assert (res.freed_blocks, res.unpinned_blocks) == (r.nblocks - published + res.deduplicated, published)
        del self.live[r.rid]
        self.ended[r.rid] = r.incarnation

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def router_aborts(self, data):
        """An Abort from the router marks the reservation ending: nothing is freed yet."""
        r = self.pick_live(data)
        assert self.store.abort(reservation_id=r.rid, incarnation=r.incarnation) is True
        assert self.store.abort(reservation_id=r.rid, incarnation=r.incarnation) is False
        del self.live[r.rid]
        self.ending[r.rid] = r
        self.expect_unchanged(FailedPrecondition, lambda: self.store.publish(
            reservation_id=r.rid, incarnation=r.incarnation, final_positions=0, worker_id=r.worker_id))
        [res] = self.store.extend([ExtendItem(r.rid, r.incarnation, 1)], worker_id=r.worker_id)
        assert isinstance(res.error, FailedPrecondition)

    @precondition(lambda self: self.ending)
    @rule(data=st.data(), verb=st.sampled_from(["abort", "release"]))
    def worker_confirms(self, data, verb):
        """The owning worker confirms an ending reservation: its blocks are freed now."""
        rid = data.draw(st.sampled_from(sorted(self.ending)))
        r = self.ending[rid]
        others = [w for w in self.workers if w != r.worker_id]
        if others:
            self.expect_unchanged(PermissionDenied, lambda: self.store.abort(
                reservation_id=rid, incarnation=r.incarnation, worker_id=others[0]))
        if verb == "abort":
            assert self.store.abort(reservation_id=rid, incarnation=r.incarnation, worker_id=r.worker_id) is True
        else:
            res = self.store.release(reservation_id=rid, incarnation=r.incarnation, new_tokens=[0],
                                     final_positions=len(r.tokens), worker_id=r.worker_id)
            assert res.newly_published == 0 and res.freed_blocks == r.nblocks - r.published
        del self.ending[rid]
        self.ended[rid] = r.incarnation

    @precondition(lambda self: self.live and len(self.workers) > 1)
    @rule(data=st.data())
    def foreign_worker_is_denied(self, data):
        """A worker may touch only its own reservations: PermissionDenied, nothing changed."""
        r = self.pick_live(data)
        other = next(w for w in sorted(self.workers) if w != r.worker_id)
        for call in (
            lambda: self.store.abort(reservation_id=r.rid, incarnation=r.incarnation, worker_id=other),
            lambda: self.store.publish(reservation_id=r.rid, incarnation=r.incarnation, final_positions=0, worker_id=other),
            lambda: self.store.release(reservation_id=r.rid, incarnation=r.incarnation, worker_id=other),
            lambda: self.store.get_reservation(r.rid, r.incarnation, worker_id=other),
        ):
            self.expect_unchanged(PermissionDenied, call)
        before = fingerprint(self.store)
        [res] = self.store.trim([TrimItem(r.rid, r.incarnation, 0)], worker_id=other)
        assert isinstance(res.error, PermissionDenied) and fingerprint(self.store) == before

    @precondition(lambda self: self.ended)
    @rule(data=st.data())
    def ended_reservations_stay_ended(self, data):
        rid = data.draw(st.sampled_from(sorted(self.ended)))
        inc = self.ended[rid]
        assert self.store.abort(reservation_id=rid, incarnation=inc) is False
        self.expect_unchanged(FailedPrecondition, lambda: self.store.abort(reservation_id=rid, incarnation=inc + 1))
        self.expect_unchanged(FailedPrecondition, lambda: self.store.publish(reservation_id=rid, incarnation=inc, final_positions=0))
        self.expect_unchanged(NotFound, lambda: self.store.abort(reservation_id=rid + "x", incarnation=inc))

    # ------------------------------------------------------------------------------ invariants
    @invariant()
    def audit_is_clean(self):
        assert self.store.check_invariants() == []

    @invariant()
    def pools_match_the_model(self):
        infos = {i.worker_id: i for i in self.store.list_workers()}
        assert sorted(infos) == sorted(self.workers)
        for wid, w in self.workers.items():
            pool = infos[wid].pool
            assert pool.in_use == self.in_use(wid), wid
            assert pool.free + pool.cached == w.spec.num_blocks - pool.in_use
            live = sum(1 for r in self.live.values() if r.worker_id == wid)
            assert infos[wid].live_reservations == live
            ending = sorted(r.rid for r in self.ending.values() if r.worker_id == wid)
            assert sorted(self.store.ending_for(wid, w.incarnation)) == ending
            if not self.holders(wid):
                assert pool.in_use == 0, "blocks leaked after every reservation ended"
        stats = self.store.stats()
        assert (stats.live_reservations, stats.ending_reservations) == (len(self.live), len(self.ending))

    @invariant()
    def block_tables_are_consistent(self):
        for wid in self.workers:
            owner: dict[tuple, int] = {}
            private: list[int] = []
            for r in (r for r in self.live.values() if r.worker_id == wid):
                snap = self.store.get_reservation(r.rid)
                assert (len(snap.block_table), snap.published_blocks, snap.num_tokens) == (r.nblocks, r.published, len(r.tokens))
                for chain, block in zip(self.chains(r), snap.block_table[: r.published]):
                    assert owner.setdefault(chain, block) == block, "one prefix, two blocks"
                private += snap.block_table[r.published :]
            shared = list(owner.values())
            assert len(set(shared)) == len(shared), "two prefixes in one block"
            assert len(set(private)) == len(private) and not set(private) & set(shared)


KVStoreMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_kvstore_state_machine = KVStoreMachine.TestCase


# ---------------------------------------------------------------------------------- durable variants
# The same machine on the journaled store, with a restart rule: kill the store (drop it), recover
# it from its journal (optionally after a snapshot), require the exact same state, and carry on
# checking every answer against the model. "journal" replays an in-process list; "redis" writes
# every entry through the fenced Lua append to a real redis-server and recovers from there.

from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from services.kvstore.journal import JournalClock, JournaledStore  # noqa: E402


def durable_fingerprint(store) -> tuple:
    """``fingerprint`` minus the Match counter: reads are not journaled, so a recovered store
    counts the Matches it served itself."""
    import dataclasses

    stats, *rest = fingerprint(store)
    return (dataclasses.replace(stats, matches=0), *rest)


class HandClock(JournalClock):
    """Journal time that is the machine's hand-moved clock (restarts do not move it)."""

    def __init__(self, clock: Clock):
        super().__init__()
        self.test_clock = clock

    def live(self) -> float:
        return self.test_clock.now

    def resume(self, base: float) -> None:
        pass


STORE_ARGS = dict(lease_ttl_s=TTL, epoch=0, events_per_worker=16)


class JournalMachine(KVStoreMachine):
    def __init__(self) -> None:
        super().__init__()
        self.entries: list[tuple[int, bytes]] = []
        self.snapshot_blob: bytes | None = None
        # Reservation ids from a counter, as in the base machine: hypothesis draws from them and
        # needs the same ids when it replays an example.
        self.ids = (f"j-{i:06d}" for i in range(10**9))
        self.store = JournaledStore(STORE_ARGS, self.entries_sink(), clock=HandClock(self.clock),
                                    ids=lambda: next(self.ids))
        self.restarts = 0

    def entries_sink(self):
        return lambda seq, entry: self.entries.append((seq, entry))

    def take_snapshot(self) -> None:
        self.snapshot_blob = self.store.snapshot()

    def recovered(self) -> JournaledStore:
        return JournaledStore.recover(STORE_ARGS, self.snapshot_blob, self.entries, self.entries_sink(),
                                      clock=HandClock(self.clock), ids=lambda: next(self.ids))

    @rule(snapshot_first=st.booleans())
    def restart(self, snapshot_first):
        if snapshot_first:
            self.take_snapshot()
        before = durable_fingerprint(self.store)
        self.store = self.recovered()
        self.restarts += 1
        assert durable_fingerprint(self.store) == before, "recovery did not reproduce the state"


class RedisMachine(JournalMachine):
    url = ""  # set by the test from the redis_server fixture

    def __init__(self) -> None:
        from services.kvstore.redis_backend import RedisLog
        from tests.redis_server import unique_prefix

        self.log = RedisLog(self.url, prefix=unique_prefix(), lease_ms=600_000)  # nobody renews it here
        assert self.log.try_acquire()
        super().__init__()

    def entries_sink(self):
        return lambda seq, entry: self.log.append(seq, [entry])

    def take_snapshot(self) -> None:
        self.log.write_snapshot(self.store.seq, self.store.snapshot())

    def recovered(self) -> JournaledStore:
        return self.log.load(STORE_ARGS, self.entries_sink(), clock=HandClock(self.clock), ids=lambda: next(self.ids))

    def teardown(self) -> None:
        self.log.wipe()
        self.log.close()


DURABLE_SETTINGS = settings(
    max_examples=25,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_state_machine_journal_with_restarts():
    run_state_machine_as_test(JournalMachine, settings=DURABLE_SETTINGS)


def test_state_machine_redis_with_restarts(redis_server):
    RedisMachine.url = redis_server.url
    run_state_machine_as_test(RedisMachine, settings=DURABLE_SETTINGS)
