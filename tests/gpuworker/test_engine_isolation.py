"""Per-request failure isolation in the engine step (issue 8, row 10): a request that makes a step
fail ends alone; requests that had already completed a step keep running, token-identical to a
run without it; their KV and blocks are untouched and nothing leaks."""

from __future__ import annotations

import pytest
import torch

from services.gpuworker.engine.local import run_until_done, submit
from services.gpuworker.engine.request import FinishReason

from test_engine_support import make_setup, plain_greedy

POISON = [7, 7, 7, 7]  # a run of ids the fault below refuses (any data-dependent kernel failure)


class FaultyTarget:
    """The real target, except that a forward whose input holds the POISON run raises (having
    launched nothing), as a kernel refusing one request's data would."""

    def __init__(self, target):
        self._target = target
        self.broken = False  # True: every forward raises (a device fault, or a bug)

    def __call__(self, ids, *args, **kwargs):
        n = len(POISON)
        if self.broken or ids.numel() >= n and bool((ids.unfold(0, n, 1) == torch.tensor(POISON)).all(-1).any()):
            raise RuntimeError("kernel refused the batch")
        return self._target(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._target, name)


def prompt(seed: int, n: int = 11) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(20, 200, (n,), generator=g)]  # never POISON


@pytest.mark.parametrize("mode,overlap,graphs", [("none", False, "off"), ("none", True, "off"), ("eagle3", False, "off"),
                                                 ("eagle3", False, "pad"), ("eagle3", True, "pad")])
def test_a_failing_newcomer_ends_alone_and_the_running_requests_are_unaffected(mode, overlap, graphs):
    """("eagle3", *, "pad"): the running requests' decodes run as a fused speculative step and
    the newcomer's prompt beside it fails; with overlap, that step is launched from the step
    before's verdict, which is then applied: the outcome of a completed step. Either way the
    failure isolates the newcomer."""
    setup = make_setup(mode, chunk_size=64, max_batch_tokens=64, overlap=overlap, graphs=graphs)
    engine = setup.engine
    engine.target = FaultyTarget(engine.target)
    total = setup.source.free_blocks
    a, b = prompt(1), prompt(2)
    k = 2 if mode != "none" else 0
    streamed: dict[str, list[int]] = {"a": [], "b": []}

    def collect(report):
        for rid, r in report.results.items():
            streamed.setdefault(rid, []).extend(r.new_token_ids)
        return report

    submit(setup, "a", a, max_new_tokens=12, k=k)
    submit(setup, "b", b, max_new_tokens=12, k=k)
    collect(engine.step())  # a and b prefill: proven
    collect(engine.step())  # and decode once (overlap: its tokens are still on their way)
    if graphs == "pad":
        assert engine.fused_steps == 1 and (engine._verdict is not None) == overlap
    submit(setup, "bad", prompt(3)[:5] + POISON + prompt(3)[5:], max_new_tokens=12, k=k)
    report = collect(engine.step())  # fails: only "bad" never completed a step
    if graphs == "pad":
        assert engine.fused_steps == 2  # the decodes beside it ran fused
        # overlap: launched from the last verdict before it was applied (Engine._continue_fused)
        assert engine.continued_steps == (1 if overlap else 0)
    bad = report.results["bad"]
    assert bad.finish_reason is FinishReason.ERROR and isinstance(bad.error, RuntimeError)
    assert bad.new_token_ids == [] and "bad" not in engine.request_ids()
    assert all(not r.finished for rid, r in report.results.items() if rid != "bad")
    setup.source.release("bad")
    held = sum(len(engine.state(rid).block_table) for rid in ("a", "b"))
    assert setup.source.free_blocks + held == total  # its reservation came back whole
    run_until_done(setup, on_step=collect)
    # the neighbours streamed exactly the tokens they would have had alone, none lost or doubled
    for rid, p in (("a", a), ("b", b)):
        assert streamed[rid] == plain_greedy(p, 12), rid
    assert setup.source.free_blocks == total  # nothing leaked


def test_a_failure_with_no_newcomer_is_raised():
    setup = make_setup("none", chunk_size=64, max_batch_tokens=64)
    engine = setup.engine
    engine.target = FaultyTarget(engine.target)
    submit(setup, "a", prompt(4), max_new_tokens=30)
    engine.step()
    engine.target.broken = True  # only proven requests are in the step: nobody to blame alone
    with pytest.raises(RuntimeError):
        engine.step()


def test_a_failure_after_tokens_moved_is_raised(monkeypatch):
    setup = make_setup("eagle3", chunk_size=64, max_batch_tokens=64)
    engine = setup.engine
    submit(setup, "a", prompt(5), max_new_tokens=12, k=2)

    def broken_fill(jobs, flush=True):
        raise RuntimeError("draft fill failed")

    monkeypatch.setattr(engine.drafter, "fill", broken_fill)
    with pytest.raises(RuntimeError):  # tokens were accepted already: not isolatable
        engine.step()
