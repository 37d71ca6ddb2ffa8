"""Tracing: provider setup, and a client → server call continuing the client's trace."""

from __future__ import annotations

import time

import grpc
from opentelemetry import trace
import pytest
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from services.common.channels import open_channel
from services.common.errors import InvalidArgument
from services.common.server import GrpcServer, ServiceBinding
from services.common.telemetry import ServerTracingInterceptor, get_tracer, setup_tracing

SERVICE = "tandem.test.Echo"


def _echo_binding(tracer_provider):
    """A tiny raw-bytes service: Unary echoes, Stream yields the request 3 times, and requests
    starting with b"invalid" / b"crash" fail like real handlers do."""
    tracer = get_tracer("echo", tracer_provider)

    async def unary(request: bytes, context):
        with tracer.start_as_current_span("inner-work"):
            if request.startswith(b"invalid"):
                raise InvalidArgument("bad echo")
            if request.startswith(b"crash"):
                raise RuntimeError("boom")
            return request

    async def stream(request: bytes, context):
        for _ in range(3):
            yield request

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
        },
    )
    return ServiceBinding(lambda _servicer, server: server.add_generic_rpc_handlers((handler,)), None, SERVICE)


@pytest.fixture
def traced(start_service):
    exporter = InMemorySpanExporter()
    provider = setup_tracing("test-service", exporter=exporter, set_global=False)

    async def start():
        server = GrpcServer([_echo_binding(provider)], port=0, grace_s=0,
                            interceptors=[ServerTracingInterceptor(provider)])
        await server.start()
        await server.set_serving()
        return server, None

    svc = start_service(start)
    yield svc, provider, exporter
    provider.shutdown()


def _finished_spans(exporter, count: int, timeout: float = 5.0):
    """The exporter's spans once at least ``count`` have ended (a server span ends just after
    the status reached the client, so the client can be a moment ahead)."""
    end = time.monotonic() + timeout
    while len(exporter.get_finished_spans()) < count:
        assert time.monotonic() < end, [s.name for s in exporter.get_finished_spans()]
        time.sleep(0.01)
    return exporter.get_finished_spans()


def _spans_by_name(exporter, count: int):
    return {s.name: s for s in _finished_spans(exporter, count)}


def test_server_span_is_a_child_of_the_client_span(traced):
    svc, provider, exporter = traced
    tracer = get_tracer("client", provider)

    async def call():
        channel = open_channel(svc.address)
        try:
            with tracer.start_as_current_span("client-op") as parent:
                unary = channel.unary_unary(f"/{SERVICE}/Unary")
                assert await unary(b"hello", timeout=5) == b"hello"
                stream = channel.unary_stream(f"/{SERVICE}/Stream")
                got = [m async for m in stream(b"s", timeout=5)]
                assert got == [b"s"] * 3
                return parent.get_span_context()
        finally:
            await channel.close()

    parent = svc.loop.run(call())
    spans = _spans_by_name(exporter, 4)  # client-op, Unary, inner-work, Stream
    server_unary = spans[f"/{SERVICE}/Unary"]
    server_stream = spans[f"/{SERVICE}/Stream"]
    for span in (server_unary, server_stream):
        assert span.kind == SpanKind.SERVER
        assert span.context.trace_id == parent.trace_id
        assert span.parent is not None and span.parent.span_id == parent.span_id
        assert span.attributes["rpc.grpc.status_code"] == 0
        assert span.attributes["rpc.system"] == "grpc"
        assert span.attributes["rpc.service"] == SERVICE
    assert server_stream.attributes["rpc.method"] == "Stream"
    # an internal span made by the handler hangs under the server span
    inner = spans["inner-work"]
    assert inner.parent.span_id == server_unary.context.span_id
    assert inner.context.trace_id == parent.trace_id
    assert spans["client-op"].resource.attributes["service.name"] == "test-service"


def test_status_codes_and_root_spans(traced):
    svc, _provider, exporter = traced

    async def call():
        channel = open_channel(svc.address)  # no span is current: the server span is a root
        try:
            unary = channel.unary_unary(f"/{SERVICE}/Unary")
            codes = []
            for payload in (b"invalid", b"crash"):
                try:
                    await unary(payload, timeout=5)
                except grpc.aio.AioRpcError as err:
                    codes.append(err.code())
            return codes
        finally:
            await channel.close()

    assert svc.loop.run(call()) == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL]
    server_spans = [s for s in _finished_spans(exporter, 4) if s.kind == SpanKind.SERVER]  # + 2 inner-work
    server_spans.sort(key=lambda s: s.start_time)
    assert [s.attributes["rpc.grpc.status_code"] for s in server_spans] == [3, 13]
    assert all(s.parent is None for s in server_spans)
    assert server_spans[0].context.trace_id != server_spans[1].context.trace_id
    # the caller's mistake is not a server error; an internal failure is
    assert server_spans[0].status.status_code == StatusCode.UNSET
    assert server_spans[1].status.status_code == StatusCode.ERROR


def test_health_checks_are_not_traced(traced):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    svc, _provider, exporter = traced
    stub = health_pb2_grpc.HealthStub(svc.channel)
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    time.sleep(0.1)  # a span, had one been started, would have ended by now
    assert exporter.get_finished_spans() == ()


def _processors(provider):
    return list(provider._active_span_processor._span_processors)


def test_otlp_exporter_only_when_the_endpoint_is_set(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    provider = setup_tracing("quiet", set_global=False)
    # nowhere to export: the no-op provider (no per-span cost), which still propagates context
    assert isinstance(provider, trace.NoOpTracerProvider)
    parent = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
        trace_id=5, span_id=7, is_remote=True, trace_flags=trace.TraceFlags(1))))
    child = provider.get_tracer("t").start_span("hop", context=parent)
    assert child.get_span_context().trace_id == 5

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    provider = setup_tracing("loud", set_global=False)
    (processor,) = _processors(provider)
    assert isinstance(processor, BatchSpanProcessor)
    assert type(processor.span_exporter).__name__ == "OTLPSpanExporter"
    provider.shutdown()
