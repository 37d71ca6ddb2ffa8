"""The courier's ordering rules under any interleaving of sends, fences completing, drains and
blocking calls (hypothesis state machine against a list model), checked after every step:

* the carrier runs verbs in the order they were sent, and none before its step fence completed
  (DESIGN §2: a freeing verb goes out only after the step that last wrote its blocks);
* answers are applied on the engine thread, in send order, each once;
* ``in_flight`` and ``busy`` count exactly the verbs sent and not yet applied.
"""

from __future__ import annotations

import threading
import time

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.gpuworker.engine.fence import COMPLETE
from services.gpuworker.kvstore_carrier import ThreadCarrier
from services.gpuworker.kvstore_courier import KVStoreCourier

KINDS = ("publish", "extend", "trim", "release", "abort")


class Fence:
    """A step fence completed by the test (a CUDA event on the GPU)."""

    def __init__(self):
        self.gate = threading.Event()

    def done(self) -> bool:
        return self.gate.is_set()

    def wait(self) -> None:
        assert self.gate.wait(5), "waited on a fence nobody completes"


class RecordingLink:
    """Runs each verb on the carrier thread, noting its number and whether its fence was done."""

    def __init__(self):
        self.ran: list[tuple[int, bool]] = []

    def verb(self, n: int, fence) -> int:
        self.ran.append((n, fence.done()))
        return n


class CourierMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.link = RecordingLink()
        self.courier = KVStoreCourier(ThreadCarrier(self.link, retry_s=0))
        self.sent: list[tuple[int, str, object]] = []  # (n, kind, fence): the model
        self.applied: list[int] = []

    def teardown(self):
        for _, _, fence in self.sent:
            if fence is not COMPLETE:
                fence.gate.set()
        self.courier.close()

    @rule(kind=st.sampled_from(KINDS), gated=st.booleans())
    def send(self, kind, gated):
        n = len(self.sent)
        fence = Fence() if gated else COMPLETE
        self.sent.append((n, kind, fence))
        self.courier.send(kind, "verb", lambda: (n, fence), self.applied.append, after=fence)

    @rule(data=st.data())
    def complete_a_fence(self, data):
        pending = [f for _, _, f in self.sent if f is not COMPLETE and not f.done()]
        if pending:
            data.draw(st.sampled_from(pending)).gate.set()

    @rule()
    def drain(self):
        self.courier.drain()
        # let the carrier run what was shipped before any fence can complete in a later step, so
        # that a verb shipped too early is seen running before its fence (no race hides it)
        shipped = len(self.sent) - len(self.courier._held)
        deadline = time.monotonic() + 5
        while len(self.link.ran) < shipped:
            assert time.monotonic() < deadline, "the carrier did not run what was shipped"
            time.sleep(0.0005)

    @precondition(lambda self: all(f.done() for _, _, f in self.sent))
    @rule()
    def call(self):
        """A step's blocking Extend: every earlier answer is applied before it returns."""
        n = len(self.sent)
        self.sent.append((n, "call", COMPLETE))
        assert self.courier.call("verb", lambda: (n, COMPLETE), wait_s=5) == n
        self.applied.append(n)  # call's own answer is returned, not passed to an on_done
        assert self.applied == list(range(n + 1))

    @rule()
    def settle(self):
        for _, _, fence in self.sent:
            if fence is not COMPLETE:
                fence.gate.set()
        assert self.courier.wait_idle(5)
        assert self.applied == [n for n, _, _ in self.sent]
        assert not self.courier.busy

    @invariant()
    def carried_in_order_and_never_before_the_fence(self):
        ran = list(self.link.ran)
        assert [n for n, _ in ran] == list(range(len(ran)))
        assert all(done for _, done in ran)

    @invariant()
    def applied_in_order_each_once(self):
        assert self.applied == list(range(len(self.applied)))
        assert set(self.applied) <= {n for n, _ in self.link.ran}  # nothing applied that did not run

    @invariant()
    def in_flight_counts_what_is_sent_and_not_applied(self):
        done = set(self.applied)
        for kind in KINDS:
            assert self.courier.in_flight(kind) == sum(1 for n, k, _ in self.sent if k == kind and n not in done)
        assert self.courier.busy == (len(done) < len(self.sent))


CourierMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestCourierMachine = CourierMachine.TestCase
