"""The importable router client (``services.client.Client`` / ``AsyncClient``) and ``tandem
generate``'s sampling flags, against the real suite on loopback."""

from __future__ import annotations

import asyncio
import io

import pytest

from services.client import AsyncClient, Client, generate_and_print
from services.common.errors import InvalidArgument, Unauthenticated
from suite_rig import LONG_PREFIX


@pytest.fixture
def served(suite):
    suite.add_worker("w0")
    suite.add_router(tenants="tokA=alice")
    return suite


def test_sync_client_streams_generates_and_raises_typed_errors(served):
    with Client(served.router.address, token="tokA", timeout_s=30) as c:
        deltas = list(c.stream(LONG_PREFIX, max_tokens=12, temperature=0))
        answer = c.generate(LONG_PREFIX, max_tokens=12, temperature=0)
        assert answer.text == "".join(d.text for d in deltas)
        assert len(answer.token_ids) == answer.usage.completion_tokens == 12
        assert answer.finish_reason == "length" and deltas[-1].usage is not None
        assert answer.usage.cached_tokens >= 64 and answer.usage.worker_id == "w0"
        # seeded sampling is reproducible, seed 0 included; an unset temperature is OpenAI's 1.0
        a = c.generate(LONG_PREFIX, max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=0)
        b = c.generate(LONG_PREFIX, max_tokens=16, top_p=0.9, top_k=50, seed=0)
        assert a.token_ids == b.token_ids
        assert c.generate(LONG_PREFIX, max_tokens=16, seed=0).token_ids != answer.token_ids[:16] or \
            c.generate(LONG_PREFIX, max_tokens=16, seed=1).token_ids != answer.token_ids[:16]
        # a stop string on the greedy answer's last ASCII character ends it at its first occurrence
        prompt = LONG_PREFIX + "Stop somewhere."
        full = c.generate(prompt, max_tokens=24, temperature=0)
        char = [t for t in full.token_ids if t < 128][-1]
        stopped = c.generate(prompt, max_tokens=24, stop=[chr(char)], temperature=0)
        assert stopped.finish_reason == "stop"
        assert stopped.token_ids == full.token_ids[: full.token_ids.index(char) + 1]
        with pytest.raises(InvalidArgument):
            c.generate("hi", max_tokens=0)
    with Client(served.router.address, token="wrong") as c, pytest.raises(Unauthenticated):
        c.generate("hi", max_tokens=2)
    assert served.wait_no_live_reservations().live_reservations == 0


def test_async_client_matches_the_sync_one(served):
    with Client(served.router.address, token="tokA") as c:
        expected = c.generate(LONG_PREFIX + "async", max_tokens=10, temperature=0)

    async def run():
        async with AsyncClient(served.router.address, token="tokA") as ac:
            chunks = [d async for d in ac.stream(LONG_PREFIX + "async", max_tokens=10, temperature=0)]
            whole = await ac.generate(LONG_PREFIX + "async", max_tokens=10, temperature=0)
            return chunks, whole

    chunks, whole = asyncio.run(run())
    assert whole.token_ids == expected.token_ids == tuple(t for d in chunks for t in d.token_ids)
    assert chunks[-1].finish_reason == "length"


def test_tandem_generate_passes_the_sampling_flags(served):
    # A seeded sample depends on k (rejection sampling draws per verify step): k = 4, the router's
    # old default, is the sample that runs to max tokens (the worker's default 3 meets EOS at 3).
    out = io.StringIO()
    code = generate_and_print(served.router.address, LONG_PREFIX, max_new_tokens=8, temperature=0.7, top_p=0.8,
                              top_k=20, seed=0, stop=["\x00"], token="tokA", out=out, draft_tokens=4)
    again = io.StringIO()
    generate_and_print(served.router.address, LONG_PREFIX, max_new_tokens=8, temperature=0.7, top_p=0.8,
                       top_k=20, seed=0, stop=["\x00"], token="tokA", out=again, draft_tokens=4)
    text, usage = out.getvalue().rsplit("\n[worker", 1)
    text2, _ = again.getvalue().rsplit("\n[worker", 1)
    assert code == 0 and text == text2  # seeded: the same sample twice
    assert "completion 8 tokens" in usage and "finish length" in usage
