"""Contract of Match and Reserve over a real server, with generated stubs and packed tokens.

Workers use block size 4 and EAGLE-3 (span D = 1) unless a test says otherwise, so for a prompt
of n tokens the key of position i >= 1 is t[i+1] and (n - 1) // 4 blocks are reusable::

    prompt P = 1..17 (17 tokens)
    blocks    [t0..t4] [t5..t8] [t9..t12] [t13..t16]     <- contents: block 0 spans bs + D tokens
    positions  0..3     4..7     8..11     12..15    16  <- position 16 has no key: never reused

Every rejected call is checked to leave Stats and CheckInvariants unchanged (``kv.expect_error``).
"""

from __future__ import annotations

import grpc
import pytest

from tandem.common.v1 import common_pb2

INVALID = grpc.StatusCode.INVALID_ARGUMENT
P = list(range(1, 18))


def published(kv, w, ids, request_id="seed"):
    """Reserve, publish every final position and release (mutates): leaves ``ids`` cached."""
    r = kv.reserve(w, request_id, ids)
    kv.publish(r, len(ids))
    kv.release(r)
    return r


# ------------------------------------------------------------------------------------------ Match


def test_match_reports_the_reusable_prefix_per_worker(kv):
    a, b = kv.register("a"), kv.register("b")
    published(kv, a, P)
    m = kv.match(P)
    assert list(m) == ["a", "b"]  # ordered by worker id
    assert (m["a"].reusable_positions, m["a"].reusable_blocks, m["a"].incarnation) == (16, 4, a.incarnation)
    assert (m["b"].reusable_positions, m["b"].reusable_blocks, m["b"].incarnation) == (0, 0, b.incarnation)
    assert m["a"].pool.cached == 4 and m["a"].pool.free == 60
    # shorter prompts reuse at most (n - 1) // 4 blocks; the last position is always recomputed
    assert kv.match(P[:9])["a"].reusable_positions == 8
    assert kv.match(P[:8])["a"].reusable_positions == 4


def test_match_follows_the_lookahead_key_stream(kv):
    w = kv.register("a")
    published(kv, w, P)
    # t[4] is part of block 0's key (its draft KV looked one token ahead): a change there reuses nothing
    changed = P.copy()
    changed[4] = 999
    assert kv.match(changed)["a"].reusable_positions == 0
    changed = P.copy()
    changed[5] = 999  # first key of block 1
    assert kv.match(changed)["a"].reusable_positions == 4


def test_match_is_read_only_apart_from_its_counter(kv):
    w = kv.register("a")
    published(kv, w, P)
    before = kv.stats()
    for _ in range(3):
        kv.match(P)
    after = kv.stats()
    assert after.matches == before.matches + 3
    after.matches = before.matches
    assert after == before


def test_match_filters_by_model_salt_vocabulary_and_length(kv):
    w = kv.register("a", vocab_size=100, max_seq_len=20)
    kv.register("other-model", model_id="m2")
    published(kv, w, P)
    assert set(kv.match(P)) == {"a", "other-model"}
    assert list(kv.match(P, model_id="m")) == ["a"]
    assert kv.match(P, cache_salt=b"tenant-2")["a"].reusable_positions == 0  # disjoint namespace
    assert "a" not in kv.match(P[:16] + [100])  # a token outside a's vocabulary
    assert "a" not in kv.match(list(range(1, 22)))  # longer than a's max_seq_len


@pytest.mark.parametrize(
    "tokens",
    [
        common_pb2.TokenIds(),  # neither form set
        common_pb2.TokenIds(list=common_pb2.Uint32List(values=[])),
        common_pb2.TokenIds(packed=b""),
        common_pb2.TokenIds(packed=b"\x01\x00\x00\x00\x02"),  # not a multiple of 4
    ],
    ids=["unset", "empty-list", "empty-packed", "ragged-packed"],
)
def test_match_rejects_empty_or_malformed_tokens(kv, tokens):
    kv.register("a")
    kv.expect_error(INVALID, kv.stub.Match, kv.pb.MatchRequest(tokens=tokens), timeout=5)


def test_match_accepts_the_list_form_too(kv):
    w = kv.register("a")
    published(kv, w, P)
    req = kv.pb.MatchRequest(tokens=common_pb2.TokenIds(list=common_pb2.Uint32List(values=P)))
    assert kv.stub.Match(req, timeout=5).workers[0].reusable_positions == 16


def test_match_and_reserve_reject_token_lists_over_the_limit(start_kvstore_service):
    kv = start_kvstore_service(max_tokens=32).kv
    w = kv.register("a")
    assert kv.match(range(1, 33))["a"].reusable_positions == 0  # exactly the limit is fine
    err = kv.expect_error(INVALID, kv.match, range(1, 34))
    assert "33" in err.details()
    kv.expect_error(INVALID, kv.reserve, w, "r", range(1, 34))


# ---------------------------------------------------------------------------------------- Reserve


def test_reserve_allocates_the_prompt_plus_headroom(kv):
    w = kv.register("a")
    r = kv.reserve(w, "req-1", P, headroom_positions=3)
    assert (r.request_id, r.worker_id, r.incarnation) == ("req-1", "a", w.incarnation)
    assert r.capacity_positions == 20 and len(r.block_table) == 5 and len(set(r.block_table)) == 5
    assert (r.reused_positions, r.published_blocks) == (0, 0)
    stats = kv.stats()
    assert (stats.workers[0].pool.in_use, stats.workers[0].pool.free) == (5, 59)
    assert (stats.live_reservations, stats.reservations_created) == (1, 1)
    assert stats.workers[0].requested_positions == 17


