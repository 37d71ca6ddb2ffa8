"""The courier that keeps the kvstore off the engine's critical path: calls run in the order they
were sent, on its own thread; answers are applied only when the engine thread drains them, in
that same order; a blocking call waits for everything sent before it."""

from __future__ import annotations

import threading
import time

import pytest

from services.common.errors import Unavailable
from services.gpuworker.kvstore_courier import KVStoreCourier


@pytest.fixture
def courier():
    c = KVStoreCourier(retry_s=0)  # no retries here: riding through outages is tested below
    yield c
    c.close()


def test_answers_are_applied_in_send_order_only_when_drained(courier):
    ran, applied = [], []
    gate = threading.Event()
    courier.send(lambda: (gate.wait(5), ran.append("publish"))[1] or "p", applied.append, kind="publish")
    courier.send(lambda: ran.append("extend") or "e", applied.append, kind="extend")
    assert courier.in_flight("publish") == 1 and applied == []
    gate.set()
    assert courier.wait_idle(5)
    assert ran == ["publish", "extend"] and applied == ["p", "e"]
    assert courier.in_flight("publish") == 0


def test_nothing_is_applied_on_the_courier_thread(courier):
    applied = []
    courier.send(lambda: 1, lambda r: applied.append(threading.current_thread().name))
    time.sleep(0.1)
    assert applied == []  # answered, but not drained yet
    courier.drain()
    assert applied == [threading.current_thread().name]


def test_call_waits_for_earlier_calls_and_applies_their_answers_first(courier):
    order = []
    courier.send(lambda: time.sleep(0.05) or "slow", lambda r: order.append(r), kind="publish")
    assert courier.call(lambda: "now") == "now"
    assert order == ["slow"]  # the earlier answer was applied before call() returned


def test_exceptions_reach_on_done_or_the_caller(courier):
    got = []
    courier.send(lambda: (_ for _ in ()).throw(Unavailable("kvstore down")), got.append)
    with pytest.raises(Unavailable):
        courier.call(lambda: (_ for _ in ()).throw(Unavailable("still down")))
    assert len(got) == 1 and isinstance(got[0], Unavailable)


def test_closed_courier_refuses_new_calls():
    c = KVStoreCourier()
    c.close()
    with pytest.raises(RuntimeError):
        c.send(lambda: None)


class GatedFence:
    """A step fence the test completes by hand (on the GPU it is a CUDA event: see the gpu tests)."""

    def __init__(self):
        self.gate = threading.Event()

    def wait(self) -> None:
        assert self.gate.wait(5), "fence never completed"

    def done(self) -> bool:
        return self.gate.is_set()


def test_a_freeing_verb_waits_for_its_step_fence_off_the_engine_thread(courier):
    """Release/Abort/Trim go out only after the step that wrote the blocks completed (DESIGN §2),
    and the engine thread is not the one that waits: send returns at once."""
    fence, ran = GatedFence(), []
    t0 = time.monotonic()
    courier.send(lambda: ran.append("release"), kind="release", after=fence)
    courier.send(lambda: ran.append("publish"), kind="publish")  # FIFO: after the release
    assert time.monotonic() - t0 < 1.0
    time.sleep(0.1)
    assert ran == [] and courier.in_flight("release") == 1
    fence.gate.set()
    assert courier.wait_idle(5)
    assert ran == ["release", "publish"]


def test_cpu_steps_report_a_complete_fence():
    from services.gpuworker.engine.fence import StepFence
    import torch

    fence = StepFence.record(torch.device("cpu"))
    assert fence.done()
    fence.wait()  # returns at once


def _flaky(failures: list[Exception], answer="ok"):
    """A call that raises ``failures`` one by one, then answers."""
    calls = []

    def fn():
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return answer

    return fn, calls


def test_an_outage_is_ridden_through_where_a_retry_is_safe():
    from services.common.errors import Unavailable
    from services.gpuworker.kvstore_courier import retryable

    c = KVStoreCourier(retry_s=5.0)
    try:
        # The step's Extend (idempotent: a target capacity) rides through any UNAVAILABLE.
        fn, calls = _flaky([Unavailable("kvstore: Socket closed"), Unavailable("kvstore: failed to connect to all addresses")])
        assert c.call(fn) == "ok" and len(calls) == 3
        # The worker's Publish names the tokens the kvstore held before it: resent on any cut.
        got = []
        fn, calls = _flaky([Unavailable("kvstore: Stream removed (Socket closed)")])
        c.send(fn, got.append, kind="publish")
        assert c.wait_idle(5) and got == ["ok"] and len(calls) == 2
        # Any other call is sent again only when it certainly changed nothing.
        got = []
        fn, calls = _flaky([Unavailable("kvstore: this instance lost its Redis lease (another kvstore leads); retry")])
        c.send(fn, got.append, kind="other")
        fn2, calls2 = _flaky([Unavailable("kvstore: Socket closed")])
        c.send(fn2, got.append, kind="other")
        assert c.wait_idle(5)
        assert got[0] == "ok" and len(calls) == 2
        assert isinstance(got[1], Unavailable) and len(calls2) == 1  # ambiguous: not resent
    finally:
        c.close()
    assert not retryable("trim", ValueError("a bug is no outage"))
    # Bounded: past retry_s the last error is the answer.
    c = KVStoreCourier(retry_s=0.1)
    try:
        fn, calls = _flaky([Unavailable("kvstore: failed to connect")] * 100)
        try:
            c.call(fn)
        except Unavailable:
            pass
        else:
            raise AssertionError("an outage longer than retry_s must surface")
        assert 2 <= len(calls) < 10
    finally:
        c.close()
