"""The Prometheus endpoints of all three services, scraped over HTTP after real requests.

The suite runs in-process (kvstore + one tiny CPU worker + router, each with ``metrics_port=0``),
so the test knows exactly what it asked for and checks that every counter moved by that amount.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import ServiceMetrics
from services.gpuworker.runner import IDLE_WAIT_S
from services.gpuworker.server import start_worker
from services.gpuworker.settings import WorkerSettings
from services.kvstore.server import start_kvstore
from services.kvstore.settings import KVStoreSettings
from services.router.server import start_router
from services.router.settings import RouterSettings
from suite_rig import LONG_PREFIX, PROCESS_STARTUP_TIMEOUT, TIMEOUT, Suite, rpc_code, stream_a_few_tokens
from tandem.router.v1 import router_pb2, router_pb2_grpc

NUM_BLOCKS = 512
GENERATE = "/tandem.router.v1.Router/Generate"


def scrape(metrics: ServiceMetrics) -> dict[tuple[str, tuple], float]:
    """GET /metrics and return {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=TIMEOUT) as response:
        assert response.status == 200
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def metered(start_service, request):
    """kvstore + worker "w0" + router, each with its own metrics endpoint on a free port (the
    worker's engine in its own process when a test asks with ``indirect`` True)."""
    m = {name: ServiceMetrics(name) for name in ("kvstore", "gpuworker", "router")}
    kv_settings = KVStoreSettings(host="127.0.0.1", port=0, grace_s=0.0, lease_ttl_s=1.5, metrics_port=0)
    kv = start_service(lambda: start_kvstore(kv_settings, metrics=m["kvstore"]))
    suite = Suite(kv=kv, start_service=start_service)
    w_settings = WorkerSettings(host="127.0.0.1", port=0, kvstore=kv.address, worker_id="w0", model="tiny",
                                spec_mode="eagle3", num_blocks=NUM_BLOCKS, heartbeat_s=0.2, grace_s=0.0, metrics_port=0,
                                engine_process=getattr(request, "param", False))

    async def worker():
        server, runner, identity = await start_worker(w_settings, metrics=m["gpuworker"])
        return server, (runner, identity)

    # an engine process imports torch: slow on a loaded 2-core machine
    suite.workers.append(start_service(worker, timeout=PROCESS_STARTUP_TIMEOUT if w_settings.separate_engine_process else TIMEOUT))
    r_settings = RouterSettings(host="127.0.0.1", port=0, kvstore=kv.address, grace_s=0.0, registry_ttl_s=0.0,
                                policy_seed=7, metrics_port=0)
    suite.router = start_service(lambda: start_router(r_settings, metrics=m["router"]))
    suite.router.loop.run(suite.router.payload.ready.wait(), timeout=TIMEOUT)
    suite.stub = router_pb2_grpc.RouterStub(suite.router.channel)
    return suite, m


def wait_for(predicate, timeout_s: float = 15.0):
    end = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result or time.monotonic() > end:
            return result
        time.sleep(0.05)


