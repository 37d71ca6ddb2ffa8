"""Stream windows (router ``worker_stream_window_bytes``, the client's ``stream_window_bytes``):
a client that stops reading stops the worker within a few messages, and the worker merges the
tokens decoded meanwhile into its next message, through the router; with gRPC's own windows the
same pause leaves one message a token queued (services/common/channels.stream_window_options)."""

from __future__ import annotations

import time

from services.client import Client

from suite_rig import TIMEOUT

PROMPT = "A reader that pauses gets the tokens it missed in fewer messages. "
NEW_TOKENS = 120
PAUSE_S = 1.5  # the tiny CPU model decodes the rest well within it


def read_with_a_pause(address: str, window_bytes: int) -> list:
    deltas = []
    with Client(address, timeout_s=TIMEOUT, stream_window_bytes=window_bytes) as client:
        for delta in client.stream(PROMPT, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, num_draft_tokens=0):
            deltas.append(delta)
            if len(deltas) == 2:
                time.sleep(PAUSE_S)
    return deltas


def test_a_paused_client_gets_the_missed_tokens_merged_and_the_same_tokens(suite):
    suite.add_worker("w0")
    windowed = suite.add_router()  # the router's default window, and the client's
    expected, text, _ = suite.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, num_draft_tokens=0)
    assert len(expected) == NEW_TOKENS
    merged = read_with_a_pause(windowed.address, window_bytes=64)
    assert [t for d in merged for t in d.token_ids] == expected
    assert "".join(d.text for d in merged) == text
    assert merged[-1].usage.completion_tokens == NEW_TOKENS
    # a few messages were under way when the client paused; the worker merged everything after them
    assert len(merged) < NEW_TOKENS / 4, [len(d.token_ids) for d in merged]

    unbounded = suite.add_router(worker_stream_window_bytes=0)  # gRPC's own windows, both hops
    queued = read_with_a_pause(unbounded.address, window_bytes=0)
    assert [t for d in queued for t in d.token_ids] == expected
    assert len(queued) > NEW_TOKENS / 2, [len(d.token_ids) for d in queued]  # one message a step, queued
    assert suite.wait_no_live_reservations().live_reservations == 0
