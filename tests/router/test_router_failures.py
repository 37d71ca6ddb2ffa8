"""Router.Generate when things go wrong: worker failures, deadlines, cancellation, capacity."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from router_rig import TIMEOUT, Script, collect, wait_serving
from services.common.tokenizer import ByteTokenizer
from tandem.router.v1 import router_pb2

VOCAB = ByteTokenizer().vocab_size


def _wait(predicate, timeout=5.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)


# ----------------------------------------------------------------------------- worker failures
def test_failure_before_the_first_token_retries_on_the_next_worker(rig):
    bad = rig.worker("a", Script(fail_before_first=True))
    good = rig.worker("b")
    load = rig.occupy("b", 1)  # b is busier, so the policy tries a first
    router = rig.router()
    msgs, err = collect(router, text="retry me", max_new_tokens=5, request_id="r1")
    assert err is None, err
    assert msgs[-1].usage.worker_id == "b"
    scope = bad.requests[0].request_id.partition("/")[0]  # the tenant's (request ids are per tenant)
    r1 = f"{scope}/r1"
    assert [r.request_id for r in bad.requests] == [r1]
    assert [r.request_id for r in good.requests] == [f"{r1}~1"]  # a fresh kvstore request id per attempt
    assert bad.ended == {r1: "aborted"} and good.ended == {f"{r1}~1": "released"}
    _wait(lambda: bad.abort_probes == [r1])  # the router checked who ends a's reservation
    rig.free(load)
    rig.wait_no_live_reservations()


def test_an_unreachable_registered_worker_is_never_routed_to(rig):
    """Issue 8 row 8: a registration nobody answers behind (dead or fake address) gets no
    request: the router probes a worker (Info) before routing to it."""
    rig.dead_worker("a")
    good = rig.worker("b")
    router = rig.router()
    before = rig.stats().reservations_created
    for i in range(4):
        msgs, err = collect(router, text=f"the first worker is gone {i}", max_new_tokens=3)
        assert err is None, err
        assert msgs[-1].usage.worker_id == "b"
    assert rig.stats().reservations_created == before + 4  # none on a
    assert len(good.requests) == 4
    rig.wait_no_live_reservations()


def test_attempts_are_bounded(rig):
    workers = [rig.worker(w, Script(fail_before_first=True)) for w in ("a", "b", "c")]
    router = rig.router(max_attempts=2)
    _, err = collect(router, text="nobody can serve this", max_new_tokens=3)
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
    assert "2 attempt(s) failed before the first token" in err.details()
    assert sum(len(w.requests) for w in workers) == 2
    rig.wait_no_live_reservations()


def test_failure_after_tokens_is_unavailable_and_not_retried(rig):
    flaky = rig.worker("a", Script(fail_after=3))
    spare = rig.worker("b")
    load = rig.occupy("b", 1)
    router = rig.router()
    msgs, err = collect(router, text="stream then die", max_new_tokens=10)
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
    assert "after 3 tokens were streamed" in err.details()
    assert [t for m in msgs for t in m.token_ids] == [flaky.script.token(i) for i in range(3)]
    assert spare.requests == []
    rig.free(load)
    rig.wait_no_live_reservations()


# ---------------------------------------------------------------------- deadlines, cancellation
def test_deadline_cancels_the_worker_which_aborts(rig):
    slow = rig.worker("a", Script(delay_s=0.05))
    router = rig.router()
    t0 = time.monotonic()
    msgs, err = collect(router, text="take your time", max_new_tokens=200, timeout=0.6)
    assert err is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 3
    assert 0 < len(msgs) < 200
    (req,) = slow.requests
    _wait(lambda: slow.ended.get(req.request_id) == "aborted")
    rig.wait_no_live_reservations()


def test_client_cancel_cancels_the_worker(rig):
    slow = rig.worker("a", Script(delay_s=0.05))
    router = rig.router()
    call = router.stub.Generate(router_pb2.GenerateRequest(temperature=0.0, text="cancel me", max_new_tokens=200), timeout=TIMEOUT)
    first = next(call)
    assert first.token_ids
    call.cancel()
    (req,) = slow.requests
    _wait(lambda: slow.ended.get(req.request_id) == "aborted")
    rig.wait_no_live_reservations()


# ------------------------------------------------------------------------------------ capacity
def test_resource_exhausted_falls_through_to_the_next_worker(rig):
    small = rig.worker("a", num_blocks=8)
    big = rig.worker("b", num_blocks=64)
    holds = [rig.occupy("a", 7), rig.occupy("b", 1, tag="x"), rig.occupy("b", 1, tag="y")]
    # costs: a = missing + 0.07 + 2·1, b = missing + 0.02 + 2·2: a is first but has 1 free block
    router = rig.router()
    msgs, err = collect(router, text="needs two blocks", max_new_tokens=2)
    assert err is None, err
    assert msgs[-1].usage.worker_id == "b"
    assert small.requests == [] and len(big.requests) == 1
    for h in holds:
        rig.free(h)
    rig.wait_no_live_reservations()


def test_queued_request_runs_once_capacity_frees_up(rig):
    rig.worker("a", num_blocks=4)
    hold = rig.occupy("a", 3)
    router = rig.router()
    timer = threading.Timer(0.3, rig.free, args=(hold,))
    t0 = time.monotonic()
    timer.start()
    try:
        msgs, err = collect(router, text="wait for me please", max_new_tokens=2)  # 2 blocks
    finally:
        timer.join()
    assert err is None, err
    assert time.monotonic() - t0 >= 0.25
    assert msgs[-1].usage.worker_id == "a"
    rig.wait_no_live_reservations()


def test_full_queue_and_queue_timeout_are_resource_exhausted(rig):
    rig.worker("a", num_blocks=4)
    hold = rig.occupy("a", 3)
    no_queue = rig.router(max_queued=0)
    _, err = collect(no_queue, text="no room at all", max_new_tokens=2)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in err.details()

    short_wait = rig.router(max_queue_wait_s=0.2)
    t0 = time.monotonic()
    _, err = collect(short_wait, text="no room at all", max_new_tokens=2)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "before the deadline" in err.details()
    assert 0.15 <= time.monotonic() - t0 < 3

    # the client's own deadline bounds the wait too, and it still gets RESOURCE_EXHAUSTED (the
    # router gives up just before the deadline rather than letting it expire)
    patient = rig.router(max_queue_wait_s=30.0)
    t0 = time.monotonic()
    _, err = collect(patient, text="no room at all", max_new_tokens=2, timeout=0.8)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "before the deadline" in err.details()
    assert 0.5 <= time.monotonic() - t0 < 0.8
    rig.free(hold)
    rig.wait_no_live_reservations()


def test_a_prompt_that_can_never_fit_fails_at_once(rig):
    rig.worker("a", num_blocks=2)
    router = rig.router()
    t0 = time.monotonic()
    _, err = collect(router, text="x" * 100, max_new_tokens=2)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "never fit" in err.details()
    assert time.monotonic() - t0 < 2
    assert rig.stats().reservations_created == 0


# ------------------------------------------------------------------------------ bad requests
def test_bad_requests_change_nothing_in_the_kvstore(rig):
    rig.worker("a")
    router = rig.router(tenants="good-token=alice", max_new_tokens=50)
    ok = [("authorization", "Bearer good-token")]
    before = rig.stats()
    cases = [
        (dict(text="hi", max_new_tokens=5), None, grpc.StatusCode.UNAUTHENTICATED),
        (dict(text="hi", max_new_tokens=5), [("authorization", "Bearer wrong")], grpc.StatusCode.UNAUTHENTICATED),
        (dict(text="", max_new_tokens=5), ok, grpc.StatusCode.INVALID_ARGUMENT),
        (dict(max_new_tokens=5), ok, grpc.StatusCode.INVALID_ARGUMENT),
        (dict(text="hi", max_new_tokens=0), ok, grpc.StatusCode.INVALID_ARGUMENT),
        (dict(text="hi", max_new_tokens=51), ok, grpc.StatusCode.INVALID_ARGUMENT),
        (dict(token_ids={"list": {"values": [1, VOCAB]}}, max_new_tokens=5), ok, grpc.StatusCode.INVALID_ARGUMENT),
        (dict(token_ids={"packed": b"\x01\x00\x00"}, max_new_tokens=5), ok, grpc.StatusCode.INVALID_ARGUMENT),
        (dict(text="hi", max_new_tokens=5, num_draft_tokens=99), ok, grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for request, metadata, code in cases:
        _, err = collect(router, metadata=metadata, **request)
        assert err is not None and err.code() == code, (request, err)
    after = rig.stats()
    assert (after.matches, after.reservations_created, after.live_reservations) == (
        before.matches, before.reservations_created, before.live_reservations)
    # ... and the good token works
    _, err = collect(router, text="hi", max_new_tokens=2, metadata=ok)
    assert err is None


def test_no_worker_and_too_long_prompts(rig):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    router = rig.router(wait=False)  # NOT_SERVING: the kvstore answers but lists no worker
    time.sleep(0.5)
    health = health_pb2_grpc.HealthStub(router.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING
    _, err = collect(router, text="anyone?", max_new_tokens=2)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "no worker" in err.details()
    rig.worker("a", max_seq_len=32)
    wait_serving(router.channel)  # a registered worker is what makes it ready
    _, err = collect(router, text="y" * 40, max_new_tokens=2)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "longest sequence" in err.details()


@pytest.mark.parametrize("outage_wait_s", [0.0, 5.0])
def test_a_reserve_whose_answer_was_lost_is_reclaimed(start_kvstore, start_service, service_loop, outage_wait_s):
    """The kvstore reserves but answers too late. Riding through (``kvstore_outage_wait_s`` > 0)
    the router re-sends the identical Reserve, which returns that same reservation (idempotent
    per request id) and the request is served; not waiting, it gives the request up and then
    finds the orphan by re-sending the Reserve in the background, and aborts it."""
    import asyncio

    from router_rig import Rig
    from services.kvstore.servicer import KVStoreServicer

    class SlowFirstReserve(KVStoreServicer):
        slow = True

        async def Reserve(self, request, context):
            resp = await super().Reserve(request, context)  # the reservation exists from here on
            if SlowFirstReserve.slow:
                SlowFirstReserve.slow = False
                await asyncio.sleep(0.6)
            return resp

    kv = start_kvstore(SlowFirstReserve)
    rig = Rig(kv=kv, start_service=start_service, service_loop=service_loop)
    worker = rig.worker("a")
    router = rig.router(kvstore_timeout_s=0.3, kvstore_outage_wait_s=outage_wait_s)
    _, err = collect(router, text="the answer gets lost", max_new_tokens=2)
    if outage_wait_s:
        assert err is None and len(worker.requests) == 1
    else:
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE and "Reserve" in err.details()
        assert worker.requests == []
    assert rig.stats().reservations_created == 1
    rig.wait_no_live_reservations()


def test_a_lost_reserve_is_retried_with_the_same_headroom_when_the_candidates_change(start_kvstore, start_service,
                                                                                    service_loop):
    """Headroom covers the largest default k among the candidates of one Reserve. When that
    Reserve's answer is lost and the retry has other candidates (here "large", k = 7, drops out
    of Match), the retry still sends the first headroom: the kvstore refuses another one under
    a live request id, so a recomputed one would turn a served request into INVALID_ARGUMENT."""
    import asyncio

    from router_rig import Rig
    from services.kvstore.servicer import KVStoreServicer

    class LostAnswerThenFewerCandidates(KVStoreServicer):
        slow = True
        hidden: set[str] = set()

        async def Reserve(self, request, context):
            resp = await super().Reserve(request, context)  # the reservation exists from here on
            if LostAnswerThenFewerCandidates.slow and len(request.candidates) > 1:
                LostAnswerThenFewerCandidates.slow = False
                LostAnswerThenFewerCandidates.hidden.add("large")
                await asyncio.sleep(0.6)
            return resp

        async def Match(self, request, context):
            resp = await super().Match(request, context)
            kept = [w for w in resp.workers if w.worker_id not in LostAnswerThenFewerCandidates.hidden]
            del resp.workers[:]
            resp.workers.extend(kept)
            return resp

    kv = start_kvstore(LostAnswerThenFewerCandidates)
    rig = Rig(kv=kv, start_service=start_service, service_loop=service_loop)
    small = rig.worker("small", Script(num_draft_tokens=1))
    rig.worker("large", Script(num_draft_tokens=7))
    held = rig.occupy("large", 64)  # full: the first Reserve lands on "small", headroom 7 + 1
    router = rig.router(kvstore_timeout_s=0.3, kvstore_outage_wait_s=5.0)
    prompt = "lost answer, fewer workers.."  # 28 bytes: headroom 8 needs 3 blocks, headroom 2 only 2
    assert len(prompt) == 28
    _, err = collect(router, text=prompt, max_new_tokens=2)
    assert err is None, err
    assert rig.stats().reservations_created == 2  # the occupier's and this request's, reserved once
    (req,) = small.requests
    assert req.spec.num_draft_tokens == 1
    assert len(small.reservations[0].block_table) * 16 >= len(prompt) + 7 + 1
    rig.free(held)
    rig.wait_no_live_reservations()


@pytest.mark.parametrize("outage_wait_s", [0.0, 5.0])
def test_a_new_request_waits_out_a_short_kvstore_outage(start_kvstore, start_service, service_loop, outage_wait_s):
    """The kvstore answers UNAVAILABLE for a while (failing over to its standby): a new request
    waits (bounded by kvstore_outage_wait_s and its deadline) and is served once it is back;
    without the wait it gets UNAVAILABLE saying when to retry."""
    from router_rig import Rig
    from services.kvstore.servicer import KVStoreServicer

    class Outage(KVStoreServicer):
        down = 0  # Matches still to refuse

        async def Match(self, request, context):
            if Outage.down:
                Outage.down -= 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no leader yet")
            return await super().Match(request, context)

    kv = start_kvstore(Outage)
    rig = Rig(kv=kv, start_service=start_service, service_loop=service_loop)
    worker = rig.worker("a")
    router = rig.router(kvstore_outage_wait_s=outage_wait_s)
    Outage.down = 4
    _, err = collect(router, text="during a failover", max_new_tokens=2)
    if outage_wait_s:
        assert err is None and len(worker.requests) == 1 and Outage.down == 0
    else:
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE and "retry" in err.details()
        assert worker.requests == []
    rig.wait_no_live_reservations()


def test_a_new_request_waits_for_a_worker_to_register(rig):
    """A kvstore that just restarted empty lists no worker until they re-register: a new request
    waits for one (bounded, like an outage) instead of failing at once."""
    router = rig.router(wait=False, kvstore_outage_wait_s=5.0)  # no worker yet
    workers = []
    late = threading.Timer(0.5, lambda: workers.append(rig.worker("a")))
    late.start()
    _, err = collect(router, text="after a restart", max_new_tokens=2)
    late.join()
    assert err is None and len(workers[0].requests) == 1


@pytest.mark.parametrize("n, script", [(1, Script(delay_s=30.0)), (2, Script(stall_after=2))], ids=["silent", "n2-stalls"])
def test_row9_a_silent_worker_stream_fails_on_the_idle_timeout(rig, n, script):
    """Issue 8 row 9: a worker that stops sending (frozen: its connection stays open) ends the
    stream with UNAVAILABLE after --idle-timeout-s, not after the 600 s request deadline. With
    n samples that stall after their first tokens the streams are read by other tasks than the
    request's (the sample merge): the same."""
    slow = rig.worker("a", script)
    router = rig.router(idle_timeout_s=0.5, max_attempts=1)
    started = time.monotonic()
    _, err = collect(router, text="anyone there?", max_new_tokens=3, n=n, timeout=20)
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
    assert "idle timeout" in err.details() and time.monotonic() - started < 5
    assert 1 <= len(slow.requests) <= n  # sample 1 may not have started when sample 0 timed out
    rig.wait_no_live_reservations()


