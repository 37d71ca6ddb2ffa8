"""Contract of Stats, CheckInvariants and WatchEvents over a real server.

WatchEvents is checked against the key scheme itself: a STORED event's block keys must be the
blake2b chain of DESIGN §1 starting at the namespace root, so an outside consumer (e.g. a router's
cache index) can recompute them from the tokens::

    root = H(namespace) ──▶ key0 = H(root ‖ material(block 0)) ──▶ key1 = H(key0 ‖ material(block 1)) ...
"""

from __future__ import annotations

import grpc
import pytest

from services.common.spec import SpecMode
from services.kvstore.keys import KeyStream, Namespace, chain_key
from tandem.kvstore.v1 import kvstore_pb2 as pb

P = list(range(1, 18))  # 17 tokens: 4 keyed blocks of 4 under D = 1
STORED, REMOVED, CLEARED = pb.BlockEvent.KIND_STORED, pb.BlockEvent.KIND_REMOVED, pb.BlockEvent.KIND_CLEARED


def expected_keys(tokens, count, *, model_id="m", block_size=4, span=1, salt=b""):
    """The chained block keys of the first ``count`` blocks, computed independently of the store."""
    parent = Namespace(model_id, block_size, SpecMode.EAGLE3, span, salt).root_key()
    root, keys = parent, []
    stream = KeyStream.from_tokens(tokens, span, block_size)
    for j in range(count):
        parent = chain_key(parent, stream.block_key_material(j))
        keys.append(parent)
    return root, keys


def cycle(kv, w, request_id, ids, final=None):
    """Reserve, publish ``final`` positions (default all) and release (mutates)."""
    r = kv.reserve(w, request_id, ids)
    kv.publish(r, len(ids) if final is None else final)
    kv.release(r)
    return r


def watch(kv, worker_id, after_seq=0):
    return kv.stub.WatchEvents(pb.WatchEventsRequest(worker_id=worker_id, after_seq=after_seq), timeout=5)


# ------------------------------------------------------------------------------------------ Stats


def test_stats_counts_per_worker_and_store_wide(kv):
    a = kv.register("a", num_blocks=10)
    kv.register("b")
    cycle(kv, a, "r1", P)  # 4 blocks cached, 6 free
    kv.reserve(a, "r2", P)  # pins the 4, allocates 1, stays live
    kv.match(P)
    kv.reserve(a, "r3", [500 + t for t in P])  # 5 fresh blocks: exactly the 5 left
    stats = kv.stats()
    assert [w.worker_id for w in stats.workers] == ["a", "b"]
    sa = stats.workers[0]
    assert (stats.matches, stats.reservations_created, stats.live_reservations) == (1, 3, 2)
    assert (sa.requested_positions, sa.reused_positions, sa.published_blocks) == (3 * 17, 16, 4)
    assert (sa.pool.total, sa.pool.free, sa.pool.cached, sa.pool.in_use) == (10, 0, 0, 10)
    assert (sa.evictions, sa.deduplicated_blocks, stats.trie_nodes) == (0, 0, 4)
    only_b = kv.stats("b")
    assert [w.worker_id for w in only_b.workers] == ["b"] and only_b.workers[0].pool.free == 64


def test_stats_for_an_unknown_worker_is_not_found(kv):
    kv.register("a")
    kv.expect_error(grpc.StatusCode.NOT_FOUND, kv.stats, "nobody")


# -------------------------------------------------------------------------------- CheckInvariants


def test_check_invariants_reports_ok_and_violations(kv, monkeypatch):
    kv.register("a")
    cycle(kv, kv.register("b"), "r", P)
    resp = kv.invariants()
    assert resp.ok and not resp.violations
    store = kv.svc.payload
    monkeypatch.setattr(store, "check_invariants", lambda: ["a: block 3 is free and cached", "trie: orphan"])
    resp = kv.invariants()
    assert not resp.ok and list(resp.violations) == ["a: block 3 is free and cached", "trie: orphan"]


# ------------------------------------------------------------------------------------ WatchEvents


def test_watch_fails_precondition_when_events_are_off(start_kvstore_service):
    kv = start_kvstore_service().kv  # default settings: events are opt-in
    w = kv.register("a")
    cycle(kv, w, "r1", P)
    with pytest.raises(grpc.RpcError) as info:
        next(watch(kv, "a"))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "events are off" in info.value.details()


def test_watch_streams_stored_removed_cleared_with_increasing_seq(kv):
    w = kv.register("a", num_blocks=8)
    r1 = cycle(kv, w, "r1", P)  # STORED 4 blocks
    cycle(kv, w, "r2", [500 + t for t in P], final=0)  # needs 5 of 4 free: evicts 1 (REMOVED)
    kv.register("a", num_blocks=8)  # CLEARED
    stream = watch(kv, "a")
    try:
        events = [next(stream) for _ in range(3)]
    finally:
        stream.cancel()
    assert [e.seq for e in events] == [1, 2, 3]
    assert [e.kind for e in events] == [STORED, REMOVED, CLEARED]
    assert {e.worker_id for e in events} == {"a"}
    stored, removed, cleared = events
    root, keys = expected_keys(P, 4)
    assert stored.incarnation == w.incarnation and stored.parent_key == root
    assert list(stored.block_keys) == keys and list(stored.block_ids) == list(r1.block_table[:4])
    assert list(removed.block_keys) == [keys[3]] and list(removed.block_ids) == [r1.block_table[3]]
    assert cleared.incarnation == w.incarnation and not cleared.block_keys


def test_watch_replays_after_seq_then_follows_live(kv):
    w = kv.register("a")
    cycle(kv, w, "r1", P, final=8)  # seq 1: blocks 0-1
    cycle(kv, w, "r2", P)  # seq 2: blocks 2-3 (0-1 were pinned, not stored again)
    stream = watch(kv, "a", after_seq=1)
    try:
        replayed = next(stream)
        assert (replayed.seq, replayed.kind, len(replayed.block_keys)) == (2, STORED, 2)
        root, keys = expected_keys(P, 4)
        assert replayed.parent_key == keys[1] and list(replayed.block_keys) == keys[2:]
        # the stream is subscribed before it replays, so what happens next arrives live
        other = [900 + t for t in P]
        cycle(kv, w, "r3", other)
        live = next(stream)
        assert (live.seq, live.kind, live.parent_key) == (3, STORED, root)
        assert list(live.block_keys) == expected_keys(other, 4)[1]
    finally:
        stream.cancel()


def test_watch_unknown_or_missing_worker(kv):
    kv.register("a")
    with pytest.raises(grpc.RpcError) as info:
        next(watch(kv, "nobody"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        next(watch(kv, ""))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert kv.invariants().ok
