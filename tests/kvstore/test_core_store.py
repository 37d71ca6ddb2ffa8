"""The kvstore core verbs, in process: exact block ids, eviction order, atomicity of every verb
(a rejected call changes nothing), idempotency, dedup, leases, incarnations and events."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from services.common.spec import SpecMode
from services.kvstore import EventKind, ExtendItem, KVStore, TrimItem
from services.kvstore.block_pool import BlockPool
from services.kvstore.keys import KeyStream, Namespace, chain_key
from services.kvstore.radix_trie import RadixTrie


def reserve(store, w, request_id, tokens, **kw):
    return store.reserve(worker_id=w.worker_id, incarnation=w.incarnation, request_id=request_id, tokens=tokens, **kw)


def release(store, r, final=None, new=()):
    return store.release(reservation_id=r.reservation_id, incarnation=r.incarnation, new_tokens=new, final_positions=final)


class pool_of:
    """The worker's pool as the read-only view shows it."""

    def __init__(self, store, worker_id="w0"):
        self.view, self.worker_id = store.view(), worker_id

    def free_ids(self):
        return self.view.free_ids(self.worker_id)

    def eviction_order(self):
        return self.view.eviction_order(self.worker_id)

    def pins(self):
        return self.view.pins(self.worker_id)


def usage(store, worker_id="w0"):
    [info] = [w for w in store.list_workers() if w.worker_id == worker_id]
    return info.pool.free, info.pool.cached, info.pool.in_use


def test_block_ids_through_reserve_publish_release(store, make_spec):
    w = store.register_worker(make_spec())
    r = reserve(store, w, "a", list(range(1, 11)), headroom_positions=2)  # 10 + 2 -> 3 blocks
    assert (r.block_table, r.reused_positions, r.capacity_positions, r.published_blocks) == ((0, 1, 2), 0, 12, 0)
    assert pool_of(store).free_ids() == [3, 4, 5, 6, 7]
    p = store.publish(reservation_id=r.reservation_id, incarnation=r.incarnation, new_tokens=[11], final_positions=10)
    assert (p.newly_published, p.deduplicated, p.reservation.published_blocks, p.reservation.num_tokens) == (2, 0, 2, 11)
    done = release(store, r)
    assert (done.freed_blocks, done.unpinned_blocks, done.newly_published) == (1, 2, 0)
    assert pool_of(store).free_ids() == [3, 4, 5, 6, 7, 2]  # freed blocks go to the tail
    assert usage(store) == (6, 2, 0)
    # The continuation hits both published blocks and gets the head of the free queue.
    r2 = reserve(store, w, "b", list(range(1, 12)) + [50])
    assert (r2.block_table, r2.reused_positions) == ((0, 1, 3), 8)
    assert usage(store) == (5, 0, 3)
    assert store.check_invariants() == []


def test_eviction_takes_lru_leaves_first_and_match_does_not_touch_the_clock(store, make_spec):
    w = store.register_worker(make_spec())
    x = reserve(store, w, "x", list(range(1, 13)))  # blocks 0,1,2 hold x0-x1-x2
    release(store, x, final=12)
    y = reserve(store, w, "y", [20, 21, 22, 23, 24])  # blocks 3,4; block 3 holds y0
    release(store, y, final=5)
    z = reserve(store, w, "z", [1, 2, 3, 4, 30, 31, 32, 33, 34])  # reuses x0; blocks 5,6
    assert (z.block_table, z.reused_positions) == ((0, 5, 6), 4)
    release(store, z, final=9)  # block 5 holds z1 under x0; x0 touched last
    pool = pool_of(store)
    assert pool.free_ids() == [7, 4, 6]
    # Leaves now: x2 (oldest), y0, z1. x1 and x0 are pinned by their resident children.
    assert pool.eviction_order() == [2, 3, 5]
    before = (pool.eviction_order(), pool.free_ids(), store.view().tick())
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [20, 21, 22, 23, 24], [1, 2, 3, 4, 30, 31, 32, 33, 34]):
        assert store.match(prompt)[0].reusable_positions > 0
    assert (pool.eviction_order(), pool.free_ids(), store.view().tick()) == before
    # Needing all 8 blocks: the 3 free ones first, then x2, x1 (now a leaf, same old tick),
    # y0, z1 (deeper than x0, same tick), x0.
    big = reserve(store, w, "big", list(range(60, 92)))
    assert big.block_table == (7, 4, 6, 2, 1, 3, 5, 0)
    removed = [e for e in store.events_since("w0", 0) if e.kind is EventKind.REMOVED]
    assert [e.block_ids for e in removed] == [(2, 1, 3, 5, 0)]
    assert store.stats().workers[0].evictions == 5 and store.stats().trie_nodes == 0
    assert store.check_invariants() == []


