"""The fused speculative step through the served path (issue 7), on CPU: kvstore + worker + router
on loopback, the worker's engine running graph padding (``graphs="pad"``: the layouts and input
buffers a CUDA graph replays, run eagerly; on CPU the worker would run no graphs at all) with
overlapped steps, so that its steps are fused, mostly launched from the last verdict before it
is applied (``Engine._continue_fused``), while the runner publishes, extends ahead, trims and
releases around them. Many concurrent requests of staggered lengths end and arrive every few
steps. Every stream is the model's own greedy output (the k = 0 stream of the same worker), and
nothing is left reserved or broken in the kvstore."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from suite_rig import LONG_PREFIX


def test_fused_continued_steps_stream_greedy_tokens_through_the_served_path(suite, monkeypatch):
    monkeypatch.setattr("services.gpuworker.build.graph_mode", lambda settings: "pad")
    svc = suite.add_worker("w-fused", num_blocks=1024, overlap_steps=True, fused_spec_steps=True)
    suite.add_router()
    engine = svc.payload[0].engine
    assert engine.config.graphs == "pad" and engine.config.overlap and engine.config.fused_spec
    texts = [f"{LONG_PREFIX}Question {i}: name {'a few' if i % 2 else 'some'} colours of {i * 7} things." for i in range(12)]
    lengths = [6 + (11 * i) % 29 for i in range(12)]

    def run(i: int, k: int) -> list[int]:
        return suite.generate(texts[i], max_new_tokens=lengths[i], num_draft_tokens=k)[0]

    with ThreadPoolExecutor(12) as pool:
        spec = list(pool.map(lambda i: run(i, 3), range(12)))
    assert engine.fused_steps >= 10 and engine.continued_steps >= 5, (engine.fused_steps, engine.continued_steps)
    plain = [run(i, 0) for i in range(12)]  # one at a time, no drafts: the greedy reference
    assert spec == plain
    assert sum(map(len, spec)) >= 150  # most ran to their length (a few stop early on an end token)
    stats = suite.wait_no_live_reservations()
    assert stats.live_reservations == 0
    assert suite.invariants().ok
