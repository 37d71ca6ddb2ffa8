"""End to end through the real router, kvstore and gpuworker (tiny model, CPU, torch backend)."""

from __future__ import annotations

import signal

import grpc
import pytest

from suite_rig import LONG_PREFIX, TIMEOUT, spawn_worker_process, stream_a_few_tokens, wait_registered
from tandem.router.v1 import router_pb2


def test_prefix_reuse_returns_the_same_tokens_as_no_cache(suite):
    """A second request sharing the prompt reports cached tokens (target and draft KV came from the
    first request's published blocks) and returns exactly what an uncached run returns; another
    tenant's namespace yields no hit at all."""
    suite.add_worker("w0")
    suite.add_router(tenants="tokA=alice,tokB=bob")
    prompt = LONG_PREFIX + "Question: what is paired?"

    first, _, u1 = suite.generate(prompt, token="tokA", max_new_tokens=24, num_draft_tokens=3)
    second, _, u2 = suite.generate(prompt, token="tokA", max_new_tokens=24, num_draft_tokens=3)
    other, _, u3 = suite.generate(prompt, token="tokB", max_new_tokens=24, num_draft_tokens=3)

    assert u1.cached_tokens == 0
    assert u2.cached_tokens >= 64, u2  # whole 16-token blocks of the prompt (minus the last + D)
    assert u2.cached_tokens <= u2.prompt_tokens - 1
    assert u3.cached_tokens == 0  # bob's cache salt differs: zero hits
    assert first == second == other
    assert len(first) == u1.completion_tokens == 24
    stats = suite.wait_no_live_reservations()
    assert stats.live_reservations == 0
    assert suite.invariants().ok


def test_speculation_on_and_off_give_the_same_greedy_tokens(suite):
    suite.add_worker("w0")
    suite.add_router()
    prompt = LONG_PREFIX + "Answer:"
    plain, _, u0 = suite.generate(prompt, max_new_tokens=40, num_draft_tokens=0)
    for k in (1, 4):
        spec, _, uk = suite.generate(prompt + "", max_new_tokens=40, num_draft_tokens=k)
        assert spec == plain, f"k={k}"
        assert uk.mean_acceptance_length >= 1.0
    assert u0.mean_acceptance_length == pytest.approx(1.0)


def test_mtp_worker_and_streamed_text_match_the_tokens(suite):
    suite.add_worker("w0", spec_mode="mtp", mtp_depth=2)
    suite.add_router()
    ids, text, usage = suite.generate("Hello, MTP", max_new_tokens=20, num_draft_tokens=2)
    assert len(ids) == usage.completion_tokens == 20
    from services.common.tokenizer import ByteTokenizer

    assert text == ByteTokenizer().decode(ids)
    assert usage.worker_id == "w0"


def test_shared_prefix_lands_on_the_worker_that_holds_it(suite):
    suite.add_worker("w0")
    suite.add_worker("w1")
    suite.add_router()
    _, _, first = suite.generate(LONG_PREFIX + "Q1", max_new_tokens=4)
    holder = first.worker_id
    for i in range(4):
        _, _, usage = suite.generate(LONG_PREFIX + f"Question number {i}?", max_new_tokens=4)
        assert usage.worker_id == holder
        assert usage.cached_tokens >= 64


def test_load_outweighs_reuse_when_the_holder_is_busy(suite):
    suite.add_worker("w0")
    suite.add_worker("w1")
    suite.add_router(policy_gamma=1000.0)  # one in-flight request outweighs any prefix reuse
    _, _, first = suite.generate(LONG_PREFIX + "Q1", max_new_tokens=4)
    holder = first.worker_id
    # the worker releases Q1's reservation after its stream ended; until the kvstore has it, Q1
    # counts as load on the holder (gamma 1000) and the long request below would go elsewhere
    assert suite.wait_no_live_reservations().live_reservations == 0

    # a long request on the holder (it goes there: same prefix, nothing in flight anywhere)
    long_call = suite.stub.Generate(
        router_pb2.GenerateRequest(temperature=0.0, text=LONG_PREFIX + "Tell a long story.", max_new_tokens=1500),
        timeout=TIMEOUT,
    )
    first_msg = next(long_call)
    assert first_msg.token_ids
    try:
        _, _, usage = suite.generate(LONG_PREFIX + "Q2", max_new_tokens=4)
        assert usage.worker_id != holder
        assert usage.cached_tokens == 0
    finally:
        long_call.cancel()
    assert suite.wait_no_live_reservations().live_reservations == 0
    assert suite.invariants().ok


def test_client_cancel_mid_stream_frees_the_reservation(suite):
    suite.add_worker("w0")
    suite.add_router()
    call = stream_a_few_tokens(suite, 8)
    assert suite.stats().live_reservations == 1
    call.cancel()
    assert suite.wait_no_live_reservations().live_reservations == 0
    check = suite.invariants()
    assert check.ok, check.violations
    # the worker is still healthy and serves the next request
    ids, _, _ = suite.generate("after cancel", max_new_tokens=3)
    assert len(ids) == 3