def test_counters_move_by_what_the_requests_did(metered):
    suite, m = metered
    prompt = LONG_PREFIX + "Question: what is measured?"
    _, _, u1 = suite.generate(prompt, max_new_tokens=12, num_draft_tokens=3)
    _, _, u2 = suite.generate(prompt, max_new_tokens=12, num_draft_tokens=3)
    assert u2.cached_tokens > 0  # the second request reused the first one's blocks
    bad = suite.stub.Generate(router_pb2.GenerateRequest(max_new_tokens=4), timeout=TIMEOUT)  # no prompt
    assert rpc_code(bad) == grpc.StatusCode.INVALID_ARGUMENT
    usages = (u1, u2)
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    cached = sum(u.cached_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)

    # --- router: outcomes, TTFT, token counters, in-flight back to zero. The server records an
    # RPC's end just after the client has its status: wait for the last one.
    r = wait_for(lambda: (lambda s: s if value(s, "tandem_router_requests_total", outcome="INVALID_ARGUMENT") else None)(scrape(m["router"])))
    assert value(r, "tandem_router_requests_total", outcome="OK") == 2
    assert value(r, "tandem_router_requests_total", outcome="INVALID_ARGUMENT") == 1
    assert value(r, "tandem_router_in_flight_requests") == 0
    assert value(r, "tandem_router_ttft_seconds_count") == 2
    assert value(r, "tandem_router_ttft_seconds_sum") == pytest.approx(sum(u.time_to_first_token_s for u in usages))
    assert value(r, "tandem_router_prompt_tokens_total") == prompt_tokens
    assert value(r, "tandem_router_cached_tokens_total") == cached
    assert value(r, "tandem_router_completion_tokens_total") == completion
    assert value(r, "tandem_rpc_duration_seconds_count", method=GENERATE, code="OK") == 2
    assert value(r, "tandem_rpc_duration_seconds_count", method=GENERATE, code="INVALID_ARGUMENT") == 1

    # --- kvstore: read from KVStore.stats() at scrape time
    def drained():
        s = scrape(m["kvstore"])
        return s if value(s, "tandem_kvstore_live_reservations") == 0 else None

    k = wait_for(drained)
    assert k, "reservations stayed live"
    assert value(k, "tandem_kvstore_workers") == 1
    assert value(k, "tandem_kvstore_requested_positions_total", worker="w0") == prompt_tokens
    assert value(k, "tandem_kvstore_reused_positions_total", worker="w0") == cached
    assert value(k, "tandem_kvstore_reservations_created_total") == 2
    assert value(k, "tandem_kvstore_published_blocks_total", worker="w0") >= u1.prompt_tokens // 16
    assert value(k, "tandem_kvstore_evicted_blocks_total", worker="w0") == 0  # 512 blocks: no pressure
    pool = {state: value(k, "tandem_kvstore_pool_blocks", worker="w0", state=state) for state in ("free", "cached", "in_use")}
    assert sum(pool.values()) == NUM_BLOCKS
    assert pool["in_use"] == 0 and pool["cached"] > 0
    assert value(k, "tandem_kvstore_worker_live_reservations", worker="w0") == 0
    reserve = "/tandem.kvstore.v1.KVStore/Reserve"
    assert value(k, "tandem_rpc_duration_seconds_count", method=reserve, code="OK") == 2
    # a step's Publishes go out as one PublishMany; the worker never sends a lone Publish
    many = value(k, "tandem_rpc_duration_seconds_count", method="/tandem.kvstore.v1.KVStore/PublishMany", code="OK")
    assert many >= 1 and not value(k, "tandem_rpc_duration_seconds_count", method="/tandem.kvstore.v1.KVStore/Publish", code="OK")

    # --- worker: tokens, prefill, drafts, steps. Its server, too, records a Generate's end just
    # after the router has the last message (and the kvstore may have drained before): wait for it.
    w = wait_for(lambda: (lambda s: s if value(s, "tandem_rpc_duration_seconds_count", method="/tandem.worker.v1.Worker/Generate",
                                              code="OK") == 2 else None)(scrape(m["gpuworker"])))
    assert w, "the worker never recorded both Generate calls"
    assert value(w, "tandem_worker_generated_tokens_total") == completion
    assert value(w, "tandem_worker_prefill_tokens_total") == prompt_tokens - cached
    assert value(w, "tandem_worker_requests_finished_total", reason="length") == 2
    assert value(w, "tandem_worker_running_requests") == 0
    proposed = value(w, "tandem_worker_proposed_draft_tokens_total")
    accepted = value(w, "tandem_worker_accepted_draft_tokens_total")
    verify_steps = value(w, "tandem_worker_acceptance_length_count")
    assert 0 < verify_steps and 0 <= accepted <= proposed <= 3 * verify_steps
    # every verify step yields 1 + accepted tokens; the prefill's last step yields one more each
    assert value(w, "tandem_worker_acceptance_length_sum") == verify_steps + accepted
    assert verify_steps + accepted + len(usages) >= completion
    # one request at a time: every step served one request, at least one prefill step each
    assert value(w, "tandem_worker_step_duration_seconds_count") >= verify_steps + len(usages)
    # two prompts, each prefilled by at least one step of its own (one request at a time); the
    # decode steps are not among them
    prefill_steps = value(w, "tandem_worker_prefill_step_duration_seconds_count")
    assert len(usages) <= prefill_steps <= value(w, "tandem_worker_step_duration_seconds_count") - verify_steps
    assert 0 < value(w, "tandem_worker_prefill_step_duration_seconds_sum") < value(w, "tandem_worker_step_duration_seconds_sum")
    assert value(w, "tandem_rpc_duration_seconds_count", method="/tandem.worker.v1.Worker/Generate", code="OK") == 2
    # the worker's part of TTFT (its arrival to the engine's first token) lies inside the router's
    assert value(w, "tandem_worker_time_to_first_token_seconds_count") == 2
    assert 0 < value(w, "tandem_worker_time_to_first_token_seconds_sum") < value(r, "tandem_router_ttft_seconds_sum")
    # ... and its wait for admission into the engine inside that
    assert value(w, "tandem_worker_request_queue_time_seconds_count") == 2
    assert 0 < value(w, "tandem_worker_request_queue_time_seconds_sum") < value(w, "tandem_worker_time_to_first_token_seconds_sum")


