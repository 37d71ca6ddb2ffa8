"""The router as a service: ListWorkers, readiness, one trace across the three hops, the CLI."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from router_rig import TIMEOUT, Rig, Script, collect
from tests.free_ports import start_on_free_port
from services.common.server import GrpcServer, ServiceBinding
from services.common.telemetry import ServerTracingInterceptor, setup_tracing
from tandem.common.v1 import common_pb2
from tandem.kvstore.v1 import kvstore_pb2_grpc
from tandem.router.v1 import router_pb2, router_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_list_workers_reports_health_and_in_flight(rig):
    rig.worker("a", Script(delay_s=0.05))
    rig.worker("b", serving=False)
    dead = rig.dead_worker("c")
    router = rig.router()

    # a request that is surely running while we look: read its first token, look, then cancel it
    call = router.stub.Generate(router_pb2.GenerateRequest(temperature=0.0, text="busy", max_new_tokens=1000), timeout=TIMEOUT)
    try:
        assert next(call).token_ids
        resp = router.stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=TIMEOUT)
    finally:
        call.cancel()
    by_id = {w.worker_id: w for w in resp.workers}
    assert sorted(by_id) == ["a", "b", "c"]
    assert [by_id[w].health for w in "abc"] == ["SERVING", "NOT_SERVING", "UNREACHABLE"]
    assert by_id["c"].address == dead
    a = by_id["a"]
    assert a.in_flight == 1 and a.used_blocks >= 1
    assert (a.model_id, a.spec_mode, a.span, a.block_size, a.num_blocks) == ("tiny", common_pb2.SPEC_MODE_NONE, 0, 16, 64)

    def in_flight():
        return {w.worker_id: w.in_flight for w in router.stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=TIMEOUT).workers}

    end = time.monotonic() + 5
    while in_flight() != {"a": 0, "b": 0, "c": 0}:
        assert time.monotonic() < end, in_flight()
        time.sleep(0.02)
    rig.wait_no_live_reservations()


def test_not_serving_until_the_kvstore_answers(start_service):
    from services.router.server import start_router
    from services.router.settings import RouterSettings

    settings = RouterSettings(host="127.0.0.1", port=0, kvstore=f"127.0.0.1:{_free_port()}", grace_s=0.0, model="tiny",
                              kvstore_timeout_s=0.2, kvstore_outage_wait_s=0.5)
    router = start_service(lambda: start_router(settings))
    health = health_pb2_grpc.HealthStub(router.channel)
    time.sleep(0.3)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == health_pb2.HealthCheckResponse.NOT_SERVING
    router.stub = router_pb2_grpc.RouterStub(router.channel)
    _, err = collect(router, text="hi", max_new_tokens=2)
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE and "kvstore" in err.details()


def test_one_trace_crosses_router_kvstore_and_worker(start_service, service_loop):
    from services.kvstore.servicer import KVStoreServicer
    from services.kvstore.store import KVStore

    exporter = InMemorySpanExporter()
    provider = setup_tracing("tandem-test", exporter=exporter, set_global=False)

    async def start_traced_kvstore():
        store = KVStore(lease_ttl_s=120.0)
        name = "tandem.kvstore.v1.KVStore"
        server = GrpcServer([ServiceBinding(kvstore_pb2_grpc.add_KVStoreServicer_to_server, KVStoreServicer(store), name)],
                            port=0, grace_s=0, interceptors=[ServerTracingInterceptor(provider)])
        await server.start()
        await server.set_serving()
        return server, store

    kv = start_service(start_traced_kvstore)
    kv.stub = kvstore_pb2_grpc.KVStoreStub(kv.channel)
    rig = Rig(kv=kv, start_service=start_service, service_loop=service_loop, tracer_provider=provider)
    rig.worker("w0")
    router = rig.router()
    exporter.clear()  # registration and readiness calls are not part of the request

    msgs, err = collect(router, text="trace me", max_new_tokens=3)
    assert err is None, err
    rig.wait_no_live_reservations()
    wanted = {"/tandem.router.v1.Router/Generate", "/tandem.kvstore.v1.KVStore/Match",
              "/tandem.kvstore.v1.KVStore/Reserve", "reserve", "worker.generate",
              "/tandem.worker.v1.Worker/Generate", "/tandem.kvstore.v1.KVStore/Release"}
    end = time.monotonic() + 5  # a server span ends just after its status reached the client
    while not wanted <= {s.name for s in exporter.get_finished_spans()}:
        assert time.monotonic() < end, [s.name for s in exporter.get_finished_spans()]
        time.sleep(0.01)
    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    (root,) = by_name["/tandem.router.v1.Router/Generate"]
    (match,) = by_name["/tandem.kvstore.v1.KVStore/Match"]
    (reserve,) = by_name["/tandem.kvstore.v1.KVStore/Reserve"]
    (reserve_step,) = by_name["reserve"]
    (worker_call,) = by_name["worker.generate"]
    (worker,) = by_name["/tandem.worker.v1.Worker/Generate"]
    (release,) = by_name["/tandem.kvstore.v1.KVStore/Release"]
    trace_id = root.context.trace_id
    for s in (match, reserve, reserve_step, worker_call, worker, release):
        assert s.context.trace_id == trace_id, s.name

    def parent(s):
        return s.parent.span_id

    assert root.parent is None and root.kind == SpanKind.SERVER
    assert parent(reserve_step) == root.context.span_id
    assert parent(match) == parent(reserve) == reserve_step.context.span_id  # router → kvstore
    assert parent(worker_call) == root.context.span_id
    assert parent(worker) == worker_call.context.span_id  # router → worker
    assert parent(release) == worker.context.span_id  # worker → kvstore
    assert reserve_step.attributes["tandem.worker_id"] == "w0"
    provider.shutdown()


def test_cli_serves_until_sigterm(rig, tmp_path):
    rig.worker("w0")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TANDEM_ROUTER_GRACE_S="0")
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    proc, port = start_on_free_port(lambda port, extra: subprocess.Popen(
        [sys.executable, "-m", "services.cli", "router", "--port", str(port), "--kvstore", rig.kv.address,
         "--model", "tiny", "--max-new-tokens", "8"],
        cwd=ROOT, env={**env, **extra}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    ), 60)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            msgs = list(stub.Generate(router_pb2.GenerateRequest(temperature=0.0, text="cli", max_new_tokens=3), timeout=TIMEOUT))
            assert msgs[-1].usage.completion_tokens == 3
            try:
                list(stub.Generate(router_pb2.GenerateRequest(temperature=0.0, text="cli", max_new_tokens=9), timeout=TIMEOUT))
                raise AssertionError("--max-new-tokens 8 should reject 9")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rig.wait_no_live_reservations()


def test_bad_configuration_exits_with_a_clear_message():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "router", "--policy-alpha", "-1", "--tls-cert-file", "x.pem"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("tandem router: error: invalid configuration:") and "policy-alpha" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert "Traceback" not in out.stderr
