"""Pure pieces of the router: request validation, retry decisions, wait queue, worker directory."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from services.common.tokenizer import ByteTokenizer
from services.router.directory import WorkerDirectory, WorkerEntry
from services.router.jobs import MAX_REQUEST_ID_CHARS, MAX_SAMPLES, RequestLimits, build_job, headroom_positions, sample_jobs
from services.router.retry import AttemptState, UpstreamInternal, WaitQueue, backoff_delays, error_for

TOK = ByteTokenizer()
LIMITS = RequestLimits(vocab_size=TOK.vocab_size, max_new_tokens=64, max_prompt_tokens=100,
                       default_draft_tokens=4, max_draft_tokens=8, eos_token_ids=TOK.eos_token_ids)


def job(**kw):
    args = dict(text="hi", token_ids=None, max_new_tokens=8, limits=LIMITS, tokenizer=TOK)
    args.update(kw)
    return build_job(**args)


# ------------------------------------------------------------------------------------------ jobs
def test_text_is_tokenized_and_defaults_applied():
    j = job(text="héllo", new_request_id=lambda: "generated")
    assert j.prompt.tolist() == TOK.encode("héllo")
    assert j.request_id == "generated"
    assert j.num_draft_tokens == 4 and headroom_positions(j.num_draft_tokens) == 5
    assert j.sampling.top_p == 1.0  # 0 means 1
    assert j.sampling.stop_token_ids == (TOK.eos_token_id,)  # EOS implied
    assert not j.prompt.flags.writeable


def test_token_ids_draft_override_and_stops():
    j = job(text=None, token_ids=np.array([256, 72, 105], dtype=np.uint32), num_draft_tokens=0,
            stop_token_ids=[10, 10, TOK.eos_token_id], request_id="req-1")
    assert j.prompt.tolist() == [256, 72, 105]
    assert j.num_draft_tokens == 0 and headroom_positions(j.num_draft_tokens) == 1
    assert j.sampling.stop_token_ids == (10, TOK.eos_token_id)
    assert j.request_id == "req-1"


def test_without_a_router_default_k_is_left_to_the_worker():
    """A router without --num-draft-tokens leaves an unsaid k unresolved (None: the chosen
    worker's default, resolved by the dispatcher); a request's own k is still checked here."""
    limits = dataclasses.replace(LIMITS, default_draft_tokens=None)
    assert job(limits=limits).num_draft_tokens is None
    assert job(limits=limits, num_draft_tokens=0).num_draft_tokens == 0
    assert job(limits=limits, num_draft_tokens=8).num_draft_tokens == 8
    for bad in (9, -1):
        with pytest.raises(InvalidArgument, match="num_draft_tokens must be in 0..8"):
            job(limits=limits, num_draft_tokens=bad)


def test_fresh_request_ids_are_uuid4_hex():
    a, b = job().request_id, job().request_id
    assert a != b and len(a) == 32 and int(a, 16) >= 0


def test_samples_of_a_longest_caller_id_get_their_suffix_after_validation():
    """A request id of the longest allowed length works with n samples too: "#i" is added after
    the caller's id is checked (it was checked with the suffix, so n = 2 refused what n = 1 took),
    and the longest id the router sends on still fits the 128 bytes allowed downstream."""
    longest = "r" * MAX_REQUEST_ID_CHARS
    jobs = sample_jobs(MAX_SAMPLES, lambda **kw: job(**kw), seed=7, request_id=longest)
    assert [j.request_id for j in jobs] == [longest] + [f"{longest}#{i}" for i in range(1, MAX_SAMPLES)]
    assert [j.sampling.seed for j in jobs] == [7 + i for i in range(MAX_SAMPLES)]
    scope = "0123456789ab/"  # a tenant scope (Tenant.scope: 12 hex digits) and its separator
    assert len(f"{scope}{jobs[-1].request_id}~9".encode()) <= 128
    with pytest.raises(InvalidArgument, match="longer than"):
        sample_jobs(2, lambda **kw: job(**kw), seed=None, request_id=longest + "r")
    fresh = sample_jobs(2, lambda **kw: job(**kw), seed=None)
    assert len({j.request_id for j in fresh}) == 2 and "#" not in fresh[1].request_id


def test_samples_tokenize_the_prompt_once():
    """n samples of a text prompt: one tokenization, the same (read-only) prompt in every job,
    everything else as sample 0 but the seed and the id."""
    calls = []

    class Counting(ByteTokenizer):
        def encode(self, text):
            calls.append(text)
            return super().encode(text)

    tok = Counting()
    jobs = sample_jobs(4, lambda **kw: job(tokenizer=tok, text="a long prompt", temperature=0.7, **kw),
                       seed=3, request_id="r")
    assert calls == ["a long prompt"]
    assert all(j.prompt is jobs[0].prompt for j in jobs) and not jobs[0].prompt.flags.writeable
    assert [j.request_id for j in jobs] == ["r", "r#1", "r#2", "r#3"]
    assert [j.sampling.seed for j in jobs] == [3, 4, 5, 6]
    assert {(j.sampling.temperature, j.num_draft_tokens, j.sampling.stop_token_ids) for j in jobs} == {
        (jobs[0].sampling.temperature, jobs[0].num_draft_tokens, jobs[0].sampling.stop_token_ids)}


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(text=""), "empty"),
        (dict(text=None, token_ids=np.zeros(0, np.uint32)), "empty"),
        (dict(text=None), "exactly one"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=65), "max_new_tokens"),
        (dict(text=None, token_ids=np.array([1, TOK.vocab_size], np.uint32)), "vocabulary"),
        (dict(text="x" * 100), "limit"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(num_draft_tokens=9), "num_draft_tokens"),
        (dict(stop_token_ids=[TOK.vocab_size]), "stop token"),
        (dict(request_id="has space"), "request_id"),
        (dict(request_id="x" * 129), "request_id"),
    ],
)
def test_invalid_requests(kw, fragment):
    with pytest.raises(InvalidArgument) as exc:
        job(**kw)
    assert fragment in exc.value.message


# ----------------------------------------------------------------------------------------- retry
def test_attempt_ids_and_retry_before_the_first_token():
    s = AttemptState("req", max_attempts=3)
    assert s.reservation_request_id() == "req"
    s.worker_failed("a", "UNAVAILABLE", "down", streamed_tokens=0)
    assert s.excluded == {"a"} and s.reservation_request_id() == "req~1"
    s.worker_failed("b", "FAILED_PRECONDITION", "stale incarnation", streamed_tokens=0)
    assert s.reservation_request_id() == "req~2"
    with pytest.raises(Unavailable) as exc:
        s.worker_failed("c", "UNAVAILABLE", "down too", streamed_tokens=0)
    assert "3 attempt(s)" in exc.value.message and "a:" in exc.value.message and "c:" in exc.value.message


def test_failure_after_tokens_is_unavailable_and_not_retried():
    s = AttemptState("req", max_attempts=5)
    with pytest.raises(Unavailable) as exc:
        s.worker_failed("a", "UNAVAILABLE", "connection reset", streamed_tokens=3)
    assert "after 3 tokens" in exc.value.message
    assert s.attempt == 0


def test_non_retryable_worker_codes_pass_through():
    s = AttemptState("req", max_attempts=5)
    with pytest.raises(InvalidArgument):
        s.worker_failed("a", "INVALID_ARGUMENT", "bad", streamed_tokens=0)
    with pytest.raises(DeadlineExceeded):
        s.worker_failed("a", "DEADLINE_EXCEEDED", "late", streamed_tokens=0)
    with pytest.raises(UpstreamInternal):
        s.worker_failed("a", "INTERNAL", "boom", streamed_tokens=0)
    assert AttemptState.worker_is_broken("UNAVAILABLE")
    assert not AttemptState.worker_is_broken("RESOURCE_EXHAUSTED")


def test_error_for_maps_names():
    assert isinstance(error_for("RESOURCE_EXHAUSTED", "x"), ResourceExhausted)
    assert isinstance(error_for("DATA_LOSS", "x"), UpstreamInternal)


def test_wait_queue_is_bounded():
    q = WaitQueue(2)
    q.enter()
    q.enter()
    with pytest.raises(ResourceExhausted):
        q.enter()
    q.leave()
    q.enter()
    assert q.waiting == 2
    with pytest.raises(ResourceExhausted):
        WaitQueue(0).enter()
    with pytest.raises(FailedPrecondition):
        WaitQueue(1).leave()


def test_backoff_doubles_up_to_the_cap():
    assert list(itertools.islice(backoff_delays(0.05, 0.3), 5)) == pytest.approx([0.05, 0.1, 0.2, 0.3, 0.3])


# ------------------------------------------------------------------------------------- directory
def entry(worker_id, incarnation=1):
    return WorkerEntry(worker_id, incarnation, "127.0.0.1:1", "m", 1, 0, 16, 64, 0, TOK.vocab_size, 1024)


def test_directory_freshness_follows_ttl_and_incarnations():
    now = [0.0]
    d = WorkerDirectory(ttl_s=1.0, cooldown_s=5.0, clock=lambda: now[0])
    assert not d.is_fresh_for([])
    d.replace([entry("a", 7), entry("b", 3)])
    assert d.is_fresh_for([("a", 7), ("b", 3)])
    assert not d.is_fresh_for([("a", 8)])  # restarted worker
    assert not d.is_fresh_for([("c", 1)])  # new worker
    now[0] = 1.5
    assert not d.is_fresh_for([("a", 7)])  # too old
    d.replace([entry("a", 7)])
    d.invalidate()
    assert not d.is_fresh_for([])
    assert [e.worker_id for e in d.entries()] == ["a"]


def test_directory_in_flight_and_cooldown():
    now = [0.0]
    d = WorkerDirectory(ttl_s=1.0, cooldown_s=5.0, clock=lambda: now[0])
    d.begin("a")
    d.begin("a")
    d.end("a")
    assert d.in_flight("a") == 1
    d.end("a")
    d.end("a")
    assert d.in_flight("a") == 0
    d.mark_failed("a")
    assert not d.is_healthy("a") and d.is_healthy("b")
    now[0] = 5.0
    assert d.is_healthy("a")