def test_a_cancelled_stream_is_counted_and_leaves_nothing_in_flight(metered):
    suite, m = metered
    call = stream_a_few_tokens(suite)
    assert value(scrape(m["router"]), "tandem_router_in_flight_requests") == 1
    assert value(scrape(m["gpuworker"]), "tandem_worker_running_requests") == 1
    call.cancel()

    def settled():
        r = scrape(m["router"])
        return r if value(r, "tandem_router_in_flight_requests") == 0 else None

    r = wait_for(settled)
    assert r, "the router still counts the cancelled request in flight"
    assert value(r, "tandem_router_requests_total", outcome="CANCELLED") == 1
    assert value(r, "tandem_router_requests_total", outcome="OK") == 0
    assert value(r, "tandem_router_ttft_seconds_count") == 0  # no usage: the request never completed
    assert wait_for(lambda: value(scrape(m["gpuworker"]), "tandem_worker_running_requests") == 0)


def test_metrics_are_off_unless_a_port_is_set(start_service):
    """Default settings: no endpoint, no interceptor (a passed-in ServiceMetrics records nothing)."""
    metrics = ServiceMetrics("kvstore")
    settings = KVStoreSettings(host="127.0.0.1", port=0, grace_s=0.0)
    assert settings.metrics_port is None
    svc = start_service(lambda: start_kvstore(settings, metrics=metrics))
    from tandem.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

    kvstore_pb2_grpc.KVStoreStub(svc.channel).Stats(kvstore_pb2.StatsRequest(), timeout=TIMEOUT)
    assert metrics.port is None
    names = {s.name for family in metrics.registry.collect() for s in family.samples}
    assert not any(n.startswith("tandem_rpc_duration_seconds_count") for n in names), names
    assert not any(n.startswith("tandem_kvstore_") for n in names), names


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=TIMEOUT) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_serving_series_for_autoscalers_and_gateways(metered):
    suite, m = metered
    call = stream_a_few_tokens(suite)
    w = scrape(m["gpuworker"])
    usage = value(w, "tandem_worker_kv_cache_usage_ratio", model_name="tiny")
    assert 0 < usage < 1  # the live request holds blocks: in use / 512
    assert usage * NUM_BLOCKS == pytest.approx(round(usage * NUM_BLOCKS))  # a whole number of blocks
    assert value(w, "tandem_worker_waiting_requests", model_name="tiny") == 0  # it streams: not waiting
    call.cancel()
    _, _, u = suite.generate(LONG_PREFIX + "again", max_new_tokens=12)

    def settled():
        s = scrape(m["gpuworker"])
        return s if value(s, "tandem_worker_kv_cache_usage_ratio", model_name="tiny") == 0 else None

    assert wait_for(settled), "blocks stayed in use"
    r = wait_for(lambda: (lambda s: s if value(s, "tandem_router_requests_total", outcome="CANCELLED") else None)(scrape(m["router"])))
    assert value(r, "tandem_router_e2e_request_latency_seconds_count", model_name="tiny") == 1  # OK requests only
    assert 0 < value(r, "tandem_router_e2e_request_latency_seconds_sum", model_name="tiny") < TIMEOUT
    itl = value(r, "tandem_router_inter_token_latency_seconds_count", model_name="tiny")
    assert itl >= 2  # several messages after the first token in each stream
    assert value(r, "tandem_router_inter_token_latency_seconds_sum", model_name="tiny") > 0
    for name in ("router", "gpuworker", "kvstore"):
        assert http_get(m[name].port, "/health") == (200, "ok\n")
        assert http_get(m[name].port, "/ready") == (200, "ready\n")
        assert http_get(m[name].port, "/nope")[0] == 404


