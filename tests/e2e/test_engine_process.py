"""The worker's engine in an OS process of its own (``--engine-process``, the CUDA default),
through the real router and kvstore: the same answers as the engine on a thread, cancellation and
Worker.Abort cross the process boundary, metrics arrive, and neither side outlives the other."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from services.common.metrics import ServiceMetrics
from services.gpuworker.server import start_worker
from services.gpuworker.settings import WorkerSettings
from suite_rig import LONG_PREFIX, PROCESS_STARTUP_TIMEOUT, TIMEOUT, spawn_worker_process, stream_a_few_tokens, wait_registered
from tandem.common.v1 import common_pb2
from tandem.router.v1 import router_pb2
from tandem.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.proc_tree import alive, children_of, children_running


def _engine(svc):
    runner, _identity = svc.payload
    return runner


def _carriers_of(pid: int) -> list[int]:
    """``pid``'s children that are kvstore carrier processes."""
    return children_running(pid, b"services.gpuworker.kvstore_carrier")


def _wait_disowned(runner) -> None:
    """Until the engine has disowned every request (once their Release or Abort was answered)."""
    end = time.monotonic() + TIMEOUT
    while runner.running_ids():
        assert time.monotonic() < end, runner.running_ids()
        time.sleep(0.05)


def test_an_engine_process_answers_exactly_what_an_engine_thread_does(suite):
    threaded = suite.add_worker("thread", engine_process=False)
    suite.add_router()
    prompt = LONG_PREFIX + "Question: where does the engine run?"
    expected = {k: suite.generate(prompt, max_new_tokens=24, num_draft_tokens=k)[0] for k in (0, 3)}
    threaded.stop()
    suite.workers.remove(threaded)
    separate = suite.add_worker("process", engine_process=True)
    assert _engine(separate).facts is not None  # the process said it was ready before SERVING
    wait_registered(suite, "process", timeout_s=TIMEOUT)
    for k in (0, 3):
        first, _, u1 = suite.generate(prompt, max_new_tokens=24, num_draft_tokens=k)
        second, _, u2 = suite.generate(prompt, max_new_tokens=24, num_draft_tokens=k)
        assert first == second == expected[k], k
        assert u1.worker_id == u2.worker_id == "process"
        assert u2.cached_tokens >= 64  # published from the engine process, reused by the next request
        assert u1.completion_tokens == 24
        assert u1.mean_acceptance_length >= 1.0
    assert suite.wait_no_live_reservations().live_reservations == 0
    check = suite.invariants()
    assert check.ok, check.violations
    _wait_disowned(_engine(separate))
    # a call into the engine process answers with the runner's own value
    assert _engine(separate)._call("running_ids", timeout_s=TIMEOUT) == frozenset()


def test_cancel_and_worker_abort_cross_the_process_boundary(suite):
    svc = suite.add_worker("w0", engine_process=True)
    suite.add_router()
    call = stream_a_few_tokens(suite, 8)
    assert suite.stats().live_reservations == 1
    call.cancel()
    assert suite.wait_no_live_reservations().live_reservations == 0

    # Worker.Abort names a request id; the engine process ends it between two steps
    runner = _engine(svc)
    call = suite.stub.Generate(router_pb2.GenerateRequest(text=LONG_PREFIX, max_new_tokens=1500, temperature=0), timeout=TIMEOUT)
    next(call)
    (request_id,) = runner.running_ids()
    worker = worker_pb2_grpc.WorkerStub(svc.channel)
    worker.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=TIMEOUT)
    tail = list(call)  # the stream ends normally, its last message says why
    assert tail[-1].finish_reason == common_pb2.FINISH_REASON_ABORT, tail[-1:]
    assert suite.wait_no_live_reservations().live_reservations == 0
    _wait_disowned(runner)
    with pytest.raises(grpc.RpcError) as err:
        worker.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    check = suite.invariants()
    assert check.ok, check.violations
    ids, _, _ = suite.generate("after abort", max_new_tokens=3)
    assert len(ids) == 3


