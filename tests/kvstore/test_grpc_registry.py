"""Contract of the registry RPCs over a real server: RegisterWorker, ListWorkers, Heartbeat.

Each rejected call must leave Stats and CheckInvariants exactly as they were (``kv.expect_error``).
"""

from __future__ import annotations

import grpc
import pytest

from tandem.common.v1 import common_pb2

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "mode, depth, span",
    [
        (common_pb2.SPEC_MODE_NONE, 0, 0),
        (common_pb2.SPEC_MODE_EAGLE3, 0, 1),
        (common_pb2.SPEC_MODE_MTP, 0, 1),  # 0 means 1 on the wire
        (common_pb2.SPEC_MODE_MTP, 3, 3),
        (common_pb2.SPEC_MODE_PARD, 0, 0),
    ],
)
def test_register_reports_span_pool_and_a_fresh_incarnation(kv, mode, depth, span):
    w = kv.register("gpu0", spec_mode=mode, mtp_depth=depth, num_blocks=40, block_size=8)
    assert (w.worker_id, w.span, w.block_size) == ("gpu0", span, 8)
    assert w.mtp_depth == (max(depth, 1) if mode == common_pb2.SPEC_MODE_MTP else 1)
    assert (w.pool.total, w.pool.free, w.pool.cached, w.pool.in_use) == (40, 40, 0, 0)
    assert w.incarnation > 0 and w.live_reservations == 0
    assert 0 < w.lease_expires_in_s <= kv.svc.settings.lease_ttl_s


def test_reregistering_replaces_the_incarnation_and_drops_its_reservations(kv):
    w1 = kv.register("gpu0")
    kv.reserve(w1, "req", range(1, 10))
    assert kv.stats().live_reservations == 1
    w2 = kv.register("gpu0", num_blocks=32)
    assert w2.incarnation > w1.incarnation
    assert w2.pool.total == 32 and w2.pool.free == 32
    assert kv.stats().live_reservations == 0
    assert kv.invariants().ok


def test_list_workers_orders_by_id_and_reports_usage(kv):
    kv.register("b")
    a = kv.register("a")
    kv.reserve(a, "r", range(1, 10), headroom_positions=3)  # 12 positions = 3 blocks of 4
    workers = kv.stub.ListWorkers(kv.pb.ListWorkersRequest(), timeout=5).workers
    assert [w.worker_id for w in workers] == ["a", "b"]
    assert workers[0].live_reservations == 1
    assert (workers[0].pool.in_use, workers[0].pool.free) == (3, 61)
    assert workers[0].address == "127.0.0.1:1" and workers[0].model_id == "m"


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 0),
        ("block_size", 3),  # not a power of two
        ("block_size", 2048),  # above 1024
        ("num_blocks", 0),
        ("spec_mode", common_pb2.SPEC_MODE_UNSPECIFIED),
        ("spec_mode", 99),  # unknown enum value (proto3 keeps it)
        ("vocab_size", 0),
        ("max_seq_len", 0),
        ("worker_id", ""),
    ],
)
def test_register_rejects_bad_specs(kv, field, value):
    existing = kv.register("w0")  # something to keep unchanged
    fields = {"worker_id": "new"} | {field: value}
    req = kv.register_request(**fields)
    err = kv.expect_error(INVALID, kv.stub.RegisterWorker, req, timeout=5)
    assert err.details()  # a message the caller can act on
    listed = kv.stub.ListWorkers(kv.pb.ListWorkersRequest(), timeout=5).workers
    assert [(w.worker_id, w.incarnation) for w in listed] == [("w0", existing.incarnation)]


def test_a_rejected_reregistration_keeps_the_old_incarnation(kv):
    w = kv.register("w0")
    r = kv.reserve(w, "req", range(1, 10))
    kv.expect_error(INVALID, kv.stub.RegisterWorker, kv.register_request("w0", block_size=5), timeout=5)
    assert kv.abort(r) is True  # the old incarnation and its reservation are still live


def test_heartbeat_extends_the_lease(kv):
    w = kv.register("w0")
    resp = kv.stub.Heartbeat(kv.pb.HeartbeatRequest(worker_id="w0", incarnation=w.incarnation), timeout=5)
    assert resp.lease_expires_in_s == pytest.approx(kv.svc.settings.lease_ttl_s, rel=0.05)


def test_heartbeat_unknown_worker_is_not_found(kv):
    kv.register("w0")
    req = kv.pb.HeartbeatRequest(worker_id="nobody", incarnation=1)
    kv.expect_error(grpc.StatusCode.NOT_FOUND, kv.stub.Heartbeat, req, timeout=5)


def test_heartbeat_with_a_stale_incarnation_fails_precondition(kv):
    old = kv.register("w0")
    kv.register("w0")
    req = kv.pb.HeartbeatRequest(worker_id="w0", incarnation=old.incarnation)
    err = kv.expect_error(grpc.StatusCode.FAILED_PRECONDITION, kv.stub.Heartbeat, req, timeout=5)
    assert "incarnation" in err.details()


def test_a_lapsed_lease_drops_the_worker_and_its_reservations(start_kvstore_service):
    from services.kvstore.store import KVStore
    now = [1000.0]
    svc = start_kvstore_service(store=KVStore(lease_ttl_s=10.0, clock=lambda: now[0]))
    kv = svc.kv
    w = kv.register("w0")
    kv.reserve(w, "req", range(1, 10))
    now[0] += 9.0
    kv.stub.Heartbeat(kv.pb.HeartbeatRequest(worker_id="w0", incarnation=w.incarnation), timeout=5)
    now[0] += 9.0  # 18 s after registering, 9 s after the heartbeat: still alive
    assert [x.worker_id for x in kv.stub.ListWorkers(kv.pb.ListWorkersRequest(), timeout=5).workers] == ["w0"]
    now[0] += 2.0  # lapsed
    assert not kv.stub.ListWorkers(kv.pb.ListWorkersRequest(), timeout=5).workers
    stats = kv.stats()
    assert stats.live_reservations == 0 and not stats.workers
    req = kv.pb.HeartbeatRequest(worker_id="w0", incarnation=w.incarnation)
    kv.expect_error(grpc.StatusCode.NOT_FOUND, kv.stub.Heartbeat, req, timeout=5)
