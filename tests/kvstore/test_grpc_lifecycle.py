"""Contract of the reservation lifecycle RPCs over a real server: Extend, Trim, Publish, Release,
Suspend and Abort.

Workers use block size 4 and EAGLE-3 (D = 1). Extend and Trim answer OK at the RPC level and carry
a google.rpc code per item; an item that fails changes nothing. Every rejected call (or batch of
failing items) is checked to leave Stats and CheckInvariants unchanged.
"""

from __future__ import annotations

import grpc
import pytest

from tandem.common.v1 import common_pb2

OK, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, FAILED_PRECONDITION = 0, 3, 5, 8, 9
P = list(range(1, 18))  # 17 tokens: 4 keyed blocks of 4 (position 16 has no key under D = 1)


class _Ghost:
    """Stands in for a reservation the store never handed out."""

    reservation_id = "r-does-not-exist"
    incarnation = 1


def stale(r):
    """A copy of reservation ``r`` carrying a wrong incarnation."""
    copy = type(r)()
    copy.CopyFrom(r)
    copy.incarnation = r.incarnation + 1
    return copy


# ----------------------------------------------------------------------------------------- Extend


def test_extend_appends_blocks_and_keeps_the_table_prefix(kv):
    w = kv.register("a")
    r = kv.reserve(w, "r", P, headroom_positions=3)  # 20 positions, 5 blocks
    (res,) = kv.capacity("Extend", (r, 30))
    assert (res.code, res.reservation_id, res.capacity_positions) == (OK, r.reservation_id, 32)
    assert list(res.block_table[:5]) == list(r.block_table) and len(set(res.block_table)) == 8
    assert kv.stats().workers[0].pool.in_use == 8
    (same,) = kv.capacity("Extend", (r, 10))  # asking for less is a no-op
    assert (same.code, list(same.block_table)) == (OK, list(res.block_table))


def test_extend_items_fail_independently_and_change_nothing(kv):
    w = kv.register("a", num_blocks=12, max_seq_len=64)
    r = kv.reserve(w, "r", P, headroom_positions=3)  # 5 blocks, 7 left
    before = kv.snapshot()
    results = kv.capacity("Extend", (_Ghost, 8), (stale(r), 24), (r, 65), (r, 60))
    assert [x.code for x in results] == [NOT_FOUND, FAILED_PRECONDITION, INVALID_ARGUMENT, RESOURCE_EXHAUSTED]
    assert all(x.message for x in results)
    assert [list(x.block_table) for x in results[1:]] == [list(r.block_table)] * 3
    assert kv.snapshot() == before
    # one good item next to a bad one: the good one happens, the bad one does not
    ok, bad = kv.capacity("Extend", (r, 24), (r, 65))
    assert (ok.code, len(ok.block_table), bad.code, len(bad.block_table)) == (OK, 6, INVALID_ARGUMENT, 6)


# ------------------------------------------------------------------------------------------- Trim


def test_trim_frees_tail_blocks(kv):
    w = kv.register("a")
    r = kv.reserve(w, "r", P, headroom_positions=11)  # 28 positions, 7 blocks
    (res,) = kv.capacity("Trim", (r, 18))  # 18 positions need 5 blocks
    assert (res.code, res.capacity_positions, list(res.block_table)) == (OK, 20, list(r.block_table[:5]))
    pool = kv.stats().workers[0].pool
    assert (pool.in_use, pool.free) == (5, 59)


def test_trim_items_fail_independently_and_change_nothing(kv):
    w = kv.register("a")
    r = kv.reserve(w, "r", P, headroom_positions=11)
    kv.publish(r, 16)  # 4 published blocks
    before = kv.snapshot()
    results = kv.capacity("Trim", (_Ghost, 8), (stale(r), 20), (r, 16), (r, 8))
    assert [x.code for x in results] == [NOT_FOUND, FAILED_PRECONDITION, INVALID_ARGUMENT, FAILED_PRECONDITION]
    assert "length" in results[2].message  # below the 17 known tokens
    assert "published" in results[3].message  # would cut published blocks
    assert kv.snapshot() == before


# ---------------------------------------------------------------------------------------- Publish


def test_publish_inserts_final_full_blocks(kv):
    w = kv.register("a")
    r = kv.reserve(w, "r", P, headroom_positions=7)  # 24 positions
    resp = kv.publish(r, 9)  # 2 whole blocks are final
    assert (resp.newly_published, resp.deduplicated, resp.reservation.published_blocks) == (2, 0, 2)
    resp = kv.publish(r, 21, new_ids=[18, 19, 20, 21])  # 21 tokens now: (21 - 1) // 4 = 5 keyed blocks
    assert (resp.newly_published, resp.reservation.published_blocks) == (3, 5)
    stats = kv.stats()
    assert stats.trie_nodes == 5 and stats.workers[0].published_blocks == 5
    assert kv.match(P + [18, 19, 20, 21, 22])["a"].reusable_positions == 20


