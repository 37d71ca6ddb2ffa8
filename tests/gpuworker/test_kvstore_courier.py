"""The courier that keeps the kvstore off the engine's critical path: verbs go out in the order
they were sent, each only once its step fence completed, through a carrier (a thread, or a
process of its own); answers are applied only when the engine thread drains them, in that same
order; a blocking call waits for everything sent before it.

The semantics are pinned with a thread carrier over a link whose one method runs what it is given
(a verb's behaviour, scripted per test); the process carrier is then driven against a real
kvstore, through a real link in the carrier process."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from services.common.errors import FailedPrecondition, NotFound, Unavailable
from services.gpuworker.engine.fence import COMPLETE
from services.gpuworker.kvstore_carrier import CarrierGone, LinkRecipe, ProcessCarrier, ThreadCarrier, retryable
from services.gpuworker.kvstore_courier import KVStoreCourier


class RunLink:
    """A link whose verb ``run(fn)`` answers ``fn()``; it records the carrier thread's name."""

    def __init__(self):
        self.threads: list[str] = []

    def run(self, fn):
        self.threads.append(threading.current_thread().name)
        return fn()


def send(courier: KVStoreCourier, fn, on_done=None, kind: str = "other", after=COMPLETE) -> None:
    courier.send(kind, "run", lambda: (fn,), on_done, after=after)


def call(courier: KVStoreCourier, fn, **kw):
    return courier.call("run", lambda: (fn,), **kw)


@pytest.fixture
def courier():
    c = KVStoreCourier(ThreadCarrier(RunLink(), retry_s=0))  # no retries: outages are tested below
    yield c
    c.close()


def test_answers_are_applied_in_send_order_only_when_drained(courier):
    ran, applied = [], []
    gate = threading.Event()
    send(courier, lambda: (gate.wait(5), ran.append("publish"))[1] or "p", applied.append, kind="publish")
    send(courier, lambda: ran.append("extend") or "e", applied.append, kind="extend")
    assert courier.in_flight("publish") == 1 and courier.busy and applied == []
    gate.set()
    assert courier.wait_idle(5)
    assert ran == ["publish", "extend"] and applied == ["p", "e"]
    assert courier.in_flight("publish") == 0 and not courier.busy


def test_nothing_is_applied_on_the_carrier_thread(courier):
    applied = []
    send(courier, lambda: 1, lambda r: applied.append(threading.current_thread().name))
    assert courier.drain() == 0  # shipped now, with whatever else the turn sent
    time.sleep(0.1)
    assert applied == []  # answered, but not drained yet
    courier.drain()
    assert applied == [threading.current_thread().name]
    assert courier._carrier.loop.link.threads == ["kvstore-carrier"]  # the call itself ran there


def test_a_turns_verbs_travel_as_one_message():
    """Each message to a carrier process is a pickle and a write that wakes it: the verbs a turn
    sent go out together at its drain, behind a fence that has not completed yet if need be."""
    puts = []

    class Counting(ThreadCarrier):
        def put(self, message):
            puts.append(message)
            super().put(message)

    c = KVStoreCourier(Counting(RunLink()))
    fence = GatedFence()
    try:
        for kind in ("publish", "extend", "release"):
            send(c, lambda: kind, kind=kind)
        send(c, lambda: "held", kind="release", after=fence)
        send(c, lambda: "after it", kind="abort")
        assert puts == []
        c.drain()
        assert [m[0] for m in puts] == ["verbs"] and [v[1] for v in puts[0][1]] == ["publish", "extend", "release"]
        fence.gate.set()
        assert c.wait_idle(5) and [v[1] for v in puts[1][1]] == ["release", "abort"] and len(puts) == 2
    finally:
        c.close()


def test_call_waits_for_earlier_calls_and_applies_their_answers_first(courier):
    order = []
    send(courier, lambda: time.sleep(0.05) or "slow", lambda r: order.append(r), kind="publish")
    assert call(courier, lambda: "now") == "now"
    assert order == ["slow"]  # the earlier answer was applied before call() returned


def test_a_late_call_raises_and_its_answer_goes_to_on_late(courier):
    from services.gpuworker.kvstore_carrier import LateAnswer

    gate, late = threading.Event(), []
    with pytest.raises(LateAnswer):
        call(courier, lambda: gate.wait(5) and "at last", wait_s=0.05, on_late=late.append)
    assert late == []
    gate.set()
    assert courier.wait_idle(5) and late == ["at last"]


