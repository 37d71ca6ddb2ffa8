"""A new request is admitted at once while another's first Publish is in flight, when all they
share is the reused (already published) prefix: a Publish can only deduplicate, i.e. free, the
publisher's own fresh blocks, so only those may hold an admission back (``runner._admit``).

Real kvstore + worker + router over loopback gRPC; the worker's Publishes are held in flight by
wrapping its link's ``publish_many`` (called on the courier thread), so the timing is forced.
"""

from __future__ import annotations

import threading
import time

from suite_rig import LONG_PREFIX, TIMEOUT
from tandem.router.v1 import router_pb2


def _first_token_s(suite, text: str, max_new_tokens: int, timeout: float = TIMEOUT):
    """Open a Generate and read until its first token; returns (seconds to it, the open call)."""
    started = time.monotonic()
    call = suite.stub.Generate(router_pb2.GenerateRequest(temperature=0.0, text=text, max_new_tokens=max_new_tokens),
                               timeout=timeout)
    for msg in call:
        if msg.token_ids:
            return time.monotonic() - started, call
    raise AssertionError("the stream ended without a token")


def test_a_request_sharing_only_the_published_prefix_does_not_wait_for_publishes(suite):
    svc = suite.add_worker("w0", engine_process=False)
    suite.add_router()
    runner, _identity = svc.payload
    # the shared prefix is published (and cached) by a request that ran to the end
    suite.generate(LONG_PREFIX + "Q0", max_new_tokens=2)
    suite.wait_no_live_reservations()

    release = threading.Event()
    held = threading.Event()
    real_publish_many = runner.link.publish_many

    def held_publish_many(*args):  # the courier thread: every Publish stays in flight until released
        held.set()
        release.wait(TIMEOUT)
        return real_publish_many(*args)

    runner.link.publish_many = held_publish_many
    calls = []
    try:
        # A reuses the prefix; its prompt's own blocks become final at its first step, so its
        # first Publish goes out (and is held) right after that step
        _, a = _first_token_s(suite, LONG_PREFIX + "Question A: what does the kvstore own?", max_new_tokens=200)
        calls.append(a)
        assert held.wait(TIMEOUT), "A's first Publish was never sent"
        # B's table holds the same reused prefix blocks as A's, and nothing A's Publish can free
        waited, b = _first_token_s(suite, LONG_PREFIX + "Question B: who frees a block?", max_new_tokens=4, timeout=5.0)
        calls.append(b)
        assert not release.is_set()
        assert waited < 5.0
    finally:
        release.set()
        runner.link.publish_many = real_publish_many
        for call in calls:
            call.cancel()
    stats = suite.wait_no_live_reservations()
    assert stats.live_reservations == 0
    assert suite.invariants().ok


def test_twin_requests_deduplicate_and_the_one_remapped_reads_the_others_blocks(suite):
    """Two identical greedy requests in one batch publish the same blocks: the kvstore keeps one
    copy and answers the second Publish with its remapped table (the only Publish answers that
    carry a table); both streams still equal a lone request's, and nothing leaks."""
    svc = suite.add_worker("w0", engine_process=False)
    suite.add_router()
    runner, _identity = svc.payload
    prompt = LONG_PREFIX + "Question: which of two twins keeps its blocks?"
    alone = suite.generate(prompt, max_new_tokens=24)[0]
    suite.wait_no_live_reservations()
    dedup_before = sum(w.deduplicated_blocks for w in suite.stats().workers)

    started, release = threading.Barrier(3), threading.Event()
    answers = []
    real_publish_many = runner.link.publish_many

    def held_publish_many(*args):  # the courier thread: the twins' Publishes wait until both run
        release.wait(TIMEOUT)
        got = real_publish_many(*args)
        answers.extend(got)
        return got

    runner.link.publish_many = held_publish_many
    outputs = {}

    def twin(name: str) -> None:
        call = suite.stub.Generate(router_pb2.GenerateRequest(temperature=0.0, text=prompt, max_new_tokens=24),
                                   timeout=TIMEOUT)
        ids = []
        for msg in call:
            if msg.token_ids and not ids:
                started.wait(TIMEOUT)
            ids.extend(msg.token_ids)
        outputs[name] = ids

    threads = [threading.Thread(target=twin, args=(n,)) for n in ("a", "b")]
    try:
        for t in threads:
            t.start()
        started.wait(TIMEOUT)  # both have their first token: both ran before any Publish answered
        release.set()
        for t in threads:
            t.join(TIMEOUT)
    finally:
        release.set()
        runner.link.publish_many = real_publish_many
    tokens_alone = list(suite.stub.Generate(router_pb2.GenerateRequest(temperature=0.0, text=prompt, max_new_tokens=24),
                                            timeout=TIMEOUT))
    expected = [t for msg in tokens_alone for t in msg.token_ids]
    assert outputs["a"] == outputs["b"] == expected, (alone, outputs)
    moved = [a for a in answers if a is not None and not isinstance(a, Exception) and a.block_table is not None]
    assert moved, "no Publish answer carried a remapped table: the twins did not deduplicate"
    assert sum(w.deduplicated_blocks for w in suite.stats().workers) > dedup_before
    assert suite.wait_no_live_reservations().live_reservations == 0
    assert suite.invariants().ok
