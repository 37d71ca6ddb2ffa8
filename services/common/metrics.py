"""Prometheus metrics shared by the three services: a per-service registry, its ``/metrics``
HTTP endpoint, and a ``grpc.aio`` server interceptor that times every RPC.

Each service owns one :class:`ServiceMetrics` (its own ``CollectorRegistry``, not the process-wide
default one), so several services started in one process, as the tests do, never clash over a
metric name::

    service process
    ---------------
    grpc.aio server ── RpcMetricsInterceptor ──▶ tandem_rpc_duration_seconds{method, code}
    service hooks (engine steps, router outcomes) ──▶ counters / histograms   } ServiceMetrics
    custom collectors (kvstore: KVStore.stats() at scrape time) ─────────────┘   .registry
                                                                                    │
    HTTP thread  GET /metrics ◀─────────────────────────────────────────────────────┘
                 GET /health  200 while the process serves HTTP at all (liveness)
                 GET /ready   200 while the service is ready (health SERVING), else 503

The endpoint is off unless a service's ``metrics_port`` setting is set (0 = any free port, which
tests use). Recording costs a few microseconds per RPC, and nothing at all when metrics are off:
services then install no interceptor and create no registry.

:func:`observe_handler` learns when an RPC starts, what it streams and which status it ends with
(on top of ``interceptors.wrap_handler``, the one wrapper); per-service interceptors reuse it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest

from services.common.startup import PortInUse, check_port_free

from services.common.interceptors import (
    DEFAULT_EXCLUDED_METHOD_PREFIXES as EXCLUDED_METHOD_PREFIXES,
    WrappingInterceptor,
    status_of,
    wrap_handler,
)

log = logging.getLogger(__name__)

# time to first token, router and worker alike (comparable bucket by bucket)
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# From sub-millisecond kvstore verbs to minute-long Generate streams.
RPC_LATENCY_BUCKETS_S = (
    0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)


def observe_handler(
    handler: grpc.RpcMethodHandler,
    *,
    on_end: Callable[[grpc.StatusCode, float], None],
    on_start: Callable[[], None] | None = None,
    on_message: Callable[[object], None] | None = None,
) -> grpc.RpcMethodHandler:
    """Wrap a unary-unary or unary-stream ``handler`` (other kinds are returned as they are).

    ``on_start()`` runs when the RPC starts, ``on_message(msg)`` for each response message, and
    ``on_end(code, elapsed_s)`` exactly once when it ends, however it ends (so a gauge raised in
    ``on_start`` is always lowered). The callbacks must not raise.
    """
    clock = time.perf_counter

    def start(request, context) -> float:
        if on_start is not None:
            on_start()
        return clock()

    def end(started: float, context, exc) -> None:
        on_end(status_of(context, exc), clock() - started)

    message = None if on_message is None else (lambda _started, msg: on_message(msg))
    return wrap_handler(handler, start=start, on_message=message, end=end)


class RpcMetricsInterceptor(WrappingInterceptor):
    """Record ``tandem_rpc_duration_seconds{method, code}`` for every RPC (streams: until the last
    message). Place it right after the tracing interceptor so authentication failures count too."""

    def __init__(self, histogram: Histogram, *, exclude_prefixes: Sequence[str] = EXCLUDED_METHOD_PREFIXES):
        super().__init__(exclude_prefixes)
        self._histogram = histogram

    def wrap(self, handler, method):
        histogram = self._histogram

        def on_end(code: grpc.StatusCode, elapsed_s: float) -> None:
            histogram.labels(method, code.name).observe(elapsed_s)

        return observe_handler(handler, on_end=on_end)


class MethodObserver(grpc.aio.ServerInterceptor):
    """Observe every call of ONE method: ``callbacks()`` runs once per call and returns that
    call's :func:`observe_handler` keyword arguments (so closures may keep per-call state)."""

    def __init__(self, method: str, callbacks: Callable[[], dict]):
        self._method = method
        self._callbacks = callbacks

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != self._method:
            return handler
        return observe_handler(handler, **self._callbacks())


class ServiceMetrics:
    """One service's metrics: a private registry, the RPC histogram, and the HTTP endpoint.

    Services add their own metrics with ``registry=metrics.registry``. :meth:`serve` starts the
    endpoint (a daemon thread); :meth:`stop` shuts it down. Both mutate this object only.
    """

    def __init__(self, service: str):
        self.service = service
        self.registry = CollectorRegistry()
        self.rpc_duration = Histogram(
            "tandem_rpc_duration_seconds",
            "Server-side RPC latency (streams: until the last message), by method and status code",
            ["method", "code"],
            buckets=RPC_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.port: int | None = None
        # ``/ready`` answers 200 while this returns True; services point it at their gRPC health
        # (GrpcServer.serving). The default suits a service that is ready once it serves at all.
        self.ready: Callable[[], bool] = lambda: True
        self._httpd = None
        self._thread = None

    def interceptor(self) -> RpcMetricsInterceptor:
        """A server interceptor recording into :attr:`rpc_duration`."""
        return RpcMetricsInterceptor(self.rpc_duration)

    def serve(self, host: str, port: int) -> int:
        """Start ``GET /metrics``, ``/health`` and ``/ready`` on ``host:port`` (0 = any free port);
        return the bound port. Raises :class:`PortInUse` when the port is taken."""
        if self._httpd is not None:
            return self.port  # type: ignore[return-value]
        check_port_free(host, port, "metrics port")
        try:
            self._httpd = ThreadingHTTPServer((host, port), _handler_for(self))
        except OSError:  # lost a race for the port
            raise PortInUse(f"{host}:{port}", "metrics port") from None
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name=f"{self.service}-metrics", daemon=True)
        self._thread.start()
        self.port = self._httpd.server_port
        log.info("%s metrics on http://%s:%d/metrics (/health, /ready)", self.service, host, self.port)
        return self.port

    def stop(self) -> None:
        """Stop the endpoint (idempotent; blocking for at most one poll interval of the server)."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
            if self._thread is not None:
                self._thread.join(5.0)


def _handler_for(metrics: ServiceMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
            elif path == "/health":
                self._send(200, b"ok\n")
            elif path == "/ready":
                ready = metrics.ready()
                self._send(200 if ready else 503, b"ready\n" if ready else b"not ready\n")
            else:
                self._send(404, b"not found: try /metrics, /health or /ready\n")

        def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:  # scrapes every few seconds: not worth a log line
            pass

    return Handler