def test_exceptions_reach_on_done_or_the_caller(courier):
    got = []
    send(courier, lambda: (_ for _ in ()).throw(Unavailable("kvstore down")), got.append)
    with pytest.raises(Unavailable):
        call(courier, lambda: (_ for _ in ()).throw(Unavailable("still down")))
    assert len(got) == 1 and isinstance(got[0], Unavailable)
    # a bug in a verb reaches its caller as a RuntimeError naming it (what crosses a pipe)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        call(courier, lambda: 1 / 0)


def test_closed_courier_refuses_new_calls():
    c = KVStoreCourier(ThreadCarrier(RunLink()))
    c.close()
    with pytest.raises(RuntimeError):
        send(c, lambda: None)


class GatedFence:
    """A step fence the test completes by hand (on the GPU it is a CUDA event: see the gpu tests)."""

    def __init__(self):
        self.gate = threading.Event()

    def wait(self) -> None:
        assert self.gate.wait(5), "fence never completed"

    def done(self) -> bool:
        return self.gate.is_set()


def test_a_freeing_verb_is_held_until_its_step_fence_completes_without_waiting_for_it(courier):
    """Release/Abort/Trim go out only after the step that wrote the blocks completed (DESIGN §2),
    and the engine thread does not wait for the device: it asks the fence as it sends and drains."""
    fence, ran = GatedFence(), []
    t0 = time.monotonic()
    send(courier, lambda: ran.append("release"), kind="release", after=fence)
    send(courier, lambda: ran.append("publish"), kind="publish")  # FIFO: after the release
    assert courier.drain() == 0
    assert time.monotonic() - t0 < 1.0
    time.sleep(0.1)
    assert ran == [] and courier.in_flight("release") == 1
    fence.gate.set()
    courier.drain()  # ships both now; their answers come later
    assert courier.wait_idle(5)
    assert ran == ["release", "publish"]


def test_a_verbs_arguments_are_built_when_it_is_shipped(courier):
    """A verb held behind a fence names what its owner holds when it goes out (an incarnation
    renewed by a re-registration meanwhile), not what it held when it was queued."""
    fence, seen = GatedFence(), []
    job = {"incarnation": 1}
    courier.send("release", "run", lambda: (lambda inc=job["incarnation"]: seen.append(inc) or inc,), after=fence)
    job["incarnation"] = 2
    fence.gate.set()
    assert courier.wait_idle(5) and seen == [2]


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
    c = KVStoreCourier(ThreadCarrier(RunLink(), retry_s=5.0))
    try:
        # The step's Extend (idempotent: a target capacity) rides through any UNAVAILABLE.
        fn, calls = _flaky([Unavailable("kvstore: Socket closed"), Unavailable("kvstore: failed to connect to all addresses")])
        assert call(c, fn) == "ok" and len(calls) == 3 and c.retries == 2 and not c.resending
        # The worker's Publish names the tokens the kvstore held before it: resent on any cut.
        got = []
        fn, calls = _flaky([Unavailable("kvstore: Stream removed (Socket closed)")])
        send(c, fn, got.append, kind="publish")
        assert c.wait_idle(5) and got == ["ok"] and len(calls) == 2
        # Any other call is sent again only when it certainly changed nothing.
        got = []
        fn, calls = _flaky([Unavailable("kvstore: this instance lost its Redis lease (another kvstore leads); retry")])
        send(c, fn, got.append, kind="other")
        fn2, calls2 = _flaky([Unavailable("kvstore: Socket closed")])
        send(c, fn2, got.append, kind="other")
        assert c.wait_idle(5)
        assert got[0] == "ok" and len(calls) == 2
        assert isinstance(got[1], Unavailable) and len(calls2) == 1  # ambiguous: not resent
    finally:
        c.close()
    assert not retryable("trim", ValueError("a bug is no outage"))
    # Bounded: past retry_s the last error is the answer.
    c = KVStoreCourier(ThreadCarrier(RunLink(), retry_s=0.1))
    try:
        fn, calls = _flaky([Unavailable("kvstore: failed to connect")] * 100)
        with pytest.raises(Unavailable):
            call(c, fn)
        assert 2 <= len(calls) < 10
    finally:
        c.close()


class ForgetfulLink:
    """A kvstore that knows only incarnation ``current``: verbs naming another are NOT_FOUND.
    ``forgot_us`` (asked by the carrier, off the engine thread) answers ``forgot``, and with it
    the worker "re-registers": its job's incarnation and the link's generation move."""

    def __init__(self, current: int, job: dict, forgot: bool):
        self.current, self.job, self.forgot = current, job, forgot
        self.seen: list[int] = []
        self.asked_on: list[str] = []

    def release(self, incarnation: int) -> int:
        self.seen.append(incarnation)
        if incarnation != self.current:
            raise NotFound("kvstore: unknown reservation")
        return incarnation

    def forgot_us(self, generation: int) -> bool:
        self.asked_on.append(threading.current_thread().name)
        if self.forgot:
            self.job.update(incarnation=self.current, generation=generation + 1)
        return self.forgot


