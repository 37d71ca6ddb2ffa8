"""Prometheus metrics of the router, recorded where a ``Router.Generate`` stream ends.

An interceptor around ``Generate`` (no change to the dispatcher): it raises the in-flight gauge
when a request arrives, reads the final message's ``usage`` (TTFT as the dispatcher measured it
from arrival, prompt / cached / completion tokens), and counts the request by the status code it
ended with, lowering the gauge again however it ended. Derived figures:

* router-side hit rate = ``rate(tandem_router_cached_tokens_total) / rate(tandem_router_prompt_tokens_total)``;
* error ratio = non-``OK`` outcomes over all of ``tandem_router_requests_total``.

Latency histograms labelled ``model_name`` (semantics of vLLM's ``inter_token_latency_seconds``
and ``e2e_request_latency_seconds``): ``tandem_router_inter_token_latency_seconds`` observes, for
every streamed message after the first token, the gap since the previous one divided by the tokens
it carries (speculative steps deliver several at once); ``tandem_router_e2e_request_latency_seconds``
observes arrival to the last message of every request that ended ``OK``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import TTFT_BUCKETS_S, MethodObserver, ServiceMetrics
from tandem.router.v1 import router_pb2

GENERATE_METHOD = "/" + router_pb2.DESCRIPTOR.services_by_name["Router"].full_name + "/Generate"
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class RouterMetrics:
    """The router's request metrics, registered in ``metrics.registry``."""

    def __init__(self, metrics: ServiceMetrics, model_name: Callable[[], str] = lambda: ""):
        r = metrics.registry
        self._model_name = model_name  # read per observation: with --model auto it is learned later
        self._inter_token = Histogram("tandem_router_inter_token_latency_seconds",
                                      "Gap between streamed messages per token they carry, after the first token",
                                      ["model_name"], buckets=ITL_BUCKETS_S, registry=r)
        self._e2e = Histogram("tandem_router_e2e_request_latency_seconds", "Arrival to last message of requests that ended OK",
                              ["model_name"], buckets=E2E_BUCKETS_S, registry=r)
        self.requests = Counter("tandem_router_requests", "Generate requests by outcome (status code name)", ["outcome"], registry=r)
        self.in_flight = Gauge("tandem_router_in_flight_requests", "Generate requests being served", registry=r)
        self.ttft = Histogram("tandem_router_ttft_seconds", "Time to first token from arrival at the router (completed requests)",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("tandem_router_prompt_tokens", "Prompt tokens of completed requests", registry=r)
        self.cached_tokens = Counter("tandem_router_cached_tokens", "Prompt tokens served from the KV cache (completed requests)", registry=r)
        self.completion_tokens = Counter("tandem_router_completion_tokens", "Tokens generated for completed requests", registry=r)

    def on_message(self, msg: router_pb2.GenerateResponse) -> None:
        """Record the usage of a request's last message (others carry none). Mutates the metrics."""
        if msg.HasField("usage"):
            self.observe_usage(msg.usage)

    def observe_usage(self, u) -> None:
        """Record one completed request's usage (a proto or dispatcher ``Usage``; the HTTP front too)."""
        self.ttft.observe(u.time_to_first_token_s)
        self.prompt_tokens.inc(u.prompt_tokens)
        self.cached_tokens.inc(u.cached_tokens)
        self.completion_tokens.inc(u.completion_tokens)

    def on_end(self, code: grpc.StatusCode, _elapsed_s: float) -> None:
        self.outcome(code.name)

    def outcome(self, name: str) -> None:
        """A request ended with status ``name`` (after ``in_flight.inc()`` at its start)."""
        self.requests.labels(name).inc()
        self.in_flight.dec()

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """A server interceptor recording ``Generate`` calls (other methods pass through)."""

        def callbacks() -> dict:
            last = [0.0]  # this call's time of its previous token message (0 = none yet)

            def on_message(msg: router_pb2.GenerateResponse) -> None:
                self.on_message(msg)
                if msg.token_ids:
                    now = time.perf_counter()
                    if last[0]:
                        self._inter_token.labels(self._model_name()).observe((now - last[0]) / len(msg.token_ids))
                    last[0] = now

            def on_end(code: grpc.StatusCode, elapsed_s: float) -> None:
                if code == grpc.StatusCode.OK:
                    self._e2e.labels(self._model_name()).observe(elapsed_s)
                self.on_end(code, elapsed_s)

            return dict(on_start=self.in_flight.inc, on_message=on_message, on_end=on_end)

        return MethodObserver(GENERATE_METHOD, callbacks)