def test_pool_orders_evictable_blocks_by_tick_then_depth_then_id():
    """Block-level LRU order (tick, deeper first, lower id) with whole runs evicted at once:
    runs of equal tick interleave block by block, by depth and then id."""
    pool, trie = BlockPool(11, "w"), RadixTrie()
    root = trie.root_or_create(Namespace("m", 1, SpecMode.NONE, 0))
    ids = pool.take_free(11)
    assert ids == list(range(11))

    def leaf(first_token, block_ids, tick):
        content = np.arange(first_token, first_token + len(block_ids), dtype="<u4").tobytes()
        run = trie.attach(root, None, content, block_ids, "w", tick=1)
        pool.unpin_chain(run, tick)

    leaf(100, [0, 1], 7)  # X: depths 1, 2
    leaf(200, [5, 6, 7, 8, 2], 7)  # Y: depths 1..5
    leaf(300, [3], 6)  # Z
    leaf(400, [9, 10, 4], 8)  # W
    assert pool.eviction_order() == [3, 2, 1, 4]  # last blocks of the leaf runs
    assert pool.available(0) == 11 and pool.num_free == 0
    victims: list[int] = []
    pool.evict(11, trie, victims, None)
    # tick 6: Z; tick 7: Y5 Y4 Y3, then depth 2: X (id 1) before Y (6), depth 1: X (0) before Y (5)
    assert victims == [3, 2, 8, 7, 1, 6, 0, 5, 4, 10, 9]
    assert (trie.num_nodes, trie.num_blocks, pool.num_in_use, pool.num_cached) == (0, 0, 11, 0)
    assert pool.audit("pool", [], [victims]) == []


def test_partial_eviction_splits_a_run_other_workers_share(store, make_spec):
    """Evicting only the tail of a run that another worker also holds cuts the node in two:
    the other worker keeps all its blocks, this one keeps the head."""
    a = store.register_worker(make_spec("a", num_blocks=6))
    b = store.register_worker(make_spec("b", num_blocks=6))
    prompt = list(range(1, 18))  # 4 keyed blocks of 4
    for w in (a, b):
        release(store, reserve(store, w, f"p-{w.worker_id}", prompt), final=16)
    assert store.view().runs("a") == [(1, (0, 1, 2, 3))] and store.stats().trie_runs == 1
    r = reserve(store, a, "big", list(range(40, 51)))  # 3 blocks: 2 free + the deepest cached one
    assert r.block_table == (5, 4, 3)  # the free queue (5, then 4 freed by the release), then the LRU block
    assert store.view().runs("a") == [(1, (0, 1, 2))]
    assert store.view().runs("b") == [(1, (0, 1, 2)), (4, (3,))]
    assert (store.stats().trie_runs, store.stats().trie_nodes) == (2, 4)
    found = {m.worker_id: m.reusable_blocks for m in store.match(prompt)}
    assert found == {"a": 3, "b": 4}
    removed = [e for e in store.events_since("a", 0) if e.kind is EventKind.REMOVED]
    assert [e.block_ids for e in removed] == [(3,)]
    assert store.check_invariants() == []


def test_reserve_is_idempotent_per_request_id(store, make_spec, fingerprint):
    w = store.register_worker(make_spec())
    r = reserve(store, w, "a", [1, 2, 3, 4, 5], headroom_positions=3)
    before = fingerprint(store)
    assert reserve(store, w, "a", np.array([1, 2, 3, 4, 5], dtype=np.uint32), headroom_positions=3) == r
    assert fingerprint(store) == before
    for args in (dict(tokens=[1, 2, 3, 4, 6], headroom_positions=3), dict(tokens=[1, 2, 3, 4, 5]),
                 dict(tokens=[1, 2, 3, 4, 5], headroom_positions=3, cache_salt=b"t")):
        with pytest.raises(InvalidArgument):
            reserve(store, w, "a", **args)
    assert fingerprint(store) == before
    # After the reservation ended, the request id starts a new one.
    release(store, r)
    assert reserve(store, w, "a", [1, 2, 3, 4, 5], headroom_positions=3).reservation_id != r.reservation_id