def _forgetful(forgot: bool):
    job = {"incarnation": 1, "generation": 0}
    link = ForgetfulLink(2, job, forgot)
    c = KVStoreCourier(ThreadCarrier(link, retry_s=5.0))
    c.registration = lambda: (job["incarnation"], job["generation"])
    return c, link, job


@pytest.mark.parametrize("forgot", [True, False])
def test_a_verb_the_kvstore_forgot_is_resent_with_its_arguments_built_again(forgot):
    """A memory kvstore restarted: a worker verb answered NOT_FOUND is resent once the worker
    re-registered, naming the new incarnation; if the kvstore did not forget us, the error stands.
    Whether it forgot is asked off the engine thread (a Heartbeat)."""
    c, link, job = _forgetful(forgot)
    got, after = [], []
    try:
        c.send("release", "release", lambda: (job["incarnation"],), got.append)
        c.send("other", "release", lambda: (2,), after.append)  # FIFO: waits behind the stuck verb
        assert c.wait_idle(5)
    finally:
        c.close()
    if forgot:
        assert got == [2] and link.seen == [1, 2, 2]
    else:
        assert isinstance(got[0], NotFound) and link.seen == [1, 2]
    assert after == [2] and link.asked_on == ["kvstore-carrier"]


def test_verbs_queued_through_a_restart_are_all_rebuilt_in_one_round_trip():
    """Fifty verbs shipped before the worker re-registered: the first comes back stuck, and the
    engine thread rebuilds every one of them at once: each is sent once more at most, at once."""
    c, link, job = _forgetful(True)
    got = []
    try:
        for _ in range(50):
            c.send("release", "release", lambda: (job["incarnation"],), got.append)
        started = time.monotonic()
        assert c.wait_idle(5)
        assert time.monotonic() - started < 1.0
    finally:
        c.close()
    assert got == [2] * 50 and link.seen == [1] + [2] * 50 and link.asked_on == ["kvstore-carrier"]


def test_a_worker_verb_of_an_unknown_kind_is_not_resent_when_forgotten():
    c, link, job = _forgetful(True)
    got = []
    try:
        c.send("other", "release", lambda: (1,), got.append)
        assert c.wait_idle(5)
    finally:
        c.close()
    assert isinstance(got[0], NotFound) and link.seen == [1] and link.asked_on == []


# -- the process carrier, against a real kvstore ------------------------------------------------------


def _registered(svc):
    from services.common.spec import SpecMode
    from services.gpuworker.kvstore_link import KVStoreLink

    link = KVStoreLink(svc.address, timeout_s=2.0)
    info = link.register(worker_id="w", address="x", model_id="m", spec_mode=SpecMode.NONE, mtp_depth=0,
                         block_size=4, num_blocks=32, vocab_size=100, max_seq_len=64)
    return link, info.incarnation


def test_a_process_carrier_carries_every_verb_to_the_kvstore_in_order(start_kvstore):
    from services.gpuworker.kvstore_link import CapacityAnswer, PublishAnswer

    svc = start_kvstore()
    link, inc = _registered(svc)
    r = svc.in_loop(lambda: svc.payload.reserve(worker_id="w", incarnation=inc, request_id="q",
                                                tokens=list(range(10)), headroom_positions=2))
    carrier = ProcessCarrier(LinkRecipe(svc.address, 2.0, "w"))
    c = KVStoreCourier(carrier)
    c.registration = lambda: (inc, 0)  # the carrier's link follows it (its Heartbeats name it)
    got = []
    try:
        assert carrier.pid != os.getpid()
        c.send("publish", "publish_many", lambda: ([(r.reservation_id, inc, [], 8, 0)],), got.append)
        c.send("extend", "extend", lambda: ([(r.reservation_id, inc, 20)],), got.append)
        c.send("trim", "trim", lambda: ([(r.reservation_id, inc, 16)],), got.append)
        c.send("release", "release", lambda: (r.reservation_id, inc, [10, 11], 12), got.append)
        c.send("abort", "abort", lambda: (r.reservation_id, inc), got.append)  # ended already: tolerated
        assert c.wait_idle(10)
        [published], [extended], [trimmed], released, aborted = got
        assert isinstance(published, PublishAnswer) and published.published_blocks == 2
        assert published.block_table == list(r.block_table)
        assert isinstance(extended, CapacityAnswer) and extended.code == 0 and len(extended.block_table) == 5
        assert trimmed.code == 0 and len(trimmed.block_table) == 4
        assert released is True and aborted is None
        stats = svc.in_loop(lambda: svc.payload.stats())
        assert stats.live_reservations == 0
        # a kvstore error comes back typed, at once (the kvstore knows us: nothing to resend)
        started = time.monotonic()
        with pytest.raises(NotFound):
            c.call("release", lambda: ("r-ghost", inc, [], 4))
        assert time.monotonic() - started < 2.0 and c.retries == 0
    finally:
        c.close()
        link.close()


