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
    c = KVStoreCourier()
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
