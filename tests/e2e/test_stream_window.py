"""Stream windows (router ``worker_stream_window_bytes``, the client's ``stream_window_bytes``):
a client that stops reading stops the worker within a few messages, and the worker merges the
tokens decoded meanwhile into its next message, through the router; with gRPC's own windows the
same pause leaves one message a token queued (services/common/channels.stream_window_options)."""

from __future__ import annotations

import pytest

from services.client import Client

from suite_rig import TIMEOUT

PROMPT = "A reader that pauses gets the tokens it missed in fewer messages. "
NEW_TOKENS = 120


def read_with_a_pause(suite, address: str, window_bytes: int, n: int) -> list[list]:
    """Each sample's deltas, read with a pause after the second delta until the worker has
    finished decoding every sample (its reservations end then, whatever is still unsent)."""
    deltas: list[list] = [[] for _ in range(n)]
    with Client(address, timeout_s=TIMEOUT, stream_window_bytes=window_bytes) as client:
        for i, delta in enumerate(client.stream(PROMPT, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                                num_draft_tokens=0, n=n)):
            deltas[delta.index].append(delta)
            if i == 1:
                suite.wait_no_live_reservations()
    return deltas


@pytest.mark.parametrize("n", [1, 2])
def test_a_paused_client_gets_the_missed_tokens_merged_and_the_same_tokens(suite, n):
    suite.add_worker("w0")
    windowed = suite.add_router()  # the router's default window; the client asks for a small one too
    expected, text, _ = suite.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, num_draft_tokens=0)
    assert len(expected) == NEW_TOKENS
    for sample in read_with_a_pause(suite, windowed.address, 64, n):
        assert [t for d in sample for t in d.token_ids] == expected  # greedy: every sample alike
        assert "".join(d.text for d in sample) == text
        assert sample[-1].usage.completion_tokens == NEW_TOKENS
        # a few messages were under way when the client paused; the worker merged everything after them
        assert len(sample) < NEW_TOKENS / 4, [len(d.token_ids) for d in sample]

    unbounded = suite.add_router(worker_stream_window_bytes=0)  # gRPC's own windows, both hops
    for sample in read_with_a_pause(suite, unbounded.address, 0, n):
        assert [t for d in sample for t in d.token_ids] == expected
        assert len(sample) > NEW_TOKENS / 2, [len(d.token_ids) for d in sample]  # one message a step, queued
    assert suite.wait_no_live_reservations().live_reservations == 0


def test_a_merged_message_carries_at_most_the_cap_of_tokens(suite, monkeypatch):
    """A client far behind gets its missed tokens in messages of at most MAX_TOKENS_PER_MESSAGE
    (without the cap one message could pass gRPC's 4 MiB receive limit), all of them, in order."""
    from services.gpuworker import servicer

    cap = 8
    monkeypatch.setattr(servicer, "MAX_TOKENS_PER_MESSAGE", cap)
    suite.add_worker("w0")
    router = suite.add_router()
    expected, _, _ = suite.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, num_draft_tokens=0)
    (sample,) = read_with_a_pause(suite, router.address, 64, 1)
    sizes = [len(d.token_ids) for d in sample if d.token_ids]
    assert [t for d in sample for t in d.token_ids] == expected
    assert max(sizes) == cap and sizes.count(cap) > NEW_TOKENS / cap / 2, sizes  # merged, up to the cap
    assert suite.wait_no_live_reservations().live_reservations == 0