def test_a_dead_carrier_process_answers_every_verb_with_unavailable(start_kvstore):
    svc = start_kvstore()
    carrier = ProcessCarrier(LinkRecipe(svc.address, 2.0, "w"))
    c = KVStoreCourier(carrier)
    gone, got = [], []
    c.on_gone = gone.append
    try:
        assert c.call("abort", lambda: ("r-x", 0)) is None  # up and answering
        os.kill(carrier.pid, signal.SIGKILL)
        c.send("abort", "abort", lambda: ("r-x", 0), got.append)
        c.wait_idle(5)
        c.send("abort", "abort", lambda: ("r-x", 0), got.append)  # after it is known gone
        c.drain()
        assert len(got) == 2 and all(isinstance(g, CarrierGone) for g in got)
        assert len(gone) == 1 and isinstance(gone[0], Unavailable)
    finally:
        c.close()


def test_failed_precondition_counts_as_forgotten_for_worker_verbs():
    from services.gpuworker.kvstore_carrier import maybe_forgotten

    assert maybe_forgotten("publish", FailedPrecondition("kvstore: stale incarnation"))
    assert not maybe_forgotten("other", FailedPrecondition("x")) and not maybe_forgotten("publish", Unavailable("x"))


def test_sending_never_blocks_on_a_carrier_process_that_is_riding_out_an_outage():
    """No kvstore answers (an outage): the carrier retries its first verb, and the engine thread
    goes on sending — megabytes, far past what a pipe buffers — without blocking on the pipe."""
    from tests.free_ports import free_port

    carrier = ProcessCarrier(LinkRecipe(f"127.0.0.1:{free_port()}", 1.0, "w"), retry_s=60.0)
    c = KVStoreCourier(carrier)
    try:
        assert carrier.get(0.5) is None  # up, and nothing to say

        def engine() -> None:
            for i in range(300):
                c.send("publish", "publish_many", lambda: ([(f"r-{i}", 1, list(range(2000)), 8, 0)],))

        sender = threading.Thread(target=engine, daemon=True)  # a blocked send cannot time out: watch it
        sender.start()
        sender.join(10.0)
        assert not sender.is_alive(), "the engine thread blocked sending to the carrier"
        assert c.busy and c.drain() == 0
    finally:
        carrier.close(timeout_s=0.5)  # killed: its retries would take minutes


def test_a_carrier_process_starts_whatever_the_working_directory_holds(tmp_path, monkeypatch, start_kvstore):
    """A ``services`` package in the working directory (a user's project) must not shadow ours."""
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    svc = start_kvstore()
    c = KVStoreCourier(ProcessCarrier(LinkRecipe(svc.address, 2.0, "w")))
    try:
        assert c.call("abort", lambda: ("r-x", 0)) is None
    finally:
        c.close()


def test_a_carrier_process_that_cannot_start_says_so_at_once():
    with pytest.raises(CarrierGone):
        ProcessCarrier(LinkRecipe("127.0.0.1:1", 1.0, "w", settings={"port": -5}), start_timeout_s=30)


def test_a_carrier_process_ignores_ctrl_c(start_kvstore):
    """Ctrl-C reaches the whole process group; the engine still has Aborts to send as it stops,
    so its carrier must outlive the signal and leave when it is told to."""
    svc = start_kvstore()
    carrier = ProcessCarrier(LinkRecipe(svc.address, 2.0, "w"))
    c = KVStoreCourier(carrier)
    try:
        os.kill(carrier.pid, signal.SIGINT)
        os.kill(carrier.pid, signal.SIGTERM)
        time.sleep(0.2)
        assert c.call("abort", lambda: ("r-x", 0)) is None
    finally:
        c.close()
    assert carrier._process.wait(5) == 0


def test_closing_stops_a_verb_retrying_through_an_outage():
    c = KVStoreCourier(ThreadCarrier(RunLink(), retry_s=60.0))
    fn, calls = _flaky([Unavailable("kvstore: failed to connect")] * 10_000)
    send(c, fn, kind="publish")
    c.drain()
    time.sleep(0.1)
    started = time.monotonic()
    c.close(timeout_s=10)
    assert time.monotonic() - started < 2.0 and not c._carrier._thread.is_alive()
