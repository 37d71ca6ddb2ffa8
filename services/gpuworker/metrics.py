"""Prometheus metrics of a gpuworker, recorded from each engine step's report.

The engine thread calls :meth:`WorkerMetrics.on_step` after every completed step (see
``EngineRunner(on_step=...)``); prometheus_client metrics are thread-safe, and the running-requests
gauge is read from the runner when scraped. Derived figures:

* tokens/s = ``rate(tandem_worker_generated_tokens_total)``;
* mean acceptance length = ``tandem_worker_acceptance_length_sum / _count`` (tokens a request
  gained per verify step: 1 + accepted drafts), or from the proposed/accepted draft counters;
* the engine thread's time: in steps (``tandem_worker_step_duration_seconds_sum``), working
  between them (``tandem_worker_between_steps_seconds_total``), the rest of the wall waiting, and
  of that idle with no request to step (``tandem_worker_idle_seconds_total``: the served path not
  feeding the engine) or stalled with requests held (on the kvstore's answers);
* of the steps, those that computed prompt positions (``tandem_worker_prefill_step_duration_seconds``):
  prefill and mixed steps run eagerly, decode steps replay CUDA graphs, so the count of the former
  against the latter shows whether prompts arrive together (one prefill) or trickle (many);
* of the step time, the engine thread's waits for the device (``tandem_worker_device_wait_seconds_total``,
  by ``step`` = decode / prefill): a decode step that waits ~0 is host-bound (the device finished
  before the host asked), one that waits most of its time is device-bound;
* the worker's part of TTFT (``tandem_worker_time_to_first_token_seconds``: Generate's arrival
  here to the engine's first token) against the router's (``tandem_router_ttft_seconds``), and
  of that the wait for admission into the engine (``tandem_worker_request_queue_time_seconds``).

For autoscalers and gateways (semantics of vLLM's ``num_requests_waiting`` and
``kv_cache_usage_perc``), labelled ``model_name``:

* ``tandem_worker_waiting_requests`` — Generate calls accepted that have not streamed a token yet
  (queued or in prefill), counted by a server interceptor, so the engine is not involved;
* ``tandem_worker_kv_cache_usage_ratio`` — blocks referenced by live reservations / all blocks,
  0–1, as the kvstore (the owner of that truth) reports at scrape time; NaN while it is unreachable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import TTFT_BUCKETS_S, MethodObserver, ServiceMetrics
from services.gpuworker.engine.report import StepReport
from tandem.worker.v1 import worker_pb2

GENERATE_METHOD = "/" + worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name + "/Generate"

STEP_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ACCEPTANCE_BUCKETS = tuple(float(n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17, 33))


@dataclass(frozen=True, slots=True)
class StepTally:
    """What the metrics keep of one step: plain values, so an engine process can send it."""

    elapsed_s: float
    between_s: float  # the engine thread's own work since the previous step (waits left out)
    generated: int
    prefill: int
    proposed: int
    accepted: int
    acceptance_lengths: tuple[int, ...]  # 1 + accepted drafts, per verify
    finish_reasons: tuple[str, ...]
    device_wait_s: float = 0.0  # of elapsed_s, waiting for the device (StepReport.device_wait_s)

    @classmethod
    def of(cls, report: StepReport, elapsed_s: float, between_s: float = 0.0) -> "StepTally":
        generated = prefill = proposed = accepted = 0
        lengths, reasons = [], []
        for result in report.results.values():
            generated += len(result.new_token_ids)
            prefill += result.prefill_tokens
            if result.verified:
                proposed += result.proposed_drafts
                accepted += result.accepted_drafts
                lengths.extend(result.acceptance_lengths)
            if result.finish_reason is not None:
                reasons.append(result.finish_reason.value)
        return cls(elapsed_s, between_s, generated, prefill, proposed, accepted, tuple(lengths), tuple(reasons),
                   report.device_wait_s)


class WorkerMetrics:
    """The worker's engine metrics, registered in ``metrics.registry``."""

    def __init__(self, metrics: ServiceMetrics, running: Callable[[], int], *, model_name: str = "",
                 kv_usage: Callable[[], float] = lambda: float("nan")):
        r = metrics.registry
        self.waiting = Gauge("tandem_worker_waiting_requests", "Generate calls accepted without a streamed token yet (queued or in prefill)",
                             ["model_name"], registry=r).labels(model_name)
        kv_gauge = Gauge("tandem_worker_kv_cache_usage_ratio", "KV blocks referenced by live reservations / all blocks (0-1; kvstore's count)",
                         ["model_name"], registry=r)
        kv_gauge.labels(model_name).set_function(kv_usage)
        self.step_duration = Histogram(
            "tandem_worker_step_duration_seconds", "Engine step latency (device-synchronized)",
            buckets=STEP_LATENCY_BUCKETS_S, registry=r,
        )
        self.prefill_step_duration = Histogram(
            "tandem_worker_prefill_step_duration_seconds",
            "Engine steps that computed prompt positions (prefill or mixed prefill + decode), also counted in "
            "tandem_worker_step_duration_seconds: the rest are decode steps", buckets=STEP_LATENCY_BUCKETS_S, registry=r)
        self.between_steps = Counter(
            "tandem_worker_between_steps_seconds",
            "Engine-thread work between two steps, waits left out (admitting requests, applying results, "
            "kvstore verbs, shipping events): with the step durations, the share of the wall the engine is busy",
            registry=r)
        self.device_wait = Counter(
            "tandem_worker_device_wait_seconds",
            "Of the engine steps' time, the engine thread's waits for the device (reading back a step's tokens or "
            "verdict), by kind of step: near the steps' time the device bounds them, near 0 the host does",
            ["step"], registry=r)
        self._device_wait = {kind: self.device_wait.labels(kind) for kind in ("decode", "prefill")}
        self.idle = Counter(
            "tandem_worker_idle_seconds",
            "Engine-thread waits with no request to step (none admitted, none waiting for admission): the "
            "served path not feeding the engine; the rest of its waits are stalls on kvstore answers",
            registry=r)
        self.generated_tokens = Counter("tandem_worker_generated_tokens", "Tokens generated (streamed to clients)", registry=r)
        self.prefill_tokens = Counter("tandem_worker_prefill_tokens", "Prompt positions the target computed (cache misses)", registry=r)
        self.proposed_drafts = Counter("tandem_worker_proposed_draft_tokens", "Draft tokens verified by the target", registry=r)
        self.accepted_drafts = Counter("tandem_worker_accepted_draft_tokens", "Draft tokens accepted by verification", registry=r)
        self.acceptance_length = Histogram(
            "tandem_worker_acceptance_length", "Tokens a request gained per verify step (1 + accepted drafts)",
            buckets=ACCEPTANCE_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "tandem_worker_time_to_first_token_seconds",
            "Arrival of Generate at the worker to the engine's first token (completed requests): queueing "
            "and prefill here, the rest of a client's TTFT is the router and the network",
            buckets=TTFT_BUCKETS_S, registry=r)
        self.queue_time = Histogram(
            "tandem_worker_request_queue_time_seconds",
            "Arrival of Generate at the worker to admission into the engine (completed requests): the rest "
            "of the worker's TTFT is prefill", buckets=TTFT_BUCKETS_S, registry=r)
        self.finished = Counter("tandem_worker_requests_finished", "Requests the engine finished, by reason", ["reason"], registry=r)
        self.running = Gauge("tandem_worker_running_requests", "Requests admitted to the engine", registry=r)
        self.running.set_function(running)

    def on_step(self, report: StepReport, elapsed_s: float, between_s: float = 0.0) -> None:
        """Record one completed step (engine thread; mutates the metrics only)."""
        self.record(StepTally.of(report, elapsed_s, between_s))

    def on_idle(self, seconds: float) -> None:
        """Record a wait of the engine thread with no request to step (any thread)."""
        self.idle.inc(seconds)

    def record(self, tally: "StepTally") -> None:
        """Record one step's tally (any thread; an engine in another process ships tallies)."""
        self.step_duration.observe(tally.elapsed_s)
        if tally.prefill:
            self.prefill_step_duration.observe(tally.elapsed_s)
        self.between_steps.inc(tally.between_s)
        self._device_wait["prefill" if tally.prefill else "decode"].inc(tally.device_wait_s)
        for length in tally.acceptance_lengths:
            self.acceptance_length.observe(length)
        for reason in tally.finish_reasons:
            self.finished.labels(reason).inc()
        self.generated_tokens.inc(tally.generated)
        self.prefill_tokens.inc(tally.prefill)
        self.proposed_drafts.inc(tally.proposed)
        self.accepted_drafts.inc(tally.accepted)

    def observe_usage(self, usage) -> None:
        """Record a completed request's TTFT and queue time (the runner's ``Usage``; gRPC process)."""
        if usage.completion_tokens:
            self.ttft.observe(usage.time_to_first_token_s)
            self.queue_time.observe(usage.queue_time_s)

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """A server interceptor keeping :attr:`waiting` (Worker.Generate only)."""
        gauge = self.waiting

        def callbacks() -> dict:
            waiting = [False]  # this call's state

            def on_start() -> None:
                waiting[0] = True
                gauge.inc()

            def on_message(msg) -> None:
                if waiting[0] and (msg.token_ids or msg.HasField("usage")):
                    waiting[0] = False
                    gauge.dec()

            def on_end(_code, _elapsed_s) -> None:
                if waiting[0]:
                    waiting[0] = False
                    gauge.dec()

            return dict(on_start=on_start, on_message=on_message, on_end=on_end)

        return MethodObserver(GENERATE_METHOD, callbacks)