def test_publish_deduplicates_against_the_workers_copy(kv):
    w = kv.register("a")
    first, second = kv.reserve(w, "r1", P), kv.reserve(w, "r2", P)  # both computed P
    kv.publish(first, 17)
    free_before = kv.stats().workers[0].pool.free
    resp = kv.publish(second, 17)
    assert (resp.newly_published, resp.deduplicated) == (0, 4)
    assert list(resp.reservation.block_table[:4]) == list(first.block_table[:4])
    assert resp.reservation.block_table[4] == second.block_table[4]
    stats = kv.stats()
    assert stats.workers[0].pool.free == free_before + 4 and stats.workers[0].deduplicated_blocks == 4


@pytest.mark.parametrize(
    "final, new_tokens",
    [
        (18, None),  # past the 17 known tokens
        (21, [18, 19, 20, 21]),  # past the capacity of 20
        (17, common_pb2.TokenIds(packed=b"\x01\x00\x00\x00\x02\x00")),  # ragged packed
        (17, [18, 1000]),  # out of vocabulary
    ],
    ids=["past-known-tokens", "past-capacity", "ragged-new-tokens", "new-token-out-of-vocab"],
)
def test_publish_rejects_invalid_arguments(kv, final, new_tokens):
    w = kv.register("a")
    r = kv.reserve(w, "r", P, headroom_positions=3)
    req = kv.pb.PublishRequest(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=final)
    if isinstance(new_tokens, list):
        req.new_tokens.CopyFrom(kv.tokens(new_tokens))
    elif new_tokens is not None:
        req.new_tokens.CopyFrom(new_tokens)
    kv.expect_error(grpc.StatusCode.INVALID_ARGUMENT, kv.stub.Publish, req, timeout=5)


def test_publish_unknown_stale_or_ended_reservations(kv):
    w = kv.register("a")
    r = kv.reserve(w, "r", P)
    kv.expect_error(grpc.StatusCode.NOT_FOUND, kv.publish, _Ghost, 0)
    kv.expect_error(grpc.StatusCode.FAILED_PRECONDITION, kv.publish, stale(r), 16)
    kv.release(r)
    kv.expect_error(grpc.StatusCode.FAILED_PRECONDITION, kv.publish, r, 16)


def test_publish_after_the_worker_restarted_fails_precondition(kv):
    w = kv.register("a")
    r = kv.reserve(w, "r", P)
    kv.register("a")  # new incarnation: r died with the old one
    err = kv.expect_error(grpc.StatusCode.FAILED_PRECONDITION, kv.publish, r, 16)
    assert r.reservation_id in err.details()


# ------------------------------------------------------------------------------------ PublishMany


def publish_many(kv, *items):
    """PublishMany of ``(reservation, final_positions, new_ids)`` items (mutates); the results."""
    req = kv.pb.PublishManyRequest(items=[
        kv.pb.PublishRequest(reservation_id=r.reservation_id, incarnation=r.incarnation,
                             new_tokens=kv.tokens(new), final_positions=final) for r, final, new in items])
    return list(kv.stub.PublishMany(req, timeout=kv.timeout).results)


def test_publish_many_answers_each_item_as_publish_would(kv):
    w = kv.register("a")
    r1, r2 = kv.reserve(w, "r1", P, headroom_positions=7), kv.reserve(w, "r2", P)
    one, two = publish_many(kv, (r1, 9, []), (r2, 17, []))  # r2 deduplicates nothing: r1 has 2 blocks only
    assert (one.code, one.response.newly_published, one.response.reservation.published_blocks) == (OK, 2, 2)
    assert (two.code, two.response.newly_published, two.response.deduplicated) == (OK, 2, 2)
    assert list(two.response.reservation.block_table[:2]) == list(r1.block_table[:2])  # remapped
    (again,) = publish_many(kv, (r1, 21, [18, 19, 20, 21]))
    assert (again.code, again.response.reservation.published_blocks) == (OK, 5)
    assert kv.match(P + [18, 19, 20, 21, 22])["a"].reusable_positions == 20


def test_publish_many_items_fail_independently_and_change_nothing(kv):
    w = kv.register("a")
    r = kv.reserve(w, "r", P, headroom_positions=3)  # capacity 20
    before = kv.snapshot()
    results = publish_many(kv, (_Ghost, 0, []), (stale(r), 16, []), (r, 18, []), (r, 21, [18, 19, 20, 21]))
    assert [x.code for x in results] == [NOT_FOUND, FAILED_PRECONDITION, INVALID_ARGUMENT, INVALID_ARGUMENT]
    assert all(x.message and not x.HasField("response") for x in results)
    assert kv.snapshot() == before
    # a good item between bad ones happens; the bad ones do not
    bad, ok, bad_again = publish_many(kv, (r, 18, []), (r, 9, []), (_Ghost, 0, []))
    assert (bad.code, ok.code, bad_again.code) == (INVALID_ARGUMENT, OK, NOT_FOUND)
    assert ok.response.reservation.published_blocks == 2 and kv.stats().workers[0].published_blocks == 2