def test_reserve_pins_the_published_prefix(kv):
    w = kv.register("a")
    first = kv.reserve(w, "first", P)
    kv.publish(first, 17)
    kv.release(first)
    again = kv.reserve(w, "second", P + [18, 19], headroom_positions=1)
    assert again.reused_positions == 16 and again.published_blocks == 4
    assert list(again.block_table[:4]) == list(first.block_table[:4])
    assert again.capacity_positions == 20
    assert kv.stats().workers[0].reused_positions == 16
    assert kv.stats().workers[0].pool.cached == 0  # pinned again: in use


def test_reserve_is_idempotent_per_request_id(kv):
    w = kv.register("a")
    r1 = kv.reserve(w, "same", P, headroom_positions=2)
    before = kv.snapshot()
    r2 = kv.reserve(w, "same", P, headroom_positions=2)
    assert r2 == r1
    assert kv.snapshot() == before
    err = kv.expect_error(INVALID, kv.reserve, w, "same", P[:-1])
    assert "same" in err.details()


@pytest.mark.parametrize(
    "tokens, fields",
    [
        ([], {}),
        ([5, 1000, 7], {}),  # 1000 is not below vocab_size 1000
        (list(range(1, 40)), {}),  # 39 tokens exceed max_seq_len 32
        (P, {"request_id": ""}),
    ],
    ids=["empty", "token-out-of-vocab", "longer-than-max-seq-len", "empty-request-id"],
)
def test_reserve_rejects_invalid_arguments(kv, tokens, fields):
    w = kv.register("a", max_seq_len=32)
    req = kv.pb.ReserveRequest(
        worker_id="a", incarnation=w.incarnation, request_id="r", tokens=kv.tokens(tokens), headroom_positions=1
    )
    for k, v in fields.items():
        setattr(req, k, v)
    err = kv.expect_error(INVALID, kv.stub.Reserve, req, timeout=5)
    assert err.details()


def test_reserve_rejects_ragged_packed_tokens(kv):
    w = kv.register("a")
    req = kv.pb.ReserveRequest(
        worker_id="a", incarnation=w.incarnation, request_id="r", tokens=common_pb2.TokenIds(packed=b"\x01\x00\x00")
    )
    kv.expect_error(INVALID, kv.stub.Reserve, req, timeout=5)


def test_reserve_on_an_unknown_worker_is_not_found(kv):
    w = kv.register("a")
    req = kv.pb.ReserveRequest(worker_id="b", incarnation=w.incarnation, request_id="r", tokens=kv.tokens(P))
    kv.expect_error(grpc.StatusCode.NOT_FOUND, kv.stub.Reserve, req, timeout=5)


def test_reserve_with_a_stale_incarnation_fails_precondition(kv):
    old = kv.register("a")
    kv.register("a")
    err = kv.expect_error(grpc.StatusCode.FAILED_PRECONDITION, kv.reserve, old, "r", P)
    assert "incarnation" in err.details()


def test_reserve_that_cannot_fit_is_resource_exhausted_and_allocates_nothing(kv):
    w = kv.register("a", num_blocks=8)
    holder = kv.reserve(w, "holder", P)  # 5 of 8 blocks
    err = kv.expect_error(grpc.StatusCode.RESOURCE_EXHAUSTED, kv.reserve, w, "big", P)
    assert "5" in err.details() and "3" in err.details()  # needed and available
    kv.release(holder)
    assert len(kv.reserve(w, "big", P).block_table) == 5  # fits once the holder is gone


def test_reserve_evicts_cached_blocks_least_recently_used_first(kv):
    w = kv.register("a", num_blocks=10)
    published(kv, w, P, "old")  # 4 cached blocks, 1 freed
    published(kv, w, [500 + t for t in P], "new")  # 4 more cached (8 of 10)
    r = kv.reserve(w, "third", [700 + t for t in P])  # needs 5: 2 free + 3 evicted
    assert len(r.block_table) == 5
    stats = kv.stats().workers[0]
    assert stats.evictions == 3
    assert kv.match(P)["a"].reusable_positions == 4  # "old" lost its 3 deepest blocks
    assert kv.match([500 + t for t in P])["a"].reusable_positions == 16  # "new" was used last
    assert kv.invariants().ok


def test_reserve_with_candidates_lands_on_the_first_with_room(kv):
    a, b = kv.register("a", num_blocks=4), kv.register("b")
    ids = list(range(1, 41))  # 10 blocks: more than a has
    refs = [kv.pb.WorkerRef(worker_id=w.worker_id, incarnation=w.incarnation) for w in (a, b)]
    req = kv.pb.ReserveRequest(candidates=refs, request_id="r", tokens=kv.tokens(ids))
    r = kv.stub.Reserve(req, timeout=5).reservation
    assert r.worker_id == "b" and len(r.block_table) == 10
    assert kv.stub.Reserve(req, timeout=5).reservation == r  # idempotent retry
    both = kv.pb.ReserveRequest(worker_id="a", incarnation=a.incarnation, candidates=refs, request_id="s",
                                tokens=kv.tokens(ids))
    kv.expect_error(grpc.StatusCode.INVALID_ARGUMENT, kv.stub.Reserve, both, timeout=5)
    full = kv.pb.ReserveRequest(candidates=refs[:1], request_id="t", tokens=kv.tokens(ids))
    kv.expect_error(grpc.StatusCode.RESOURCE_EXHAUSTED, kv.stub.Reserve, full, timeout=5)