def test_resource_exhausted_is_all_or_nothing_and_counts_pins(store, make_spec, fingerprint):
    w = store.register_worker(make_spec(num_blocks=4))
    prompt = list(range(1, 13))
    a = reserve(store, w, "a", prompt)  # 3 blocks
    before = fingerprint(store)
    with pytest.raises(ResourceExhausted, match="needs 2 .* only 1"):
        reserve(store, w, "b", list(range(40, 48)))
    assert fingerprint(store) == before
    release(store, a, final=12)  # 3 cached + 1 free
    # n = 13 reuses all 3 cached blocks and needs 1 more: fits exactly.
    b = reserve(store, w, "b", prompt + [13])
    assert (b.reused_positions, b.block_table) == (12, (0, 1, 2, 3))
    release(store, b)
    # With 4 more positions it needs 2 fresh blocks; free + cached = 4 but 3 of the cached ones
    # are the blocks this request itself pins, so only 1 can be had.
    before = fingerprint(store)
    with pytest.raises(ResourceExhausted, match="needs 2 .* only 1"):
        reserve(store, w, "c", prompt + [13], headroom_positions=4)
    assert fingerprint(store) == before
    assert store.check_invariants() == []


def test_reserve_first_takes_the_first_live_candidate_with_room(store, make_spec, fingerprint):
    a = store.register_worker(make_spec("a", num_blocks=2))
    b = store.register_worker(make_spec("b", num_blocks=8))
    prompt = list(range(1, 10))  # 3 blocks: more than a has
    stale = ("b", b.incarnation + 7)
    before = fingerprint(store)
    with pytest.raises(ResourceExhausted, match="'a' needs 3"):
        store.reserve_first(candidates=[stale, ("a", a.incarnation), ("nobody", 1)], request_id="q", tokens=prompt)
    with pytest.raises(FailedPrecondition, match="no candidate worker is live"):
        store.reserve_first(candidates=[stale, ("nobody", 1)], request_id="q", tokens=prompt)
    with pytest.raises(InvalidArgument):
        store.reserve_first(candidates=[], request_id="q", tokens=prompt)
    assert fingerprint(store) == before
    cands = [stale, ("a", a.incarnation), ("b", b.incarnation)]
    r = store.reserve_first(candidates=cands, request_id="q", tokens=prompt)
    assert (r.worker_id, r.block_table) == ("b", (0, 1, 2))
    # A retry (e.g. after a lost answer) returns the same reservation, even though a has room now.
    store.register_worker(make_spec("a", num_blocks=8))
    a2 = store.list_workers()[0]
    assert store.reserve_first(candidates=[("a", a2.incarnation), ("b", b.incarnation)], request_id="q",
                               tokens=prompt) == r
    assert store.stats().reservations_created == 1 and store.check_invariants() == []


def test_extend_and_trim_apply_each_item_atomically(store, make_spec, fingerprint):
    w = store.register_worker(make_spec(num_blocks=8, max_seq_len=40))
    a = reserve(store, w, "a", list(range(1, 10)))  # 9 tokens -> blocks 0,1,2
    b = reserve(store, w, "b", [50, 51, 52])  # block 3
    store.publish(reservation_id=a.reservation_id, incarnation=a.incarnation, final_positions=8)
    res = store.extend([
        ExtendItem(a.reservation_id, a.incarnation, 40),  # 10 blocks: more than the pool
        ExtendItem(b.reservation_id, b.incarnation, 9),  # +2 blocks
        ExtendItem(b.reservation_id, b.incarnation, 5),  # already enough: no-op
        ExtendItem("r-nope", a.incarnation, 8),
        ExtendItem(a.reservation_id, a.incarnation + 1, 16),
        ExtendItem(a.reservation_id, a.incarnation, 44),  # past max_seq_len
        ExtendItem(a.reservation_id, a.incarnation, -1),
    ])
    assert [type(r.error) for r in res] == [ResourceExhausted, type(None), type(None), NotFound,
                                            FailedPrecondition, InvalidArgument, InvalidArgument]
    assert res[0].block_table == (0, 1, 2) and res[0].capacity_positions == 12
    assert (res[1].block_table, res[1].added_blocks, res[1].capacity_positions) == ((3, 4, 5), (4, 5), 12)
    assert res[2].ok and res[2].block_table == (3, 4, 5) and res[2].added_blocks == ()
    before = fingerprint(store)
    res = store.trim([
        TrimItem(a.reservation_id, a.incarnation, 4),  # below its 2 published blocks
        TrimItem(a.reservation_id, a.incarnation, 8),  # below its 9 known tokens
        TrimItem(b.reservation_id, b.incarnation + 1, 3),
    ])
    assert [type(r.error) for r in res] == [FailedPrecondition, InvalidArgument, FailedPrecondition]
    assert fingerprint(store) == before
    res = store.trim([TrimItem(b.reservation_id, b.incarnation, 3), TrimItem(a.reservation_id, a.incarnation, 9)])
    assert (res[0].block_table, res[0].freed_blocks, res[0].capacity_positions) == ((3,), (4, 5), 4)
    assert (res[1].block_table, res[1].freed_blocks) == ((0, 1, 2), ())
    assert pool_of(store).free_ids() == [6, 7, 4, 5]
    assert store.check_invariants() == []


