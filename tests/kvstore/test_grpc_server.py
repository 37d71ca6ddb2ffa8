"""What the kvstore gets from the common gRPC server: health, drain, reflection, error mapping and
message limits, checked through a real server on loopback."""

from __future__ import annotations

import logging
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.server import INTERNAL_MESSAGE
from services.kvstore.server import SERVICE_NAME
from tandem.kvstore.v1 import kvstore_pb2 as pb

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SECRET = "secret-path /srv/keys/id_rsa"


def health_status(channel, service: str) -> int:
    req = health_pb2.HealthCheckRequest(service=service)
    return health_pb2_grpc.HealthStub(channel).Check(req, timeout=5).status


def test_health_is_serving_after_start(kvstore_service):
    assert health_status(kvstore_service.channel, "") == SERVING
    assert health_status(kvstore_service.channel, SERVICE_NAME) == SERVING


def test_health_turns_not_serving_during_drain_and_new_rpcs_are_refused(kvstore_service):
    svc = kvstore_service
    watch = health_pb2_grpc.HealthStub(svc.channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
    assert next(watch).status == SERVING
    # A long grace keeps the server draining (the open Watch is in flight) while we look at it.
    stopper = threading.Thread(target=svc.stop, kwargs={"grace_s": 1.0})
    stopper.start()
    try:
        assert next(watch).status == NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            svc.stub.Stats(pb.StatsRequest(), timeout=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        watch.cancel()
        stopper.join(10)
    assert not stopper.is_alive()


def test_reflection_lists_the_service_and_its_file(kvstore_service):
    stub = reflection_pb2_grpc.ServerReflectionStub(kvstore_service.channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    from google.protobuf import descriptor_pb2

    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in described.file_descriptor_response.file_descriptor_proto]
    kvstore_file = next(f for f in files if f.name == "tandem/kvstore/v1/kvstore.proto")
    assert "WatchEvents" in {m.name for m in kvstore_file.service[0].method}


def test_internal_errors_reach_the_client_as_bare_internal(kv, monkeypatch, caplog):
    kv.register("a")
    store = kv.svc.payload

    def boom(*args, **kwargs):
        raise RuntimeError(SECRET)

    monkeypatch.setattr(store, "match", boom)
    caplog.set_level(logging.ERROR, logger="services.common.server")
    err = kv.expect_error(grpc.StatusCode.INTERNAL, kv.match, [1, 2, 3])
    assert err.details() == INTERNAL_MESSAGE
    leaked = [err.details(), err.debug_error_string(), repr(err.trailing_metadata())]
    assert not any(word in text for text in leaked for word in ("secret", "Traceback", "RuntimeError", "boom"))
    # ... but the server log has the whole story
    logged = [r for r in caplog.records if "Match" in r.getMessage()]
    assert logged and logged[0].exc_info and SECRET in str(logged[0].exc_info[1])


def test_internal_errors_in_a_stream_are_bare_internal_too(kv, monkeypatch):
    kv.register("a")
    monkeypatch.setattr(kv.svc.payload, "events_since", lambda *a, **k: 1 / 0)
    stream = kv.stub.WatchEvents(pb.WatchEventsRequest(worker_id="a"), timeout=5)
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == INTERNAL_MESSAGE


def test_an_oversized_message_is_refused_by_grpc(start_kvstore_service):
    svc = start_kvstore_service(max_receive_bytes=4096)
    kv = svc.kv
    kv.register("a")
    assert kv.match(range(1, 900))["a"].reusable_positions == 0  # 3.6 KB: under the limit
    err = kv.expect_error(grpc.StatusCode.RESOURCE_EXHAUSTED, kv.match, range(1, 1200))  # 4.8 KB
    assert kv.stats().matches == 1, err.details()
