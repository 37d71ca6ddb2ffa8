"""A step's fence, which the kvstore courier waits on while the engine launches the next step,
puts its waiter to sleep; a verdict's fence, which the engine thread waits on, spins for the
fastest answer (services/gpuworker/engine/fence.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.gpuworker.engine.fence import StepFence

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda", 0)
SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of a spinning kernel


def _wait_cpu_share(fence: StepFence) -> tuple[float, float]:
    """(the waiting thread's CPU time ÷ its wall time, wall seconds) of ``fence.wait()`` run on a
    thread of its own."""
    out = {}

    def wait():
        c0, t0 = time.thread_time(), time.perf_counter()
        fence.wait()
        out["cpu"], out["wall"] = time.thread_time() - c0, time.perf_counter() - t0

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(30)
    return out["cpu"] / out["wall"], out["wall"]


@pytest.mark.parametrize("blocking", [True, False], ids=["step-fence-sleeps", "verdict-fence-spins"])
def test_a_blocking_fence_sleeps_through_the_wait_and_a_spinning_one_does_not(blocking):
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    fence = StepFence.record(DEV, blocking=blocking)
    assert not fence.done()
    share, wall = _wait_cpu_share(fence)
    assert fence.done() and wall > 0.05  # it did wait for the kernel
    if blocking:
        assert share < 0.2, f"a blocking fence's waiter used {share:.0%} of a core"
        torch.cuda._sleep(SLEEP_CYCLES // 10)
        polled = StepFence.record(DEV, blocking=True)
        assert not polled.done()
        polled.wait_polling()  # the engine thread's way through a blocking fence (LocalBlockSource.trim)
        assert polled.done()
    else:
        assert share > 0.5, f"a spinning fence's waiter used only {share:.0%} of a core"


def test_a_readback_behind_a_busy_device_counts_its_wait():
    """``Readback.take_wait``: the engine's device-wait metric is the time its reads spent
    behind the device (services/gpuworker/engine/readback.py)."""
    from services.gpuworker.engine.readback import Readback

    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES // 5)
    r = Readback(torch.arange(8, device=DEV))
    assert r.values() == list(range(8))
    assert r.take_wait() > 0.02 and r.take_wait() == 0.0
    ready = Readback(torch.arange(8, device=DEV))
    torch.cuda.synchronize()
    ready.values()
    assert ready.take_wait() < 0.01  # the device was done before the host asked