def test_step_metrics_come_back_from_the_engine_process(start_kvstore_service, start_service):
    from test_metrics import scrape, value

    kv = start_kvstore_service(lease_ttl_s=1.5)
    metrics = ServiceMetrics("gpuworker")
    settings = WorkerSettings(host="127.0.0.1", port=0, kvstore=kv.address, worker_id="w0", model="tiny", num_blocks=256,
                              heartbeat_s=0.2, grace_s=0.0, metrics_port=0, engine_process=True)

    async def worker():
        server, runner, identity = await start_worker(settings, metrics=metrics)
        return server, (runner, identity)

    from suite_rig import Suite

    suite = Suite(kv=kv, start_service=start_service)
    suite.workers.append(start_service(worker, timeout=PROCESS_STARTUP_TIMEOUT))
    suite.add_router()
    _, _, usage = suite.generate(LONG_PREFIX, max_new_tokens=10, num_draft_tokens=2)
    end = time.monotonic() + TIMEOUT
    while value(scrape(metrics), "tandem_worker_generated_tokens_total") < usage.completion_tokens:
        assert time.monotonic() < end, "the engine process's step tallies never arrived"
        time.sleep(0.05)
    samples = scrape(metrics)
    assert value(samples, "tandem_worker_generated_tokens_total") == usage.completion_tokens
    assert value(samples, "tandem_worker_step_duration_seconds_count") >= 1
    assert value(samples, "tandem_worker_requests_finished_total", reason="length") == 1


def test_a_dead_engine_process_fails_its_streams_and_stops_the_worker(suite):
    """The engine process is killed while a stream runs: the stream fails UNAVAILABLE and the
    worker stops. Greedy, so that no sampled end-of-sequence ends the stream early (sampled, the
    tiny model's random output meets EOS after a few hundred tokens, which made this test race
    its own kill). 1,500 greedy tokens take the tiny model about a second: on a loaded machine
    the request can still be over before the kill lands; such a try proves nothing about
    running streams, so it is repeated on a new worker (the killed one still has to stop)."""
    for attempt in range(3):
        svc = suite.add_worker(f"w{attempt}", engine_process=True)
        if attempt == 0:
            suite.add_router()
        call = suite.stub.Generate(router_pb2.GenerateRequest(text=LONG_PREFIX, max_new_tokens=1500, temperature=0.0),
                                   timeout=TIMEOUT)
        received = len(next(call).token_ids)
        assert received
        engine = _engine(svc)
        os.kill(engine.pid, signal.SIGKILL)
        try:
            for message in call:
                received += len(message.token_ids)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            break
        finally:
            end = time.monotonic() + TIMEOUT
            while svc.server.serving:  # it stops itself, so a supervisor starts a new incarnation
                assert time.monotonic() < end, "the worker kept serving without an engine"
                time.sleep(0.05)
            assert engine.exited
        assert received == 1500, "a stream ended early without an error"  # it was over before the kill
    else:
        pytest.fail("the request finished before the kill in every try")
    stats = suite.wait_no_live_reservations(timeout_s=15)  # its lease lapses: the kvstore frees it all
    assert stats.live_reservations == 0
    check = suite.invariants()
    assert check.ok, check.violations


def test_the_engine_process_does_not_outlive_a_killed_worker(suite):
    proc = spawn_worker_process(suite.kv.address, "doomed", engine_process=True)
    try:
        wait_registered(suite, "doomed", proc)
        children = children_of(proc.pid)
        assert children, "the worker has no engine process"
        carriers = [pid for child in children for pid in _carriers_of(child)]
        assert len(carriers) == 1, "the engine process sends its kvstore verbs from a carrier process"
        children += carriers
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        end = time.monotonic() + 20
        while any(alive(pid) for pid in children):
            assert time.monotonic() < end, "the engine process or its carrier outlived the worker"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_dead_carrier_process_stops_the_engine_process_and_the_worker(suite):
    """Without its carrier no kvstore verb of the engine can go out: the engine process exits,
    and the worker stops with it, as when the engine process itself dies."""
    svc = suite.add_worker("lonely", engine_process=True)
    suite.add_router()
    assert suite.generate(LONG_PREFIX, max_new_tokens=4)[0]  # verbs went through the carrier
    engine = _engine(svc)
    _wait_disowned(engine)  # every answer is in: the engine is idle, with nothing in flight
    [carrier] = _carriers_of(engine.pid)
    os.kill(carrier, signal.SIGKILL)
    end = time.monotonic() + TIMEOUT
    while svc.server.serving:
        assert time.monotonic() < end, "the worker kept serving without a carrier"
        time.sleep(0.05)
    assert engine.exited and not alive(carrier)