def test_publish_dedups_against_the_copy_already_on_the_worker(store, make_spec):
    w = store.register_worker(make_spec())
    prompt = list(range(1, 10))  # 9 tokens: 2 keyed blocks, 3 blocks of capacity
    a = reserve(store, w, "a", prompt)
    b = reserve(store, w, "b", prompt)
    assert (a.block_table, b.block_table) == ((0, 1, 2), (3, 4, 5))
    store.publish(reservation_id=a.reservation_id, incarnation=a.incarnation, final_positions=4)
    p = store.publish(reservation_id=b.reservation_id, incarnation=b.incarnation, final_positions=9)
    # b's block 0 is replaced by a's copy (3 freed); its block 1 is new in the trie.
    assert (p.reservation.block_table, p.deduplicated, p.newly_published) == ((0, 4, 5), 1, 1)
    p = store.publish(reservation_id=a.reservation_id, incarnation=a.incarnation, final_positions=9)
    assert (p.reservation.block_table, p.deduplicated, p.newly_published) == ((0, 4, 2), 1, 0)
    assert pool_of(store).free_ids() == [6, 7, 3, 1]
    assert pool_of(store).pins()[0] == 2 and pool_of(store).pins()[4] == 2
    stored = [e for e in store.events_since("w0", 0) if e.kind is EventKind.STORED]
    assert [(e.block_ids, e.parent_key) for e in stored] == [((0,), stored[0].parent_key), ((4,), stored[0].block_keys[0])]
    release(store, a)
    release(store, b)
    assert usage(store) == (6, 2, 0)
    st = store.stats().workers[0]
    assert (st.published_blocks, st.deduplicated_blocks) == (2, 2)
    assert store.check_invariants() == []


def test_publish_rejects_bad_input_without_appending(store, make_spec, fingerprint):
    w = store.register_worker(make_spec(vocab_size=100, max_seq_len=12))
    r = reserve(store, w, "a", [1, 2, 3, 4, 5])  # 5 tokens, capacity 8
    before = fingerprint(store)
    bad = [
        dict(new_tokens=[], final_positions=6),  # more final positions than known tokens
        dict(new_tokens=[6, 7, 8, 9], final_positions=9),  # more than the capacity
        dict(new_tokens=[6, 100], final_positions=4),  # token id >= vocab
        dict(new_tokens=list(range(9)), final_positions=4),  # 14 > max_seq_len + 1
        dict(new_tokens=[6], final_positions=-1),
    ]
    for kw in bad:
        with pytest.raises(InvalidArgument):
            store.publish(reservation_id=r.reservation_id, incarnation=r.incarnation, **kw)
    with pytest.raises(FailedPrecondition):
        store.publish(reservation_id=r.reservation_id, incarnation=r.incarnation + 1, final_positions=4)
    with pytest.raises(NotFound):
        store.publish(reservation_id="r-0-99", incarnation=r.incarnation, final_positions=4)
    assert fingerprint(store) == before
    assert store.get_reservation(r.reservation_id).num_tokens == 5


def test_suspend_then_reserve_again_hits_its_own_prefix(store, make_spec):
    w = store.register_worker(make_spec(spec_mode=SpecMode.EAGLE3))
    prompt = list(range(1, 8))
    r = reserve(store, w, "req", prompt, headroom_positions=4)
    generated = [20, 21, 22, 23]
    done = store.suspend(reservation_id=r.reservation_id, incarnation=r.incarnation, new_tokens=generated,
                         final_positions=10)
    assert done.newly_published == 2  # 11 tokens, D = 1: 10 keyed positions, 10 final -> 2 blocks
    again = reserve(store, w, "req", prompt + generated)
    assert again.reused_positions == 8 and again.reservation_id != r.reservation_id
    assert store.check_invariants() == []


