"""Prometheus metrics of the router, recorded where a ``Router.Generate`` stream ends.

An interceptor around ``Generate`` (no change to the dispatcher): it raises the in-flight gauge
when a request arrives, reads the final message's ``usage`` (TTFT as the dispatcher measured it
from arrival, prompt / cached / completion tokens), and counts the request by the status code it
ended with, lowering the gauge again however it ended. Derived figures:

* router-side hit rate = ``rate(tandem_router_cached_tokens_total) / rate(tandem_router_prompt_tokens_total)``;
* error ratio = non-``OK`` outcomes over all of ``tandem_router_requests_total``.
"""

from __future__ import annotations

import grpc
from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import ServiceMetrics, observe_handler
from tandem.router.v1 import router_pb2

GENERATE_METHOD = "/" + router_pb2.DESCRIPTOR.services_by_name["Router"].full_name + "/Generate"
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    """The router's request metrics, registered in ``metrics.registry``."""

    def __init__(self, metrics: ServiceMetrics):
        r = metrics.registry
        self.requests = Counter("tandem_router_requests", "Generate requests by outcome (status code name)", ["outcome"], registry=r)
        self.in_flight = Gauge("tandem_router_in_flight_requests", "Generate requests being served", registry=r)
        self.ttft = Histogram("tandem_router_ttft_seconds", "Time to first token from arrival at the router (completed requests)",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("tandem_router_prompt_tokens", "Prompt tokens of completed requests", registry=r)
        self.cached_tokens = Counter("tandem_router_cached_tokens", "Prompt tokens served from the KV cache (completed requests)", registry=r)
        self.completion_tokens = Counter("tandem_router_completion_tokens", "Tokens generated for completed requests", registry=r)

    def on_message(self, msg: router_pb2.GenerateResponse) -> None:
        """Record the usage of a request's last message (others carry none). Mutates the metrics."""
        if not msg.HasField("usage"):
            return
        u = msg.usage
        self.ttft.observe(u.time_to_first_token_s)
        self.prompt_tokens.inc(u.prompt_tokens)
        self.cached_tokens.inc(u.cached_tokens)
        self.completion_tokens.inc(u.completion_tokens)

    def on_end(self, code: grpc.StatusCode, _elapsed_s: float) -> None:
        self.requests.labels(code.name).inc()
        self.in_flight.dec()

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """A server interceptor recording ``Generate`` calls (other methods pass through)."""
        return _GenerateInterceptor(self)


class _GenerateInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, recorder: RouterMetrics):
        self._recorder = recorder

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != GENERATE_METHOD:
            return handler
        r = self._recorder
        return observe_handler(handler, on_start=r.in_flight.inc, on_message=r.on_message, on_end=r.on_end)
