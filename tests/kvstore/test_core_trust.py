"""The kvstore core's side of issue 8: two-phase end of a reservation, owner checks, random
reservation ids and bounded work per call (pure, no gRPC)."""

from __future__ import annotations

import re

import pytest

from services.common.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from services.kvstore import ExtendItem, KVStore, TrimItem

P = list(range(1, 18))  # 17 tokens: 4 full blocks of 4


def _two_workers(store, make_spec):
    a = store.register_worker(make_spec("a"))
    b = store.register_worker(make_spec("b"))
    return a, b


def test_a_router_abort_holds_the_blocks_until_the_worker_confirms(store, make_spec):
    a, _ = _two_workers(store, make_spec)
    r = store.reserve(worker_id="a", incarnation=a.incarnation, request_id="q", tokens=P, headroom_positions=3)
    in_use = store.stats("a").workers[0].pool.in_use
    assert store.abort(reservation_id=r.reservation_id, incarnation=r.incarnation) is True  # the router
    stats = store.stats()
    assert (stats.live_reservations, stats.ending_reservations) == (0, 1)
    assert stats.workers[0].pool.in_use == in_use  # the worker may still be writing them
    assert store.ending_for("a", a.incarnation) == [r.reservation_id]
    assert store.check_invariants() == []
    with pytest.raises(FailedPrecondition):  # no longer live: nothing new may be computed into it
        store.publish(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=4, worker_id="a")
    # the request id is free again (the router may retry), while the old blocks stay held
    again = store.reserve(worker_id="a", incarnation=a.incarnation, request_id="q", tokens=P[:4])
    assert not set(again.block_table) & set(r.block_table)
    with pytest.raises(PermissionDenied):
        store.abort(reservation_id=r.reservation_id, incarnation=r.incarnation, worker_id="b")
    assert store.abort(reservation_id=r.reservation_id, incarnation=r.incarnation, worker_id="a") is True
    assert store.stats().ending_reservations == 0 and store.ending_for("a", a.incarnation) == []
    assert store.abort(reservation_id=r.reservation_id, incarnation=r.incarnation, worker_id="a") is False
    assert store.check_invariants() == []


def test_a_lease_lapse_frees_ending_reservations(store, make_spec, clock):
    a, _ = _two_workers(store, make_spec)
    r = store.reserve(worker_id="a", incarnation=a.incarnation, request_id="q", tokens=P)
    store.abort(reservation_id=r.reservation_id, incarnation=r.incarnation)
    clock.now += 11
    assert store.stats().ending_reservations == 0 and store.check_invariants() == []


def test_release_of_an_ending_reservation_frees_it_and_publishes_nothing(store, make_spec):
    a, _ = _two_workers(store, make_spec)
    r = store.reserve(worker_id="a", incarnation=a.incarnation, request_id="q", tokens=P)
    store.abort(reservation_id=r.reservation_id, incarnation=r.incarnation)
    res = store.release(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=16, worker_id="a")
    assert res.newly_published == 0 and res.freed_blocks == len(r.block_table)
    assert store.stats().trie_nodes == 0 and store.stats("a").workers[0].pool.in_use == 0


def test_a_worker_acts_only_on_its_own_reservations(store, make_spec, fingerprint):
    a, _ = _two_workers(store, make_spec)
    r = store.reserve(worker_id="a", incarnation=a.incarnation, request_id="q", tokens=P)
    before = fingerprint(store)
    for call in (
        lambda: store.publish(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=16, worker_id="b"),
        lambda: store.release(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=16, worker_id="b"),
        lambda: store.abort(reservation_id=r.reservation_id, incarnation=r.incarnation, worker_id="b"),
        lambda: store.get_reservation(r.reservation_id, r.incarnation, worker_id="b"),
    ):
        with pytest.raises(PermissionDenied):
            call()
    [ext] = store.extend([ExtendItem(r.reservation_id, r.incarnation, 32)], worker_id="b")
    [trim] = store.trim([TrimItem(r.reservation_id, r.incarnation, 17)], worker_id="b")
    assert isinstance(ext.error, PermissionDenied) and isinstance(trim.error, PermissionDenied)
    assert ext.block_table == () == trim.block_table  # nothing about another worker's table leaks
    assert fingerprint(store) == before
    assert store.reservation_prompt(r.reservation_id, r.incarnation, worker_id="a") == bytes(
        b for t in P for b in t.to_bytes(4, "little"))


def test_reservation_ids_are_random(store, make_spec):
    a, _ = _two_workers(store, make_spec)
    ids = [store.reserve(worker_id="a", incarnation=a.incarnation, request_id=f"q{i}", tokens=[i + 1]).reservation_id
           for i in range(6)]
    assert len(set(ids)) == 6 and all(re.fullmatch(r"r-[0-9a-f]{32}", i) for i in ids)


def test_work_per_call_is_bounded(make_spec, fingerprint):
    store = KVStore(max_num_blocks=100, max_items=3, max_workers=2)
    a = store.register_worker(make_spec("a"))
    store.register_worker(make_spec("b"))
    with pytest.raises(ResourceExhausted):
        store.register_worker(make_spec("c"))
    store.register_worker(make_spec("b", num_blocks=16))  # re-registering a known id is fine
    with pytest.raises(InvalidArgument):
        store.register_worker(make_spec("a", num_blocks=101))
    with pytest.raises(InvalidArgument):
        store.register_worker(make_spec("x" * 129))
    with pytest.raises(InvalidArgument):
        store.reserve(worker_id="a", incarnation=a.incarnation, request_id="é" * 65, tokens=[1])  # 130 bytes
    before = fingerprint(store)
    with pytest.raises(InvalidArgument):
        store.extend([ExtendItem("r-x", a.incarnation, 4)] * 4)
    with pytest.raises(InvalidArgument):
        store.trim([TrimItem("r-x", a.incarnation, 4)] * 4)
    assert fingerprint(store) == before
    with pytest.raises(Exception) as err:
        store.abort(reservation_id="z" * 10_000, incarnation=a.incarnation)
    assert len(str(err.value)) < 200  # ids are cut in messages