def test_abort_publishes_nothing_and_is_idempotent(store, make_spec):
    w = store.register_worker(make_spec())
    r = reserve(store, w, "a", list(range(1, 10)))
    assert store.abort(reservation_id=r.reservation_id, incarnation=r.incarnation, worker_id=r.worker_id) is True
    assert usage(store) == (8, 0, 0) and store.match(list(range(1, 10)))[0].reusable_positions == 0
    assert store.abort(reservation_id=r.reservation_id, incarnation=r.incarnation, worker_id=r.worker_id) is False
    with pytest.raises(FailedPrecondition):
        store.abort(reservation_id=r.reservation_id, incarnation=r.incarnation + 5)
    with pytest.raises(NotFound):
        store.abort(reservation_id="r-0-77", incarnation=r.incarnation)
    with pytest.raises(FailedPrecondition, match="ended"):
        release(store, r)
    # A published prefix survives an abort of a later user of it, unpinned.
    b = reserve(store, w, "b", list(range(1, 10)))
    release(store, b, final=9)
    c = reserve(store, w, "c", list(range(1, 10)) + [40])
    store.publish(reservation_id=c.reservation_id, incarnation=c.incarnation, new_tokens=[41], final_positions=10)
    assert store.abort(reservation_id=c.reservation_id, incarnation=c.incarnation, worker_id=c.worker_id)
    assert usage(store) == (6, 2, 0)
    assert store.check_invariants() == []


@pytest.mark.parametrize(
    "bad",
    [
        dict(block_size=3), dict(block_size=0), dict(block_size=2048), dict(num_blocks=0),
        dict(spec_mode=99), dict(mtp_depth=-1), dict(vocab_size=0), dict(max_seq_len=0),
        dict(worker_id=""), dict(num_blocks=2.5), dict(num_blocks=True),
    ],
)
def test_register_rejects_bad_specs_and_changes_nothing(store, make_spec, fingerprint, bad):
    w = store.register_worker(make_spec())
    reserve(store, w, "a", [1, 2, 3])
    before = fingerprint(store)
    with pytest.raises(InvalidArgument):
        store.register_worker(make_spec(**{"worker_id": "w0", **bad}))
    assert fingerprint(store) == before


def test_reregistration_replaces_the_incarnation(store, make_spec):
    w = store.register_worker(make_spec())
    other = store.register_worker(make_spec("w1"))
    r = reserve(store, w, "a", list(range(1, 10)))
    store.publish(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=9)
    assert store.stats().trie_nodes == 2
    w2 = store.register_worker(make_spec(num_blocks=5))
    assert w.incarnation < other.incarnation < w2.incarnation
    assert usage(store) == (5, 0, 0) and store.stats().trie_nodes == 0
    assert store.events_since("w0", 0)[-1].kind is EventKind.CLEARED
    assert store.events_since("w0", 0)[-1].incarnation == w.incarnation
    with pytest.raises(FailedPrecondition):
        release(store, r)
    assert store.abort(reservation_id=r.reservation_id, incarnation=r.incarnation, worker_id=r.worker_id) is False
    with pytest.raises(FailedPrecondition):
        reserve(store, w, "b", [1, 2])  # the old incarnation
    assert reserve(store, w2, "a", [1, 2]).block_table == (0,)
    assert store.check_invariants() == []


def test_lapsed_lease_drops_the_worker(store, clock, make_spec):
    w = store.register_worker(make_spec())
    r = reserve(store, w, "a", list(range(1, 10)))
    clock.advance(9.5)
    assert store.heartbeat("w0", w.incarnation) == 10.0
    with pytest.raises(FailedPrecondition):
        store.heartbeat("w0", w.incarnation + 1)
    clock.advance(9.5)
    assert [i.worker_id for i in store.list_workers()] == ["w0"]
    assert store.list_workers()[0].lease_expires_in_s == pytest.approx(0.5)
    clock.advance(0.5)
    assert store.expire_leases() == ["w0"]
    assert store.list_workers() == [] and store.match([1, 2, 3]) == []
    assert store.events_since("w0", 0)[-1].kind is EventKind.CLEARED
    with pytest.raises(NotFound):
        store.heartbeat("w0", w.incarnation)
    with pytest.raises(FailedPrecondition):
        store.publish(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=4)
    assert store.stats().live_reservations == 0 and store.check_invariants() == []


def test_lease_lapse_is_noticed_by_any_verb(store, clock, make_spec):
    w = store.register_worker(make_spec())
    store.register_worker(make_spec("w1"))
    r = reserve(store, w, "a", [1, 2, 3, 4, 5])
    clock.advance(5)
    store.heartbeat("w1", store.list_workers()[1].incarnation)
    clock.advance(5)
    with pytest.raises(FailedPrecondition, match="ended"):
        store.get_reservation(r.reservation_id)
    assert [i.worker_id for i in store.list_workers()] == ["w1"]