def test_ready_is_503_while_the_router_has_no_worker(start_service):
    metrics = ServiceMetrics("router")
    kv = start_service(lambda: start_kvstore(KVStoreSettings(host="127.0.0.1", port=0, grace_s=0.0)))
    settings = RouterSettings(host="127.0.0.1", port=0, kvstore=kv.address, grace_s=0.0, metrics_port=0)
    start_service(lambda: start_router(settings, metrics=metrics))
    time.sleep(0.3)
    assert http_get(metrics.port, "/ready") == (503, "not ready\n")
    assert http_get(metrics.port, "/health") == (200, "ok\n")


def test_the_grafana_dashboard_queries_only_series_the_services_export(metered):
    import json
    import re
    from pathlib import Path

    suite, m = metered
    suite.generate(LONG_PREFIX, max_new_tokens=4)
    exported = {name for service in m.values() for name, _ in scrape(service)}
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/tandem.json").read_text())
    queried = {name for panel in dashboard["panels"] for t in panel["targets"] for name in re.findall(r"tandem_\w+", t["expr"])}
    assert len(queried) >= 15
    assert queried <= exported, sorted(queried - exported)


@pytest.mark.parametrize("metered", [False, True], ids=["engine-thread", "engine-process"], indirect=True)
def test_between_steps_counts_the_engine_threads_work_not_its_idling(metered):
    """``tandem_worker_between_steps_seconds``: the engine thread's work between two steps. The
    idle gap between two requests is waiting, and must not be counted (else the first step of
    the second request would carry the whole gap). ``tandem_worker_idle_seconds`` counts exactly
    that gap, waits with no request to step, and as it happens: a scrape in the middle of the
    gap already shows it (an engine in its own process ships it with its idle turns)."""
    suite, m = metered
    suite.generate(LONG_PREFIX + "first", max_new_tokens=8, num_draft_tokens=3)
    started = time.monotonic()
    idle0 = value(scrape(m["gpuworker"]), "tandem_worker_idle_seconds_total")
    idle_s = 1.5
    time.sleep(idle_s)
    mid = value(scrape(m["gpuworker"]), "tandem_worker_idle_seconds_total") - idle0
    # waits of at most 0.5 s (IDLE_WAIT_S) are reported as each ends
    assert mid >= idle_s - 0.5 - 0.3, f"{mid:.3f} s idle reported after {idle_s} s with no request"
    suite.generate(LONG_PREFIX + "second", max_new_tokens=8, num_draft_tokens=3)
    wall_s = time.monotonic() - started
    w = scrape(m["gpuworker"])
    between = value(w, "tandem_worker_between_steps_seconds_total")
    steps = value(w, "tandem_worker_step_duration_seconds_count")
    # the steps' waits for the device, by kind of step (on the CPU the device is the host: ~0)
    waits = [("tandem_worker_device_wait_seconds_total", (("step", kind),)) for kind in ("decode", "prefill")]
    assert all(key in w for key in waits) and 0 <= sum(w[key] for key in waits) < value(w, "tandem_worker_step_duration_seconds_sum")
    assert steps >= 2 and between > 0
    assert between < idle_s / 2, f"{between:.3f} s between {steps:.0f} steps: the idle gap was counted"
    idle = value(w, "tandem_worker_idle_seconds_total") - idle0
    # the gap is idle; the second request's own turns are not. A wait under way at the first
    # scrape is counted whole when it ends: at most IDLE_WAIT_S of it began before ``started``
    assert idle_s * 0.9 <= idle <= wall_s + IDLE_WAIT_S, f"{idle:.3f} s idle around a {idle_s} s gap in {wall_s:.3f} s"