def test_deadline_expiry_is_deadline_exceeded_and_frees_everything(suite):
    suite.add_worker("w0")
    suite.add_router()
    call = suite.stub.Generate(router_pb2.GenerateRequest(temperature=0.0, text=LONG_PREFIX, max_new_tokens=1500), timeout=0.6)
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert suite.wait_no_live_reservations().live_reservations == 0
    assert suite.invariants().ok


@pytest.mark.parametrize(
    "request_fields, token, code",
    [
        (dict(text="", max_new_tokens=4), "tokA", grpc.StatusCode.INVALID_ARGUMENT),
        (dict(text="hi", max_new_tokens=0), "tokA", grpc.StatusCode.INVALID_ARGUMENT),
        (dict(text="hi", max_new_tokens=10_000_000), "tokA", grpc.StatusCode.INVALID_ARGUMENT),
        (dict(text="hi", max_new_tokens=4), "not-a-tenant", grpc.StatusCode.UNAUTHENTICATED),
        (dict(text="hi", max_new_tokens=4), None, grpc.StatusCode.UNAUTHENTICATED),
        (dict(text="hi", max_new_tokens=4, num_draft_tokens=1000), "tokA", grpc.StatusCode.INVALID_ARGUMENT),
        (dict(text="hi", max_new_tokens=4, presence_penalty=2.5), "tokA", grpc.StatusCode.INVALID_ARGUMENT),
        (dict(text="hi", max_new_tokens=4, frequency_penalty=float("nan")), "tokA", grpc.StatusCode.INVALID_ARGUMENT),
        (dict(text="hi", max_new_tokens=4, repetition_penalty=0.0), "tokA", grpc.StatusCode.INVALID_ARGUMENT),
        (dict(text="hi", max_new_tokens=4, logprobs=21), "tokA", grpc.StatusCode.INVALID_ARGUMENT),
        (dict(text="hi", max_new_tokens=4, n=17), "tokA", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_bad_requests_are_rejected_and_change_nothing(suite, request_fields, token, code):
    suite.add_worker("w0")
    suite.add_router(tenants="tokA=alice")
    before = suite.stats()
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with pytest.raises(grpc.RpcError) as err:
        for _ in suite.stub.Generate(router_pb2.GenerateRequest(**request_fields), timeout=TIMEOUT, metadata=metadata):
            pass
    assert err.value.code() == code
    after = suite.stats()
    assert after.reservations_created == before.reservations_created
    assert after.live_reservations == 0
    assert [w.pool for w in after.workers] == [w.pool for w in before.workers]
    assert suite.invariants().ok


def test_worker_killed_mid_request(suite):
    """SIGKILL the worker after tokens were streamed: the router says UNAVAILABLE, and once the
    killed worker's lease lapses the kvstore holds nothing of it and its invariants hold."""
    proc = spawn_worker_process(suite.kv.address, "doomed")
    try:
        wait_registered(suite, "doomed", proc)
        suite.add_router()
        call = suite.stub.Generate(router_pb2.GenerateRequest(temperature=0.0, text=LONG_PREFIX, max_new_tokens=1500), timeout=TIMEOUT)
        first = next(call)
        assert first.token_ids
        assert suite.stats().live_reservations == 1
        proc.send_signal(signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "after" in err.value.details() or "stream" in err.value.details()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    stats = suite.wait_no_live_reservations(timeout_s=10)
    assert stats.live_reservations == 0
    assert all(w.worker_id != "doomed" for w in stats.workers)
    check = suite.invariants()
    assert check.ok, check.violations


def test_worker_killed_before_first_token_is_retried_elsewhere(suite):
    """A worker that is dead when the router calls it (its lease still live) costs a retry, not
    an error: every request lands on the healthy worker, and nothing leaks."""
    proc = spawn_worker_process(suite.kv.address, "dead")
    try:
        wait_registered(suite, "dead", proc)
        suite.add_worker("alive")
        # no load or reuse preference: the seeded tie-break sends some requests to "dead" first
        suite.add_router(policy_beta=0.0, policy_gamma=0.0, policy_seed=1, failed_worker_cooldown_s=0.0)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    before = suite.stats().reservations_created
    served = set()
    for i in range(6):
        _, _, usage = suite.generate(f"retry me {i}", max_new_tokens=3)
        served.add(usage.worker_id)
    assert served == {"alive"}
    # more reservations than requests: some were made on the dead worker, aborted, and retried
    assert suite.stats().reservations_created - before > 6
    assert suite.wait_no_live_reservations(timeout_s=10).live_reservations == 0
    assert suite.invariants().ok
