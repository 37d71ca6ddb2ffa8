"""One Router.Generate is one trace with spans from the router, the kvstore and the gpuworker."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from suite_rig import Suite
from services.common.telemetry import setup_tracing
from services.kvstore.server import start_kvstore
from services.kvstore.settings import KVStoreSettings
from tandem.kvstore.v1 import kvstore_pb2_grpc


def test_one_generate_is_one_trace_across_three_services(start_service):
    exporter = InMemorySpanExporter()
    provider = setup_tracing("tandem-e2e", exporter=exporter, set_global=False)
    settings = KVStoreSettings(host="127.0.0.1", port=0, grace_s=0.0)
    kv = start_service(lambda: start_kvstore(settings, tracer_provider=provider))
    kv.stub = kvstore_pb2_grpc.KVStoreStub(kv.channel)
    suite = Suite(kv=kv, start_service=start_service, tracer_provider=provider)
    suite.add_worker("w0")
    suite.add_router()
    exporter.clear()  # registration and heartbeats are traces of their own

    ids, _, usage = suite.generate("trace me across three hops", max_new_tokens=6)
    assert len(ids) == 6

    spans = exporter.get_finished_spans()
    root = [s for s in spans if s.name == "/tandem.router.v1.Router/Generate"]
    assert len(root) == 1
    trace_id = root[0].context.trace_id
    in_trace = [s for s in spans if s.context.trace_id == trace_id]
    names = {s.name for s in in_trace}
    # router side, the two kvstore hops it made, the worker hop and the worker's phases
    assert {"/tandem.kvstore.v1.KVStore/Match", "/tandem.kvstore.v1.KVStore/Reserve"} <= names, names
    assert "/tandem.worker.v1.Worker/Generate" in names, names
    assert {"prefill", "decode"} <= names, names
    assert "reserve" in names, names
    # parent links stay inside the trace: every span but the root has its parent in the trace
    ids_in_trace = {s.context.span_id for s in in_trace}
    orphans = [s.name for s in in_trace if s is not root[0] and s.parent is not None and s.parent.span_id not in ids_in_trace]
    assert not orphans, orphans