def test_stale_incarnation_is_rejected_by_every_mutating_verb(store, make_spec, fingerprint):
    w = store.register_worker(make_spec())
    r = reserve(store, w, "a", list(range(1, 10)))
    stale = w.incarnation + 1
    before = fingerprint(store)
    calls = [
        lambda: store.heartbeat("w0", stale),
        lambda: store.reserve(worker_id="w0", incarnation=stale, request_id="b", tokens=[1]),
        lambda: store.publish(reservation_id=r.reservation_id, incarnation=stale, final_positions=4),
        lambda: store.release(reservation_id=r.reservation_id, incarnation=stale, final_positions=4),
        lambda: store.suspend(reservation_id=r.reservation_id, incarnation=stale),
        lambda: store.abort(reservation_id=r.reservation_id, incarnation=stale),
    ]
    for call in calls:
        with pytest.raises(FailedPrecondition):
            call()
    for verb, item in ((store.extend, ExtendItem), (store.trim, TrimItem)):
        [res] = verb([item(r.reservation_id, stale, 12)])
        assert isinstance(res.error, FailedPrecondition) and res.block_table == r.block_table
    assert fingerprint(store) == before


def test_reserve_validates_its_input_and_changes_nothing(clock, make_spec, fingerprint):
    store = KVStore(clock=clock, epoch=0, max_tokens=32)
    w = store.register_worker(make_spec(vocab_size=100, max_seq_len=20))
    before = fingerprint(store)
    bad = [
        dict(tokens=[]), dict(tokens=list(range(21))), dict(tokens=[1, 100]), dict(tokens=[1], headroom_positions=-1),
        dict(tokens=[1], request_id=""), dict(tokens=[1], cache_salt="salt"), dict(tokens=[1] * 33),
    ]
    for kw in bad:
        kw = {"request_id": "a", **kw}
        with pytest.raises(InvalidArgument):
            store.reserve(worker_id="w0", incarnation=w.incarnation, **kw)
    with pytest.raises(NotFound):
        store.reserve(worker_id="nope", incarnation=w.incarnation, request_id="a", tokens=[1])
    assert fingerprint(store) == before
    # Headroom is a hint: capacity is clamped to max_seq_len.
    r = reserve(store, w, "a", list(range(18)), headroom_positions=10)
    assert r.capacity_positions == 20


def test_match_reports_compatible_workers_only(store, make_spec):
    a = store.register_worker(make_spec("a", max_seq_len=64))
    store.register_worker(make_spec("b", max_seq_len=8))
    store.register_worker(make_spec("c", vocab_size=10))
    store.register_worker(make_spec("d", model_id="other"))
    r = reserve(store, a, "x", list(range(1, 13)))
    release(store, r, final=12)
    prompt = list(range(1, 13)) + [13]
    found = {m.worker_id: m for m in store.match(prompt, model_id="m")}
    assert sorted(found) == ["a"]  # b: too long, c: token ids >= vocab, d: another model
    assert (found["a"].reusable_positions, found["a"].reusable_blocks) == (12, 3)
    assert (found["a"].pool.cached, found["a"].live_reservations) == (3, 0)
    assert sorted(m.worker_id for m in store.match([1, 2, 3])) == ["a", "b", "c", "d"]
    assert store.stats().matches == 2


def test_events_are_sequenced_buffered_and_pushed(clock, make_spec):
    store = KVStore(clock=clock, epoch=0, events_per_worker=3)
    seen = []
    unsubscribe = store.subscribe(lambda wid, e: seen.append((wid, e.seq, e.kind)))
    store.subscribe(lambda wid, e: 1 / 0)  # a broken subscriber must not break the store
    w = store.register_worker(make_spec())
    for i in range(4):
        r = reserve(store, w, f"q{i}", [10 * i + k for k in range(1, 6)])
        release(store, r, final=4)
    assert [s[1] for s in seen] == [1, 2, 3, 4]
    assert all(s[2] is EventKind.STORED for s in seen)
    assert [e.seq for e in store.events_since("w0", 0)] == [2, 3, 4]  # ring of 3
    assert [e.seq for e in store.events_since("w0", 3)] == [4]
    unsubscribe()
    w = store.register_worker(make_spec())  # CLEARED, seq keeps counting
    assert [e.seq for e in store.events_since("w0", 4)] == [5] and len(seen) == 4
    with pytest.raises(NotFound):
        store.events_since("nobody", 0)


