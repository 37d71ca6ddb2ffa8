"""A worker that outlived the kvstore's memory re-registers with what it still holds
(``restore_worker``): its running reservations come back under the new incarnation, its cached
blocks come back into the trie, and the store's rules hold (invariants audited after each call).
Calls of the previous life are unknown until then, stale afterwards."""

from __future__ import annotations

import pytest

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.kvstore import HeldReservation, HeldSequence, KVStore
from services.kvstore.journal import JournaledStore



def _held(store: KVStore, r, tokens, published: int) -> HeldReservation:
    snap = store.get_reservation(r.reservation_id)
    return HeldReservation(r.reservation_id, r.request_id, list(tokens), b"", snap.block_table, published)


def _first_life(store, make_spec):
    """Worker w0 (block size 4, 16 blocks): a released request left 3 cached blocks, a running
    one reused 2 of them and published one more block of its own."""
    w = store.register_worker(make_spec(num_blocks=16))
    done = store.reserve(worker_id="w0", incarnation=w.incarnation, request_id="done", tokens=list(range(13)))
    store.release(reservation_id=done.reservation_id, incarnation=w.incarnation, final_positions=12)
    run = store.reserve(worker_id="w0", incarnation=w.incarnation, request_id="run",
                        tokens=list(range(8)) + [50, 51, 52, 53, 54], headroom_positions=8)
    assert run.reused_positions == 8
    tokens = list(range(8)) + [50, 51, 52, 53, 54]
    store.publish(reservation_id=run.reservation_id, incarnation=w.incarnation, final_positions=12)
    cached_ids = store.get_reservation(run.reservation_id).block_table[:2] + (done.block_table[2],)
    return w, run, tokens, HeldSequence(list(range(13)), b"", cached_ids)


def test_restore_brings_back_running_reservations_and_the_cache(store, make_spec, clock):
    w, run, tokens, seq = _first_life(store, make_spec)
    held = _held(store, run, tokens, 3)
    before = store.match(list(range(13)))[0].reusable_blocks
    # the kvstore restarts: a new life with a later epoch
    fresh = KVStore(clock=clock, lease_ttl_s=10.0, epoch=w.incarnation + 1000)
    with pytest.raises(NotFound):  # a verb of the previous life (the worker resends it, see the courier)
        fresh.publish(reservation_id=run.reservation_id, incarnation=w.incarnation, final_positions=12)
    result = fresh.restore_worker(make_spec(num_blocks=16), reservations=[held], cached=[seq])
    assert result.dropped == ()
    assert result.worker.incarnation > fresh.epoch
    (again,) = result.restored
    assert again.reservation_id == run.reservation_id and again.block_table == held.block_table
    assert again.published_blocks == 3 and again.num_tokens == len(tokens)
    assert fresh.check_invariants() == []
    assert fresh.match(list(range(13)))[0].reusable_blocks == before == 3
    usage = result.worker.pool
    assert (usage.in_use, usage.cached) == (len(held.block_table), 1)
    # the old incarnation is stale now; the new one carries on and ends it cleanly
    with pytest.raises(FailedPrecondition):
        fresh.publish(reservation_id=run.reservation_id, incarnation=w.incarnation, final_positions=12)
    fresh.publish(reservation_id=run.reservation_id, incarnation=result.worker.incarnation,
                  new_tokens=[55, 56, 57], final_positions=16, known_tokens=len(tokens))
    fresh.release(reservation_id=run.reservation_id, incarnation=result.worker.incarnation, final_positions=16)
    assert fresh.check_invariants() == []
    assert fresh.stats().workers[0].pool.in_use == 0


def test_conflicting_claims_are_refused_and_change_nothing_else(store, make_spec, clock):
    w, run, tokens, seq = _first_life(store, make_spec)
    held = _held(store, run, tokens, 3)
    own_block = held.block_table[4]
    thief = HeldReservation("r-other", "other", [1, 2, 3], b"", (own_block,), 0)
    out_of_range = HeldReservation("r-far", "far", [1, 2, 3], b"", (99,), 0)
    bad_count = HeldReservation("r-bad", "bad", [1, 2, 3], b"", (), 0)  # no table for its tokens
    stale_seq = HeldSequence(list(range(8)) + [50, 51, 52, 53, 54, 55, 56, 57, 58], b"",
                             held.block_table[:3] + (own_block,))  # its 4th block is now someone's own
    fresh = KVStore(clock=clock, lease_ttl_s=10.0, epoch=w.incarnation + 1000)
    result = fresh.restore_worker(make_spec(num_blocks=16), reservations=[held, thief, out_of_range, bad_count],
                                  cached=[seq, stale_seq])
    assert [r.reservation_id for r in result.restored] == [run.reservation_id]
    assert sorted(rid for rid, _ in result.dropped) == ["r-bad", "r-far", "r-other"]
    assert fresh.check_invariants() == []
    assert fresh.get_reservation(run.reservation_id).block_table == held.block_table


def test_a_duplicate_published_copy_is_deduplicated_and_reported(store, make_spec, clock):
    """Two running requests published the same key under two ids (the dedup answer never came
    back before the crash): one keeps it, the other's table changes, as a Publish would do."""
    w = store.register_worker(make_spec(num_blocks=16))
    tokens = list(range(9))
    fresh = KVStore(clock=clock, lease_ttl_s=10.0, epoch=w.incarnation + 1000)
    a = HeldReservation("r-a", "a", tokens, b"", (0, 1, 2), 2)
    b = HeldReservation("r-b", "b", tokens, b"", (3, 4, 5), 2)
    result = fresh.restore_worker(make_spec(num_blocks=16), reservations=[a, b])
    ra, rb = result.restored
    assert ra.block_table == (0, 1, 2) and rb.block_table == (0, 1, 5)
    assert fresh.check_invariants() == []
    assert fresh.stats().workers[0].pool.free == 16 - 4


def test_restore_validates_before_registering(store, make_spec):
    with pytest.raises(InvalidArgument):
        store.restore_worker(make_spec(), reservations=[HeldReservation("r", "q", [1], b"", (0,), 0)] * 5000)
    assert store.list_workers() == []


def test_restore_replays_from_the_journal(make_spec):
    entries: list = []
    clock_args = dict(lease_ttl_s=10.0, epoch=0)
    live = JournaledStore(clock_args, lambda seq, raw: entries.append((seq, raw)))
    held = HeldReservation("r-a", "a", list(range(9)), b"", (0, 1, 2), 2)
    live.restore_worker(make_spec(num_blocks=16), reservations=[held],
                        cached=[HeldSequence(list(range(5)) + [70, 71, 72, 73], b"", (0, 6))])
    again = JournaledStore.recover(clock_args, None, entries)
    assert again.store.view().reservations() == live.store.view().reservations()
    assert again.check_invariants() == [] and again.stats() == live.stats()


def test_the_last_sampled_token_needs_no_position(store, make_spec):
    """A running request's sequence ends in a token it sampled and has not fed yet: a table
    one position short of the tokens is whole."""
    w = store.restore_worker(make_spec(num_blocks=16), reservations=[
        HeldReservation("r-a", "a", list(range(9)), b"", (0, 1), 2)])
    assert w.dropped == () and w.restored[0].published_blocks == 2
    assert store.check_invariants() == []
