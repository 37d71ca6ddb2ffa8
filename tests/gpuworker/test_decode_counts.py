"""Acceptance counts have one owner (the engine's request state) and one formula (DecodeCounts):
the in-process Completion, the worker's Usage and pooled measurements all read the same numbers."""

import pytest

from services.common.spec import SpecMode
from services.gpuworker.engine.engine import EngineConfig
from services.gpuworker.engine.local import build_local, run_until_done, submit
from services.gpuworker.engine.request import DecodeCounts


def test_acceptance_length_formula():
    assert DecodeCounts().acceptance_length == 1.0  # no decode step yet: no speculation seen
    assert DecodeCounts(decode_steps=4, proposed_drafts=12, accepted_drafts=6).acceptance_length == 2.5
    pooled = DecodeCounts(2, 6, 6) + DecodeCounts(2, 6, 0)
    assert pooled == DecodeCounts(4, 12, 6) and pooled.acceptance_length == 2.5


def test_counts_cross_a_process_boundary_unchanged():
    """An engine process pickles one per request and step (its own, cheaper reduction)."""
    import pickle

    from multiprocessing.reduction import ForkingPickler

    import dataclasses

    # every field set apart from its default: a field __reduce__ forgot would come back default
    counts = DecodeCounts(**{f.name: 7 + 5 * i for i, f in enumerate(dataclasses.fields(DecodeCounts))})
    for data in (pickle.dumps(counts), bytes(ForkingPickler.dumps(counts))):
        back = pickle.loads(data)
        assert back == counts and type(back) is DecodeCounts


@pytest.mark.parametrize("graphs, overlap", [("off", False), ("pad", True)], ids=["phases", "fused-overlap"])
def test_every_result_carries_the_running_totals_and_the_completion_keeps_the_last(graphs, overlap):
    """fused-overlap: fused speculative steps whose verdicts are read a step later, so a report
    may carry two verifies (the lagged one and its own): one acceptance length each."""
    setup = build_local("tiny", spec_mode=SpecMode.EAGLE3,
                        config=EngineConfig(forced_acceptance=2, graphs=graphs, overlap=overlap))
    submit(setup, "a", list(range(1, 20)), max_new_tokens=13, k=3)
    seen = []
    done = run_until_done(setup, on_step=lambda rep: seen.extend(r for r in rep.results.values()))
    steps = [r for r in seen if r.verified]
    # totals move exactly by what each step reports
    total = DecodeCounts()
    for r in seen:
        if r.verified:
            total = total + DecodeCounts(len(r.acceptance_lengths), r.proposed_drafts, r.accepted_drafts)
            assert sum(r.acceptance_lengths) == len(r.acceptance_lengths) + r.accepted_drafts
        assert r.counts == total
    c = done["a"]
    assert c.counts == total and c.decode_steps == sum(len(r.acceptance_lengths) for r in steps)
    assert (setup.engine.fused_steps > 0) == (graphs == "pad")
    # 1 token after the prompt, then 3 per verify step (2 forced accepts + the bonus token), capped
    assert c.accepted_drafts == sum(r.accepted_drafts for r in steps) > 0
    assert c.acceptance_length == 1.0 + c.accepted_drafts / c.decode_steps
    assert len(c.tokens) == 13