def test_large_publishes_and_evictions_become_bounded_events(clock, make_spec):
    """No event lists more than ``max_blocks`` blocks: a big publish is several STORED events,
    each chained to the previous one by its parent key, and the keys are those of one event."""
    store = KVStore(clock=clock, epoch=0, events_per_worker=64, max_blocks_per_event=3)  # default 1,024
    w = store.register_worker(make_spec(num_blocks=8, max_seq_len=64))
    r = reserve(store, w, "a", list(range(1, 30)))  # 8 blocks, 7 keyed
    release(store, r, final=28)
    stored = store.events_since("w0", 0)
    assert [(e.kind, len(e.block_ids)) for e in stored] == [(EventKind.STORED, 3), (EventKind.STORED, 3), (EventKind.STORED, 1)]
    assert [e.seq for e in stored] == [1, 2, 3]
    assert stored[1].parent_key == stored[0].block_keys[-1] and stored[2].parent_key == stored[1].block_keys[-1]
    assert sum((e.block_ids for e in stored), ()) == tuple(range(7))
    reserve(store, w, "b", list(range(40, 72)))  # all 8 blocks: evicts the 7 published ones
    removed = store.events_since("w0", 3)
    assert [len(e.block_ids) for e in removed] == [3, 3, 1] and all(e.kind is EventKind.REMOVED for e in removed)
    assert sum((e.block_keys for e in removed), ()) == sum((e.block_keys for e in stored), ())[::-1]
    assert store.check_invariants() == []


def test_events_are_off_unless_asked_for(clock, make_spec):
    store = KVStore(clock=clock, epoch=0)
    w = store.register_worker(make_spec())
    release(store, reserve(store, w, "a", list(range(1, 10))), final=9)
    with pytest.raises(FailedPrecondition, match="events are off"):
        store.events_since("w0", 0)
    assert store.view().last_seq("w0") == 0 and store.check_invariants() == []


def test_stats_count_requests_hits_and_evictions(store, make_spec):
    w = store.register_worker(make_spec(num_blocks=4))
    r = reserve(store, w, "a", list(range(1, 10)))
    release(store, r, final=9)
    r = reserve(store, w, "b", list(range(1, 10)) + [60, 61, 62, 63])  # reuses 2 blocks
    release(store, r, final=13)
    r = reserve(store, w, "c", list(range(70, 86)))  # needs all 4: evicts 3
    st = store.stats("w0")
    assert (st.reservations_created, st.live_reservations, st.trie_nodes) == (3, 1, 0)
    [ws] = st.workers
    assert (ws.requested_positions, ws.reused_positions, ws.evictions, ws.published_blocks) == (38, 8, 3, 3)
    with pytest.raises(NotFound):
        store.stats("nobody")


def _runs(store, worker_id="w0"):
    """The worker's runs, shallowest first (white box: the corruption test needs the objects)."""
    trie = store._trie
    return sorted((n.residency[worker_id] for n in trie.iter_nodes() if worker_id in n.residency),
                  key=lambda r: r.node.depth)


@pytest.mark.parametrize(
    "corrupt, expected",
    [
        (lambda s, p, r: setattr(r[0], "ref", 2), "live pins"),
        (lambda s, p, r: p._free.append(5), "held [2] times"),
        (lambda s, p, r: setattr(p, "num_cached", p.num_cached + 1), "counters"),
        (lambda s, p, r: r[1].node.residency.clear(), "resident nowhere"),
        (lambda s, p, r: setattr(r[0], "resident_children", 0), "resident children"),
        (lambda s, p, r: setattr(r[1], "parent", None), "does not link the run of its parent"),
        (lambda s, p, r: r[1].node.keys.__setitem__(0, b"\0" * 32), "does not chain"),
        (lambda s, p, r: r[1].ids.append(6), "block for block"),
        (lambda s, p, r: s._reservations.popitem(), "index sizes"),
    ],
)
def test_audit_reports_corruption(store, make_spec, corrupt, expected):
    w = store.register_worker(make_spec())
    r = reserve(store, w, "a", list(range(1, 10)))
    store.publish(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=4)
    store.publish(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=9)
    assert store.check_invariants() == [] and len(_runs(store)) == 2
    corrupt(store, store._workers["w0"].pool, _runs(store))
    violations = store.check_invariants()
    assert any(expected in v for v in violations), violations


def test_match_sees_every_trie_change_between_calls(store, make_spec):
    """Match and Reserve answer from the trie as it is now: any node added or pruned since the
    previous Match must show up in the answer."""
    w = store.register_worker(make_spec())
    prompt = list(range(1, 10))  # 2 keyed blocks of 4 at D = 0
    a = reserve(store, w, "a", prompt)
    b = reserve(store, w, "b", [50, 51, 52, 53])
    assert store.match(prompt)[0].reusable_positions == 0
    store.publish(reservation_id=a.reservation_id, incarnation=a.incarnation, final_positions=9)
    assert store.match(prompt)[0].reusable_positions == 8  # nodes added since the last walk
    release(store, a)
    assert store.match(prompt)[0].reusable_positions == 8
    [grown] = store.extend([ExtendItem(b.reservation_id, b.incarnation, 32)])  # evicts both, no walk
    assert grown.ok and store.stats().trie_nodes == 0
    assert store.match(prompt)[0].reusable_positions == 0  # nodes pruned since the last walk
    release(store, store.get_reservation(b.reservation_id))
    assert reserve(store, w, "d", prompt).reused_positions == 0
    assert store.check_invariants() == []


