"""``stream_interval`` (worker setting): after a request's first token, a Generate message goes
out once that many tokens have gathered, or at the end; the tokens are the same as streamed one
step at a time, through the router to the client."""

from __future__ import annotations

from tandem.router.v1 import router_pb2

from suite_rig import TIMEOUT, wait_registered

PROMPT = "The stream interval batches tokens into fewer messages. " * 3
NEW_TOKENS = 23


def messages(suite, k: int) -> list:
    request = router_pb2.GenerateRequest(text=PROMPT, temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                         num_draft_tokens=k)
    return list(suite.stub.Generate(request, timeout=TIMEOUT))


def tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def test_messages_carry_the_interval_and_the_tokens_are_those_streamed_one_step_at_a_time(suite):
    every_step = suite.add_worker("every-step")
    suite.add_router()
    expected = {k: messages(suite, k) for k in (0, 3)}
    every_step.stop()
    suite.workers.remove(every_step)
    suite.add_worker("interval-5", stream_interval=5)  # the same seeded model
    wait_registered(suite, "interval-5", timeout_s=TIMEOUT)
    for k in (0, 3):
        one_by_one, batched = expected[k], messages(suite, k)
        assert len(tokens(one_by_one)) == NEW_TOKENS and tokens(batched) == tokens(one_by_one), k
        assert "".join(m.text for m in batched) == "".join(m.text for m in one_by_one)
        with_tokens = [m for m in batched if m.token_ids]
        # the first token at once (TTFT unchanged), then >= 5 a message but the last (the end's flush)
        assert len(with_tokens[0].token_ids) <= k + 1, k
        assert all(len(m.token_ids) >= 5 for m in with_tokens[1:-1]), [len(m.token_ids) for m in with_tokens]
        assert len(with_tokens) < len([m for m in one_by_one if m.token_ids]), k
        assert batched[-1].usage.completion_tokens == NEW_TOKENS and batched[-1].usage.worker_id == "interval-5"
    assert suite.wait_no_live_reservations().live_reservations == 0
