"""Prometheus metrics of a gpuworker, recorded from each engine step's report.

The engine thread calls :meth:`WorkerMetrics.on_step` after every completed step (see
``EngineRunner(on_step=...)``); prometheus_client metrics are thread-safe, and the running-requests
gauge is read from the runner when scraped. Derived figures:

* tokens/s = ``rate(tandem_worker_generated_tokens_total)``;
* mean acceptance length = ``tandem_worker_acceptance_length_sum / _count`` (tokens a request
  gained per verify step: 1 + accepted drafts), or from the proposed/accepted draft counters.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import ServiceMetrics
from services.gpuworker.engine.report import StepReport

STEP_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ACCEPTANCE_BUCKETS = tuple(float(n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17, 33))


class WorkerMetrics:
    """The worker's engine metrics, registered in ``metrics.registry``."""

    def __init__(self, metrics: ServiceMetrics, running: Callable[[], int]):
        r = metrics.registry
        self.step_duration = Histogram(
            "tandem_worker_step_duration_seconds", "Engine step latency (device-synchronized)",
            buckets=STEP_LATENCY_BUCKETS_S, registry=r,
        )
        self.generated_tokens = Counter("tandem_worker_generated_tokens", "Tokens generated (streamed to clients)", registry=r)
        self.prefill_tokens = Counter("tandem_worker_prefill_tokens", "Prompt positions the target computed (cache misses)", registry=r)
        self.proposed_drafts = Counter("tandem_worker_proposed_draft_tokens", "Draft tokens verified by the target", registry=r)
        self.accepted_drafts = Counter("tandem_worker_accepted_draft_tokens", "Draft tokens accepted by verification", registry=r)
        self.acceptance_length = Histogram(
            "tandem_worker_acceptance_length", "Tokens a request gained per verify step (1 + accepted drafts)",
            buckets=ACCEPTANCE_BUCKETS, registry=r,
        )
        self.finished = Counter("tandem_worker_requests_finished", "Requests the engine finished, by reason", ["reason"], registry=r)
        self.running = Gauge("tandem_worker_running_requests", "Requests admitted to the engine", registry=r)
        self.running.set_function(running)

    def on_step(self, report: StepReport, elapsed_s: float) -> None:
        """Record one completed step (engine thread; mutates the metrics only)."""
        self.step_duration.observe(elapsed_s)
        generated = prefill = proposed = accepted = 0
        for result in report.results.values():
            generated += len(result.new_token_ids)
            prefill += result.prefill_tokens
            if result.verified:
                proposed += result.proposed_drafts
                accepted += result.accepted_drafts
                self.acceptance_length.observe(1 + result.accepted_drafts)
            if result.finish_reason is not None:
                self.finished.labels(result.finish_reason.value).inc()
        self.generated_tokens.inc(generated)
        self.prefill_tokens.inc(prefill)
        self.proposed_drafts.inc(proposed)
        self.accepted_drafts.inc(accepted)