def test_row15_draft_tokens_are_capped_at_the_worker_limit(rig):
    """Issue 8 row 15: the router allows 16 drafts, the worker 8: a request for 12 runs with 8."""
    worker = rig.worker("a", Script(max_draft_tokens=8))
    router = rig.router(max_draft_tokens=16)
    msgs, err = collect(router, text="speculate a lot", max_new_tokens=3, num_draft_tokens=12)
    assert err is None, err
    assert worker.requests[-1].spec.num_draft_tokens == 8
    rig.wait_no_live_reservations()


def test_a_new_request_waits_out_a_cooldown_it_did_not_cause(rig):
    """Another request's stream failed on the only worker (as when a kvstore restart ends running
    streams): the worker cools down, and a new request waits for it (bounded, like an outage)
    instead of being refused at once; without the wait it is refused."""
    script = Script(fail_after=1)
    worker = rig.worker("a", script)
    router = rig.router(failed_worker_cooldown_s=0.8, kvstore_outage_wait_s=5.0, max_attempts=1)
    _, err = collect(router, text="fails after a token", max_new_tokens=4)
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE  # and the worker cools down
    script.fail_after = None
    started = time.monotonic()
    _, err = collect(router, text="waits for the cooldown", max_new_tokens=2)
    assert err is None and len(worker.requests) == 2 and time.monotonic() - started >= 0.3
    rig.wait_no_live_reservations()