def test_publish_many_bounds_its_items(kv):
    w = kv.register("a")
    r = kv.reserve(w, "r", P)
    req = kv.pb.PublishManyRequest(items=[kv.pb.PublishRequest(reservation_id=r.reservation_id, incarnation=r.incarnation,
                                                               final_positions=4)] * 4097)
    err = kv.expect_error(grpc.StatusCode.INVALID_ARGUMENT, kv.stub.PublishMany, req, timeout=5)
    assert "4097 items" in err.details()
    assert publish_many(kv) == []  # no items: nothing to do


# -------------------------------------------------------------------------------- Release / Suspend


def test_release_publishes_what_is_final_and_frees_the_rest(kv):
    w = kv.register("a")
    r = kv.reserve(w, "r", P, headroom_positions=3)  # 5 blocks
    resp = kv.release(r, 17)
    assert (resp.newly_published, resp.freed_blocks) == (4, 1)
    stats = kv.stats()
    assert stats.live_reservations == 0
    assert (stats.workers[0].pool.cached, stats.workers[0].pool.free, stats.workers[0].pool.in_use) == (4, 60, 0)


def test_release_counts_deduplicated_copies_among_freed_blocks(kv):
    w = kv.register("a")
    first, second = kv.reserve(w, "r1", P), kv.reserve(w, "r2", P, headroom_positions=3)  # 5 + 5 blocks
    kv.publish(first, 17)
    free_before = kv.stats().workers[0].pool.free
    resp = kv.release(second, 17)  # its 4 keyed blocks are already on the worker: dedup
    assert (resp.newly_published, resp.deduplicated, resp.freed_blocks) == (0, 4, 5)
    assert kv.stats().workers[0].pool.free == free_before + resp.freed_blocks


def test_release_with_zero_final_positions_publishes_nothing(kv):
    w = kv.register("a")
    resp = kv.release(kv.reserve(w, "r", P))
    assert (resp.newly_published, resp.freed_blocks) == (0, 5)
    assert kv.stats().trie_nodes == 0 and kv.stats().workers[0].pool.free == 64


def test_suspend_then_reserve_again_hits_its_own_prefix(kv):
    w = kv.register("a")
    r = kv.reserve(w, "req", P, headroom_positions=7)  # 24 positions
    resp = kv.release(r, 21, new_ids=[18, 19, 20, 21], verb="Suspend")
    assert resp.newly_published == 5 and kv.stats().live_reservations == 0
    again = kv.reserve(w, "req", P + [18, 19, 20, 21], headroom_positions=3)
    assert again.reservation_id != r.reservation_id
    assert again.reused_positions == 20 and list(again.block_table[:5]) == list(r.block_table[:5])


@pytest.mark.parametrize("verb", ["Release", "Suspend"])
def test_release_and_suspend_errors(kv, verb):
    w = kv.register("a")
    r = kv.reserve(w, "r", P)
    kv.expect_error(grpc.StatusCode.NOT_FOUND, kv.release, _Ghost, verb=verb)
    kv.expect_error(grpc.StatusCode.FAILED_PRECONDITION, kv.release, stale(r), verb=verb)
    kv.expect_error(grpc.StatusCode.INVALID_ARGUMENT, kv.release, r, 18, verb=verb)
    kv.release(r, verb=verb)
    kv.expect_error(grpc.StatusCode.FAILED_PRECONDITION, kv.release, r, verb=verb)  # already ended


# ------------------------------------------------------------------------------------------ Abort


def test_abort_unpins_frees_and_is_idempotent(kv):
    w = kv.register("a")
    seed = kv.reserve(w, "seed", P)
    kv.publish(seed, 17)
    kv.release(seed)  # 4 cached blocks
    r = kv.reserve(w, "r", P + [18, 19, 20, 21], headroom_positions=3)  # reuses 4, allocates 2
    assert r.reused_positions == 16 and len(r.block_table) == 6
    assert kv.abort(r) is True
    stats = kv.stats()
    pool = stats.workers[0].pool
    assert stats.live_reservations == 0 and stats.trie_nodes == 4
    assert (pool.cached, pool.in_use, pool.free) == (4, 0, 60)
    before = kv.snapshot()
    assert kv.abort(r) is False  # already ended: a no-op
    assert kv.snapshot() == before


def test_abort_errors(kv):
    w = kv.register("a")
    r = kv.reserve(w, "r", P)
    kv.expect_error(grpc.StatusCode.NOT_FOUND, kv.abort, _Ghost)
    kv.expect_error(grpc.StatusCode.FAILED_PRECONDITION, kv.abort, stale(r))
    assert kv.abort(r) is True
    kv.expect_error(grpc.StatusCode.FAILED_PRECONDITION, kv.abort, stale(r))  # ended, other incarnation
