"""``stream_interval`` (worker setting): after a request's first token, a Generate message goes
out once that many tokens have gathered, or at the end; the tokens are the same as streamed one
step at a time, through the router to the client. Forced acceptance makes a k = 3 step give four
tokens, so steps straddle the interval."""

from __future__ import annotations

import time

from tandem.router.v1 import router_pb2

from suite_rig import TIMEOUT, wait_registered

PROMPT = "The stream interval batches tokens into fewer messages. " * 3
NEW_TOKENS = 23
INTERVAL = 6  # above 1 + 4: a first message that caught a second step too is still "at once"


def messages(suite, k: int) -> list:
    request = router_pb2.GenerateRequest(text=PROMPT, temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                         num_draft_tokens=k)
    return list(suite.stub.Generate(request, timeout=TIMEOUT))


def tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def test_messages_carry_the_interval_and_the_tokens_are_those_streamed_one_step_at_a_time(suite):
    every_step = suite.add_worker("every-step", forced_acceptance=3)
    suite.add_router()
    expected = {k: messages(suite, k) for k in (0, 3)}
    every_step.stop()
    suite.workers.remove(every_step)
    suite.add_worker("interval", forced_acceptance=3, stream_interval=INTERVAL)  # the same seeded model
    wait_registered(suite, "interval", timeout_s=TIMEOUT)
    for k in (0, 3):
        one_by_one, batched = expected[k], messages(suite, k)
        assert len(tokens(one_by_one)) == NEW_TOKENS and tokens(batched) == tokens(one_by_one), k
        assert "".join(m.text for m in batched) == "".join(m.text for m in one_by_one)
        sizes = [len(m.token_ids) for m in batched if m.token_ids]
        # the first token at once (TTFT unchanged), then >= INTERVAL a message but the last (the end's flush)
        assert sizes[0] < INTERVAL and all(n >= INTERVAL for n in sizes[1:-1]), (k, sizes)
        assert len(sizes) < len([m for m in one_by_one if m.token_ids]), (k, sizes)
        if k == 3:  # four tokens a step: 4 are held, the next step makes 8, past the interval
            assert max(sizes) > INTERVAL and all(n % (k + 1) == 0 for n in sizes[1:-1]), sizes
        assert batched[-1].usage.completion_tokens == NEW_TOKENS and batched[-1].usage.worker_id == "interval"
    assert suite.wait_no_live_reservations().live_reservations == 0


def test_an_abort_flushes_the_held_tokens_before_the_final_message(suite):
    """Tokens held for the interval are sent when the request ends early (Worker.Abort): the client
    gets every token the usage counts, then finish reason ABORT."""
    import grpc

    from tandem.common.v1 import common_pb2
    from tandem.worker.v1 import worker_pb2, worker_pb2_grpc

    worker = suite.add_worker("interval", stream_interval=64)
    suite.add_router()
    request = router_pb2.GenerateRequest(text=PROMPT, temperature=0.0, max_new_tokens=1500, ignore_eos=True,
                                         num_draft_tokens=0)
    stream = suite.stub.Generate(request, timeout=TIMEOUT)
    first = next(stream)
    assert len(first.token_ids) < 64  # the first token went at once
    runner = worker.payload[0]
    held_back = 0
    while held_back < 3:  # a few steps' tokens are held for the interval now
        time.sleep(0.05)
        held_back = runner.engine.state(next(iter(runner.running_ids()))).counts.decode_steps
    (rid,) = runner.running_ids()
    with grpc.insecure_channel(worker.address) as ch:
        worker_pb2_grpc.WorkerStub(ch).Abort(worker_pb2.AbortRequest(request_id=rid), timeout=TIMEOUT)
    rest = list(stream)
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    received = len(first.token_ids) + sum(len(m.token_ids) for m in rest)
    assert rest[-1].usage.completion_tokens == received < 1500
    assert received > len(first.token_ids)  # what was held came out
    assert suite.wait_no_live_reservations().live_reservations == 0