def test_a_client_that_pauses_longer_than_the_idle_timeout_is_not_a_silent_worker(rig):
    """A client that stops reading stops the worker (stream windows: services.common.channels),
    so the router hears nothing from it while the client pauses; that is not the worker going
    silent, and the stream finishes with every token once the client reads again."""
    from services.common.channels import stream_window_options
    from tandem.router.v1 import router_pb2_grpc

    worker = rig.worker("a")
    router = rig.router(idle_timeout_s=0.4, max_attempts=1)
    with grpc.insecure_channel(router.address, options=stream_window_options(64)) as channel:
        stream = router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest(text="pause me", max_new_tokens=200, temperature=0.0), timeout=20)
        first = next(stream)
        time.sleep(1.5)  # the windows fill within a few messages; the router waits on this client
        rest = list(stream)
    ids = [t for m in (first, *rest) for t in m.token_ids]
    assert ids == [worker.script.token(i) for i in range(200)]
    assert rest[-1].usage.completion_tokens == 200
    rig.wait_no_live_reservations()


def test_the_idle_clock_starts_again_when_a_slow_consumer_asks_for_more(rig, monkeypatch):
    """While the router's consumer holds a delta the worker's silence is not timed, and the idle
    clock starts again when the consumer asks for more: a worker that answers within the idle
    timeout of that moment keeps its stream, though it was silent longer than the timeout in all."""
    import asyncio

    worker = rig.worker("a")
    worker.script.delay_before = {1: 0.8}  # the second token 0.8 s after the first
    router = rig.router(idle_timeout_s=0.4, max_attempts=1)
    dispatcher = router.payload.dispatcher
    generate = dispatcher.generate

    async def held_first_delta(*args, **kwargs):
        """The dispatcher's stream, its first delta held 0.6 s (a consumer slow to ask for more)."""
        held = False
        async for event in generate(*args, **kwargs):
            yield event
            if not held:
                held = True
                await asyncio.sleep(0.6)  # then 0.2 s more until the worker answers: under 0.4

    monkeypatch.setattr(dispatcher, "generate", held_first_delta)
    msgs = list(router.stub.Generate(router_pb2.GenerateRequest(text="hold me", max_new_tokens=3, temperature=0.0),
                                     timeout=20))
    assert [t for m in msgs for t in m.token_ids] == [worker.script.token(i) for i in range(3)]
    assert msgs[-1].usage.completion_tokens == 3
    rig.wait_no_live_reservations()
