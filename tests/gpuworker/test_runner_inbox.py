"""An engine process's requests reach the engine thread on a pipe that the thread reads itself
(``EngineRunner(inbox=...)``) between steps: what other threads queue for it (stop, a
re-registration) must still wake it while it idles on that pipe, a request that does not
unpickle must not end it, and the gRPC side's sends must never block on a pipe that the engine
thread does not read during a step (``_RequestSender``)."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from services.common.errors import Cancelled
from services.gpuworker import runner as runner_module
from services.gpuworker.engine_process import _RequestSender
from services.gpuworker.kvstore_link import KVStoreLink
from services.gpuworker.runtime import build_runtime
from services.gpuworker.settings import WorkerSettings


@pytest.fixture
def idle_runner(monkeypatch, kvstore_service):
    # the idle wait far longer than stop's join: only the queue's wake-up can end the thread in time
    monkeypatch.setattr(runner_module, "IDLE_WAIT_S", 120.0)
    inbox, requests = multiprocessing.Pipe(duplex=False)
    settings = WorkerSettings(kvstore=kvstore_service.address, device="cpu", kvstore_carrier="thread")
    link = KVStoreLink(settings.kvstore, timeout_s=5.0)
    runner, _facts = build_runtime(settings, link, inbox=inbox)
    runner.start()
    try:
        yield runner, inbox, requests
    finally:
        runner.stop(timeout_s=20.0)
        requests.close()
        inbox.close()
        runner.courier.close()
        link.close()


def test_an_engine_thread_idling_on_its_inbox_wakes_for_stop(idle_runner):
    runner, _inbox, _requests = idle_runner
    assert runner._thread.is_alive()
    runner.stop(timeout_s=20.0)
    assert not runner._thread.is_alive(), "stop did not wake the engine thread idling on its inbox"


def _refuse_to_unpickle():
    raise ValueError("not a request")


class Unreadable:
    def __reduce__(self):
        return _refuse_to_unpickle, ()


def test_a_request_that_does_not_unpickle_is_dropped_and_the_engine_thread_runs_on(idle_runner):
    runner, inbox, requests = idle_runner
    requests.send(("add", Unreadable()))
    requests.send(("abort", "no-such-request", Cancelled("test")))
    end = time.monotonic() + 20
    while inbox.poll(0):  # until the engine thread has read both
        assert time.monotonic() < end, "the engine thread did not read its inbox"
        time.sleep(0.01)
    runner._thread.join(0.5)
    assert runner._thread.is_alive(), "an unreadable request ended the engine thread"


def test_request_sends_never_block_and_arrive_whole_and_in_order():
    reader, writer = multiprocessing.Pipe(duplex=False)
    sender = _RequestSender(writer)
    # 40 messages of ~100 KB (a long prompt each) into a 64 KiB pipe nobody reads yet, small
    # ones between them: a blocking send would hang this thread
    messages = [("add", i, list(range(i, i + (20_000 if i % 2 else 3)))) for i in range(40)]
    sending = threading.Thread(target=lambda: [sender.send(m) for m in messages], daemon=True)
    sending.start()
    sending.join(20)
    assert not sending.is_alive(), "a send blocked on a full pipe"
    received = [reader.recv() for _ in messages]  # the backlog is written as the reader makes room
    assert received == messages
    sender.send(("abort", "last"))  # after a backlog, the fast path again
    assert reader.recv() == ("abort", "last")
    sender.close()
    reader.close()


def test_sends_to_a_reader_that_is_gone_are_dropped():
    reader, writer = multiprocessing.Pipe(duplex=False)
    sender = _RequestSender(writer)
    reader.close()
    sender.send(("add", list(range(50_000))))  # no error: the engine process's supervisor notices
    sender.send(("abort", "x"))
    sender.close()


def test_an_answer_without_a_table_that_contradicts_an_applied_remap_ends_the_request(kvstore_service):
    """A Publish answered without a table says the kvstore holds the blocks it published as the
    request held them when it was made. If an answer applied since moved one of them (a remap),
    and this answer still says the old ones, the kvstore lost that remap (a Redis crash within
    its everysec window): the request ends with UNAVAILABLE instead of reading blocks the kvstore
    may hand out again (found by review). An answer that agrees changes nothing."""
    import queue

    from services.common.errors import Unavailable
    from services.gpuworker.engine.request import RequestSpec
    from services.gpuworker.kvstore_link import PublishAnswer
    from services.gpuworker.runner import Job

    settings = WorkerSettings(kvstore=kvstore_service.address, device="cpu", kvstore_carrier="thread")
    link = KVStoreLink(settings.kvstore, timeout_s=5.0)
    runner, _facts = build_runtime(settings, link)  # not started: this thread plays the engine thread
    try:
        bs = runner.engine.block_size
        table = list(range(1, 5))
        job = Job(RequestSpec(request_id="r", prompt_ids=list(range(2 * bs + 1)), block_table=table), "res-r", 1)
        runner._admit(job)
        assert runner.engine_has("r")
        published = table[:2]
        runner._published("r", PublishAnswer(2, None), [], published)  # agrees: nothing to do
        assert runner._commands.empty() and job.published_blocks == 2
        runner.engine.state("r").block_table = [9, 2, 3, 4]  # a remap applied since (block 0 deduplicated)
        runner._published("r", PublishAnswer(2, None), [], published)
        kind, rid, reason = runner._commands.get_nowait()
        assert (kind, rid) == ("abort", "r") and isinstance(reason, Unavailable)
        with pytest.raises(queue.Empty):
            runner._commands.get_nowait()
    finally:
        runner.courier.close()
        link.close()


def test_the_pipe_outbox_ships_idle_time_with_events_or_once_enough_has_gathered():
    """An engine process reports its idle waits through the events pipe (``PipeOutbox``): with a
    turn's events whatever has gathered, on its own only from ``IDLE_SHIP_S`` on (an idle loop
    waits 2 ms at a time on kvstore answers and must not send a message each time)."""
    from services.gpuworker.engine_process import IDLE_SHIP_S, PipeOutbox

    reader, writer = multiprocessing.Pipe(duplex=False)
    outbox = PipeOutbox(writer)
    outbox.idle(IDLE_SHIP_S / 4)
    outbox.idle(IDLE_SHIP_S / 4)
    outbox.flush()
    assert not reader.poll(0.05)  # half of the threshold: nothing sent
    outbox.disown("r1")
    outbox.flush()  # a message goes anyway: the idle time so far rides along
    kind, events, disowned, _running, tallies, idle_s = reader.recv()
    assert (kind, events, disowned, tallies) == ("events", [], ["r1"], [])
    assert idle_s == pytest.approx(IDLE_SHIP_S / 2)
    outbox.idle(IDLE_SHIP_S)
    outbox.flush()  # enough on its own
    assert reader.recv()[-1] == pytest.approx(IDLE_SHIP_S)
    outbox.flush()  # and counted once
    assert not reader.poll(0.05)
    reader.close()
    writer.close()