def _reference_reusable(store, tokens, worker_id="w0"):
    """Reusable positions by a plain block-by-block walk (one block per step, inside runs too)."""
    view = store.view()
    namespace = view.namespace(worker_id)
    stream = KeyStream.from_tokens(tokens, namespace.span, namespace.block_size)
    node, used = store._trie.root(namespace), 0
    reused = 0
    for j in range(stream.reusable_block_cap):
        if node is None:
            break
        content = stream.block_content(j)
        if used < node.size:
            ok = node.content[node.end_of(used) : node.end_of(used + 1)] == content
            used += 1
        else:
            node, used = node.children.get(content), 1
            ok = node is not None
        if not ok or worker_id not in node.residency:
            break
        reused += 1
    return reused * namespace.block_size


def test_walk_along_chains_matches_a_block_by_block_walk(store, make_spec):
    """Match compares a whole run with one slice compare; prompts that leave a run mid-way,
    branch into another run, or run into a run whose tail was evicted must get exactly what a
    block-by-block walk finds."""
    w = store.register_worker(make_spec(num_blocks=16, max_seq_len=128))
    a = list(range(1, 33))  # 8 blocks of 4
    r = reserve(store, w, "a", a + [99])
    release(store, r, final=32)
    b = a[:12] + list(range(60, 80))  # shares 3 blocks with a, then a new chain of 5
    r = reserve(store, w, "b", b + [99])
    release(store, r, final=32)
    rng = np.random.default_rng(7)
    prompts = [a + [5], b + [5], a[:20] + [0] * 9, b[:25] + [1] * 7, a[:12] + list(range(60, 70)) + a[22:]]
    prompts += [a[:k] for k in range(1, 33)] + [b[:k] for k in range(1, 33)]  # the last position never counts
    for _ in range(40):  # random splices of the two chains and noise
        cut1, cut2 = sorted(rng.integers(0, 33, size=2))
        prompts.append(a[:cut1] + b[cut1:cut2] + list(rng.integers(1, 90, size=int(rng.integers(1, 9)))))
    for p in prompts:
        assert store.match(p)[0].reusable_positions == _reference_reusable(store, p), p
    r = reserve(store, w, "c", [90] * 21)  # 6 blocks: evicts the tails of both chains (LRU leaves)
    assert store.stats().workers[0].evictions > 0
    for p in prompts:
        assert store.match(p)[0].reusable_positions == _reference_reusable(store, p), p
    release(store, r, final=20)
    assert store.check_invariants() == []


def test_event_keys_stay_right_after_evicted_blocks_are_reused(store, make_spec):
    """Events carry keys computed when they were recorded; blocks evicted and published again
    under other prompts must not change what earlier events say."""
    w = store.register_worker(make_spec())  # 8 blocks of 4, D = 0

    def expected_keys(tokens, count):
        stream = KeyStream.from_tokens(tokens, 0, 4)
        key = store.view().namespace("w0").root_key()
        out = []
        for j in range(count):
            key = chain_key(key, stream.block_key_material(j))
            out.append(key)
        return out

    a, b, c = list(range(1, 18)), list(range(40, 72)), list(range(80, 100))
    r = reserve(store, w, "a", a)  # 5 blocks
    store.publish(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=8)
    store.publish(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=16)
    release(store, r)
    r = reserve(store, w, "b", b)  # 8 blocks: evicts a3, a2, a1, a0
    release(store, r, final=28)  # 7 blocks published, on nodes refilled from a's
    r = reserve(store, w, "c", c)  # 5 blocks: evicts b's leaves, their nodes refilled again
    release(store, r, final=16)
    ka, kb, kc = expected_keys(a, 4), expected_keys(b, 7), expected_keys(c, 4)
    root = store.view().namespace("w0").root_key()
    got = [(e.kind, list(e.block_keys), e.parent_key) for e in store.events_since("w0", 0)]
    assert got[:4] == [
        (EventKind.STORED, ka[:2], root),
        (EventKind.STORED, ka[2:], ka[1]),
        (EventKind.REMOVED, ka[::-1], None),
        (EventKind.STORED, kb, root),
    ]
    assert got[4][0] is EventKind.REMOVED and got[4][1] == kb[::-1][: len(got[4][1])]
    assert got[5:] == [(EventKind.STORED, kc, root)]
    assert store.check_invariants() == []
