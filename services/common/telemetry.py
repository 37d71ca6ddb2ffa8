"""OpenTelemetry tracing shared by the three services: provider setup and gRPC interceptors.

One trace follows a request across processes because every outgoing call carries the W3C trace
context (``traceparent`` metadata) and every server continues it::

    router process                                   kvstore / worker process
    --------------                                   ------------------------
    SERVER span /tandem.router.v1.Router/Generate
      └ INTERNAL span "reserve"   (current)
          stub.Reserve(...)
          ClientTracingInterceptor:
            inject traceparent ──── metadata ────▶  ServerTracingInterceptor:
                                                      extract traceparent
                                                      SERVER span /tandem.kvstore.v1.KVStore/Reserve
                                                      (child of "reserve", same trace id)

* :func:`setup_tracing` installs a ``TracerProvider`` for a service: spans go to an OTLP/gRPC
  exporter when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (the exporter reads the standard
  ``OTEL_EXPORTER_OTLP_*`` variables), nowhere otherwise; tests inject their own span processor
  or exporter (e.g. ``InMemorySpanExporter``).
* :class:`ServerTracingInterceptor` — a ``grpc.aio`` server interceptor: one SERVER span per RPC,
  named by the full method, with ``rpc.*`` attributes and ``rpc.grpc.status_code``.
* :func:`client_tracing_interceptors` — ``grpc.aio`` client interceptors (unary-unary and
  unary-stream) that inject the current context into outgoing metadata. They create no span of
  their own: the server's span is the hop, parented on whatever span is current at the caller.
* :func:`get_tracer` — for internal spans: ``with get_tracer(__name__).start_as_current_span("reserve"):``.

Without :func:`setup_tracing` the OpenTelemetry API is a no-op that still propagates an incoming
context, so a service that does not trace keeps the trace connected for the next hop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import partial

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common.interceptors import DEFAULT_EXCLUDED_METHOD_PREFIXES, WrappingInterceptor, status_of, wrap_handler

log = logging.getLogger(__name__)

OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"

# OpenTelemetry's gRPC conventions: a SERVER span is an error only for these codes; the others
# (INVALID_ARGUMENT, NOT_FOUND, ...) are the caller's fault and leave the status unset.
_SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def setup_tracing(
    service_name: str,
    *,
    span_processors: Sequence[SpanProcessor] = (),
    exporter: SpanExporter | None = None,
    set_global: bool = True,
) -> trace.TracerProvider:
    """Create this process's ``TracerProvider`` (``service.name`` = ``service_name``) and return it.

    Exports over OTLP/gRPC (batched) if ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set; ``exporter`` is
    attached with a synchronous processor (tests read spans as soon as they end);
    ``span_processors`` are attached as given. With nowhere to send spans, the API's no-op
    provider is used: recording spans nobody reads cost ~50 µs per RPC, and the no-op tracer
    still carries an incoming trace context on to the next hop. With ``set_global`` (default) the
    provider becomes OpenTelemetry's global one — which OpenTelemetry allows once per process;
    later calls still return a working provider, which callers then pass to the interceptors
    explicitly. Mutates global state only through ``trace.set_tracer_provider``.
    """
    if not os.environ.get(OTLP_ENDPOINT_ENV) and exporter is None and not span_processors:
        return trace.NoOpTracerProvider()
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if os.environ.get(OTLP_ENDPOINT_ENV):
        # Imported only when used: the exporter pulls in its own gRPC/protobuf machinery.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        log.info("tracing %s to %s", service_name, os.environ[OTLP_ENDPOINT_ENV])
    for processor in span_processors:
        provider.add_span_processor(processor)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def get_tracer(name: str, tracer_provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """A tracer for internal spans; ``tracer_provider`` None means the global one (read-only)."""
    return trace.get_tracer(name, tracer_provider=tracer_provider)


def _split_method(full_method: str) -> tuple[str, str]:
    """``/pkg.Service/Method`` → (``pkg.Service``, ``Method``)."""
    service, _, method = full_method.lstrip("/").partition("/")
    return service, method


def _metadata_carrier(metadata) -> dict[str, str]:
    """gRPC metadata as a dict for the propagator (text values only; keys are lower-case)."""
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, str):
            carrier[key] = value
    return carrier


def _finish_span(span: trace.Span, code: grpc.StatusCode) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_ERROR_CODES:
        span.set_status(Status(StatusCode.ERROR, code.name))


class ServerTracingInterceptor(WrappingInterceptor):
    """One SERVER span per RPC (unary and server-streaming), continuing the caller's trace.

    The span is current while the handler runs, so internal spans and outgoing calls made by the
    handler become its children. Methods starting with one of ``exclude_prefixes`` are not traced.
    Place it outermost (first in ``GrpcServer(interceptors=...)``) so the span also covers
    authentication failures.
    """

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        *,
        exclude_prefixes: Sequence[str] = DEFAULT_EXCLUDED_METHOD_PREFIXES,
    ):
        super().__init__(exclude_prefixes)
        self._tracer = get_tracer(__name__, tracer_provider)

    def wrap(self, handler, method):
        tracer = self._tracer
        service, name = _split_method(method)
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}

        def start(request, context):
            parent = propagate.extract(_metadata_carrier(context.invocation_metadata()))
            span = tracer.start_span(method, context=parent, kind=SpanKind.SERVER, attributes=attributes)
            return span, trace.set_span_in_context(span)

        def around(state):
            # Current only while the handler runs (each step), never across a yield of ours.
            return partial(otel_context.detach, otel_context.attach(state[1]))

        def end(state, context, exc):
            span = state[0]
            _finish_span(span, status_of(context, exc))
            span.end()

        return wrap_handler(handler, start=start, around=around, end=end)


def trace_metadata() -> tuple[tuple[str, str], ...] | None:
    """The current trace context as call metadata (None without one): for a call on a channel
    opened with ``intercept_streams=False``, where no interceptor adds it."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) or None


def _with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """``details`` with the current trace context added to its metadata (a new value)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return details
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    for key, value in carrier.items():
        metadata[key] = value
    return details._replace(metadata=metadata)


class _UnaryUnaryTracing(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


class _UnaryStreamTracing(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


def client_tracing_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for ``grpc.aio`` channels that propagate the current trace context.

    Two objects because ``grpc.aio`` files each interceptor under one call type only.
    """
    return [_UnaryUnaryTracing(), _UnaryStreamTracing()]
