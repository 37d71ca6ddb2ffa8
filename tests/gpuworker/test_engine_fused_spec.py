"""A greedy EAGLE-3 speculative step fused into one forward (``spec_step.py``) moves every request
exactly as the phase-by-phase step does: the same tokens, the same accepted counts, the same
publishable lengths and written blocks, step for step — with scripted drafts (many accepted) and
the random draft (few), forced acceptance, stop tokens, requests ending at different steps, an
abort in the middle, and batches that must fall back (a sampled request, logprobs, a k the
graphs were not made for) — launched as one forward after all its plans (``fused_graphs="one"``)
or split into a forward per chain position and one for the verify and fill (``"split"``). Graph
padding runs eagerly here through the same plans and buffers that a captured graph replays
(``graphs="pad"``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.common.errors import InvalidArgument
from services.gpuworker.attention.base import BatchLayout
from services.gpuworker.engine.graphs import ForwardGraphs
from services.gpuworker.engine.local import run_until_done, submit
from services.gpuworker.engine.sampling import SamplingParams
from test_engine_published_kv import PublishWatcher
from test_engine_support import make_setup, plain_greedy, prompts

MAX_NEW = 17
LENGTHS = (5, 13, 22, 9)


@dataclasses.dataclass
class Trace:
    steps: list[dict]  # per step: request id -> (tokens, proposed, accepted, L, T, finish reason)
    done: dict  # request id -> Completion
    engine: object
    published: list[dict]  # per step: request id -> publishable positions
    watcher: PublishWatcher
    lengths: list[int]  # 1 + accepted drafts of every verify the reports carried
    aborted_at: int | None  # after how many steps r2 was aborted
    fused_at: list[int]  # indices of the steps that launched a fused forward


def _pending(rid: str):
    """An abort condition: ``rid`` sits in the batch a fused step will reuse (its carry), or its
    verdict is still on the device (overlap)."""
    def check(engine) -> bool:
        verdict, carry = engine._verdict, engine._carry
        if verdict is not None:
            return any(s.request_id == rid for s in verdict.states)
        state = engine._states.get(rid)
        return carry is not None and state is not None and any(d is state.drafts for d in carry.drafts if d is not None)
    return check


def _trace(fused: bool, *, k: int, scripted: bool, forced=None, extra=None, stop=False, abort_at=None,
           abort_when=None, overlap=False, scribble=False, stagger=False, headroom=0, max_new=MAX_NEW,
           stop_at=9, **config) -> Trace:
    """Run four requests (one with a small max_new_tokens, one with a stop token) to the end,
    every published block watched (``PublishWatcher``). r2 is aborted after step ``abort_at``, or
    after the first step at which ``abort_when(engine)`` holds. ``scribble``: after every step,
    every free block of both pools is overwritten with garbage (the local source hands a freed
    block straight back, contents and all: a block trimmed too early would otherwise go unseen;
    finite, since masked positions of a request's last page are read with weight 0).
    ``stagger``: r2 and r3 arrive after steps 2 and 4, their prompts beside others' decodes.
    ``headroom``: positions reserved past each prompt (0: every decode step extends);
    ``max_new``: the others' max_new_tokens; ``stop_at``: r1's stop token is its output's token there."""
    ps = prompts(LENGTHS, seed=11)
    expected = {f"r{i}": p + plain_greedy(p, max_new) for i, p in enumerate(ps)}
    setup = make_setup("eagle3", scripted=expected if scripted else None, chunk_size=64, max_batch_tokens=128,
                       max_draft_tokens=5, graphs="pad", fused_spec=fused, forced_acceptance=forced, overlap=overlap,
                       **config)
    def admit(i: int) -> None:
        stop_ids = (expected[f"r{i}"][len(ps[i]) + stop_at],) if stop and i == 1 else ()
        submit(setup, f"r{i}", ps[i], max_new_tokens=6 if i == 3 else max_new, k=k, stop_ids=stop_ids,
               headroom=headroom)

    for i in range(2 if stagger else len(ps)):
        admit(i)
    if extra is not None:
        extra(setup)
    steps, published, watcher, lengths, aborted = [], [], PublishWatcher(setup, 1), [], []
    engine, fused_at = setup.engine, []
    launch_fused = engine._launch_fused
    engine._launch_fused = lambda *a, **kw: (fused_at.append(len(steps)), launch_fused(*a, **kw))[1]

    def record(report):
        steps.append({rid: (r.new_token_ids, r.proposed_drafts, r.accepted_drafts, r.logical_len, r.target_len,
                            r.finish_reason) for rid, r in report.results.items()})
        published.append({rid: r.publishable_positions for rid, r in report.results.items()})
        watcher(report)
        if scribble:
            free = torch.tensor(sorted(setup.source._free), dtype=torch.long)
            for pool in (setup.engine.target_pool, setup.engine.drafter.pool):
                pool.data[:, free] = 100.0
        lengths.extend(length for r in report.results.values() for length in r.acceptance_lengths)
        if stagger and len(steps) in (2, 4):
            admit(len(steps) // 2 + 1)
        due = len(steps) == abort_at if abort_when is None else abort_when(setup.engine)
        if due and not aborted and "r2" in setup.engine.request_ids():
            aborted.append(len(steps))
            setup.engine.abort("r2")
            setup.source.release("r2")

    # reservations are kept to the end: a released block could be handed out and rewritten
    # before a PublishWatcher compares it
    done = run_until_done(setup, on_step=record, keep=[f"r{i}" for i in range(len(ps))] + ["x"])
    return Trace(steps, done, engine, published, watcher, lengths, aborted[0] if aborted else None, fused_at)


def _same_publishing(on: Trace, off: Trace) -> None:
    """A request that will draft no more (its budget is spent) defers its draft fill to a block
    boundary on the phase-by-phase path; the fused step has filled those rows already, so its
    publishable prefix may run ahead, never behind, and both end equal. Every block published
    holds the KV of a from-scratch prefill of its tokens and was never written again."""
    for a, b in zip(on.published, off.published):
        assert all(a[rid] >= b[rid] for rid in a), (a, b)
    assert {rid: c.publishable_positions for rid, c in on.done.items()} == \
        {rid: c.publishable_positions for rid, c in off.done.items()}
    _published_kv_is_final(on)


def _published_kv_is_final(trace: Trace) -> None:
    ps = {f"r{i}": p for i, p in enumerate(prompts(LENGTHS, seed=11))}
    # an aborted request's blocks went back to the pool (and may hold another's KV by now)
    checked = sum(trace.watcher.check(rid, ps[rid] + c.tokens, "eagle3") for rid, c in trace.done.items()
                  if rid in ps and c.finish_reason is not None)
    assert checked >= 8


LAUNCHES = ["one", "split"]


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("scripted", [True, False])
def test_fused_steps_equal_phase_by_phase_steps(k, scripted, launch):
    off, on = _trace(False, k=k, scripted=scripted), _trace(True, k=k, scripted=scripted, fused_graphs=launch)
    assert off.engine.fused_steps == 0 and on.engine.fused_steps >= 3
    assert on.steps == off.steps
    _same_publishing(on, off)
    ps = prompts(LENGTHS, seed=11)
    for i, p in enumerate(ps):  # and both are the target's own greedy output
        assert on.done[f"r{i}"].tokens == plain_greedy(p, 6 if i == 3 else MAX_NEW)
    if scripted:
        assert sum(c.counts.accepted_drafts for c in on.done.values()) > 0


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("forced", [0, 2, 3])
def test_fused_steps_with_forced_acceptance(forced, launch):
    """Benchmarks' forced acceptance: the verdict is min(forced, k) drafts, then the target's token."""
    off = _trace(False, k=3, scripted=False, forced=forced)
    on = _trace(True, k=3, scripted=False, forced=forced, fused_graphs=launch)
    assert on.engine.fused_steps > 0 and on.steps == off.steps
    verified = [v for step in on.steps for v in step.values() if v[1]]
    assert verified and all(accepted == min(forced, proposed) for _, proposed, accepted, *_ in verified)


@pytest.mark.parametrize("launch", LAUNCHES)
def test_fused_steps_with_a_stop_token_and_an_abort(launch):
    """A stop token inside an accepted run ends the request there (its fill past the stop is
    never published); an abort between steps breaks the batch the next step would reuse."""
    on = _trace(True, k=3, scripted=True, stop=True, abort_when=_pending("r2"), fused_graphs=launch)
    off = _trace(False, k=3, scripted=True, stop=True, abort_at=on.aborted_at)
    assert on.aborted_at is not None and on.fused_at[-1] > on.aborted_at  # fused again after it
    assert on.engine.fused_steps > 0 and on.steps == off.steps
    _same_publishing(on, off)
    r1 = on.done["r1"]
    assert r1.finish_reason.value == "stop" and len(r1.tokens) <= 10 and r1.tokens[-1] not in r1.tokens[:-1]
    assert "r2" in on.done and on.done["r2"].finish_reason is None  # aborted: never finished


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("extra", ["sampled", "logprobs", "other k"])
def test_batches_the_fused_step_cannot_take_fall_back(extra, launch):
    """One request the fused forward cannot serve (sampled, asks for logprobs, or a k outside the
    graphs) puts its whole batch on the phase-by-phase path; outputs stay the same."""
    ps = prompts((7,), seed=5)

    def add(setup):
        if extra == "sampled":
            submit(setup, "x", ps[0], max_new_tokens=5, k=3, sampling=SamplingParams(temperature=0.7, seed=3))
        elif extra == "logprobs":
            submit(setup, "x", ps[0], max_new_tokens=5, k=3, logprobs=1)
        else:
            submit(setup, "x", ps[0], max_new_tokens=MAX_NEW, k=5)  # k + 1 > block_size: no graph

    off, on = _trace(False, k=3, scripted=True, extra=add), _trace(True, k=3, scripted=True, extra=add, fused_graphs=launch)
    assert on.steps == off.steps
    # a fused step never carried "x" (other k: only once its budget shrank into the graphs' k)
    assert on.fused_at
    for i in on.fused_at:
        step = on.steps[i]
        assert "x" not in step or (extra == "other k" and step["x"][1] <= 3), step
    if extra != "sampled":
        assert on.done["x"].tokens == plain_greedy(ps[0], len(on.done["x"].tokens))


def test_a_fused_step_is_one_forward_over_k_plans():
    """Each fused step plans k layouts (the verify on lane 0, chain positions on lanes 1..k-1)
    and runs one forward; no per-phase forward (chain, target, fill) runs in that step."""
    ps = prompts(LENGTHS, seed=11)
    setup = make_setup("eagle3", block_size=8, chunk_size=64, max_batch_tokens=128, max_draft_tokens=5, graphs="pad",
                       fused_graphs="one")
    engine, graphs, backend = setup.engine, setup.engine.graphs, setup.engine.backend
    events: list[tuple] = []
    plan, run, run_lanes = backend.plan, graphs.run, graphs.run_lanes
    backend.plan = lambda layout, kind=None, lane=0: (events.append(("plan", kind, layout.arrays.uniform_q, lane)),
                                                      plan(layout, kind, lane))[1]
    graphs.run = lambda name, layout, inputs: (events.append(("run", name)), run(name, layout, inputs))[1]
    graphs.run_lanes = lambda name, q, layouts, inputs: (events.append(("lanes", name, q)),
                                                        run_lanes(name, q, layouts, inputs))[1]
    for i, p in enumerate(ps):
        submit(setup, f"r{i}", p, max_new_tokens=MAX_NEW, k=4)
    per_step = []
    run_until_done(setup, on_step=lambda _r: (per_step.append(list(events)), events.clear()))
    fused = [step for step in per_step if any(e[0] == "lanes" for e in step)]
    assert len(fused) == engine.fused_steps >= 3
    ks = []
    for step in fused:  # k = 4, or less once every request's budget is below it
        launches = [e for e in step if e[0] in ("run", "lanes")]
        assert len(launches) == 1 and launches[0][:2] == ("lanes", "spec"), launches
        k = launches[0][2]
        ks.append(k)
        plans = [e for e in step if e[0] == "plan"]
        assert [(e[2], e[3]) for e in plans] == [(k + 1, 0)] + [(1, j) for j in range(1, k)]
    assert ks.count(4) >= 3


def _strict_graph_outputs(monkeypatch) -> None:
    """Hold the engine to ``graphs.py``'s contract on the CPU: a graph's outputs are valid only
    until the next replay of ANY graph (they share one memory pool). Every run returns its
    outputs in buffers of its own (forward, bucket, q), and poisons every other graph's."""
    execute = ForwardGraphs._execute

    def strict(self, name, plan, inputs, batch, padded_batch, q):
        out = execute(self, name, plan, inputs, batch, padded_batch, q)
        held = self.__dict__.setdefault("_held_outputs", {})
        key = (name, padded_batch, q)
        for other, buffers in held.items():
            if other != key:
                for t in buffers.values():
                    t.fill_(7)
        mine = held.setdefault(key, {})
        for k, v in out.items():
            if k not in mine or mine[k].shape != v.shape:
                mine[k] = torch.empty_like(v)
            mine[k].copy_(v)
        return dict(mine)

    monkeypatch.setattr(ForwardGraphs, "_execute", strict)


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("overlap", [False, True])
def test_fused_steps_read_no_graph_output_after_another_replay(monkeypatch, launch, overlap):
    """Under that contract (a split step's chain positions are separate graphs, so a proposal
    must be copied out before the next position replays) the fused steps still give the
    phase-by-phase tokens: k = 3, scripted drafts, so most proposals become output."""
    _strict_graph_outputs(monkeypatch)
    off = _trace(False, k=3, scripted=True)
    on = _trace(True, k=3, scripted=True, fused_graphs=launch, overlap=overlap)
    assert on.engine.fused_steps >= 3 and sum(c.counts.accepted_drafts for c in on.done.values()) > 0
    assert _outcome(on) == _outcome(off)


def _swap_outcome(fused: bool, r0_new: int, r2_at: int, **config) -> dict:
    ps = prompts((9, 14, 6), seed=3)
    expected = {f"r{i}": p + plain_greedy(p, 12) for i, p in enumerate(ps)}
    setup = make_setup("eagle3", scripted=expected, chunk_size=64, max_batch_tokens=128, max_draft_tokens=3,
                       graphs="pad", fused_spec=fused, **config)
    submit(setup, "r0", ps[0], max_new_tokens=r0_new, k=3)
    submit(setup, "r1", ps[1], max_new_tokens=12, k=3)
    steps = []

    def admit(_report):
        steps.append(None)
        if len(steps) == r2_at:
            submit(setup, "r2", ps[2], max_new_tokens=12, k=3)

    done = run_until_done(setup, on_step=admit)
    return {rid: (c.tokens, c.counts) for rid, c in done.items()}


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("overlap", [False, True])
def test_a_batch_of_the_same_size_with_another_request_is_not_the_last_ones(launch, overlap):
    """r0 ends about when r2's prompt is done, so a fused batch [r1, r2] follows [r0, r1]: as many
    requests, not the same ones. The last step's tokens, proposals and layout must not be reused
    (only an unchanged batch may): tokens and counts as phase by phase, over arrival times."""
    for r0_new in (4, 5, 6, 7):
        for r2_at in (1, 2, 3):
            on = _swap_outcome(True, r0_new, r2_at, fused_graphs=launch, overlap=overlap)
            off = _swap_outcome(False, r0_new, r2_at)
            assert on == off, (r0_new, r2_at)


def test_a_split_step_launches_each_forward_right_after_its_own_plan():
    """``fused_graphs="split"``: chain position j is planned on lane j and run at once, the verify
    (and fill) planned last on lane 0 and run last, so only the first plan of a step comes before
    the device has work; no phase-by-phase forward (chain, target, fill) runs in that step. Only
    the forwards of that launch are registered."""
    ps = prompts(LENGTHS, seed=11)
    setup = make_setup("eagle3", block_size=8, chunk_size=64, max_batch_tokens=128, max_draft_tokens=5, graphs="pad",
                       fused_graphs="split")
    engine, graphs, backend = setup.engine, setup.engine.graphs, setup.engine.backend
    assert "spec" not in graphs._forwards
    assert [n for n in graphs._forwards if n.startswith("spec_")] == [f"spec_chain{j}" for j in range(1, 5)] + ["spec_verify"]
    events: list[tuple] = []
    plan, run = backend.plan, graphs.run
    backend.plan = lambda layout, kind=None, lane=0: (events.append(("plan", layout.arrays.uniform_q, lane)),
                                                      plan(layout, kind, lane))[1]
    graphs.run = lambda name, layout, inputs: (run(name, layout, inputs), events.append(("run", name)))[0]  # after its plan
    for i, p in enumerate(ps):
        submit(setup, f"r{i}", p, max_new_tokens=MAX_NEW, k=4)
    per_step = []
    run_until_done(setup, on_step=lambda _r: (per_step.append(list(events)), events.clear()))
    fused = [step for step in per_step if ("run", "spec_verify") in step]
    assert len(fused) == engine.fused_steps >= 3
    ks = []
    for step in fused:  # k = 4, or less once every request's budget is below it
        k = step[-2][1] - 1
        ks.append(k)
        assert step == [e for j in range(1, k) for e in (("plan", 1, j), ("run", f"spec_chain{j}"))] + \
            [("plan", k + 1, 0), ("run", "spec_verify")]
    assert ks.count(4) >= 3


def test_a_forward_pinned_to_a_lane_plans_there_and_bad_lanes_are_refused():
    setup = make_setup("eagle3", max_draft_tokens=3, graphs="pad", fused_graphs="split")
    graphs, backend = setup.engine.graphs, setup.engine.backend
    lanes: list[int] = []
    plan = backend.plan
    backend.plan = lambda layout, kind=None, lane=0: (lanes.append(lane), plan(layout, kind, lane))[1]
    tokens, hidden = torch.zeros(1, dtype=torch.long), torch.zeros(1, setup.draft.chain_hidden_size)
    table = setup.source.reserve("q", 8)
    out, planned = graphs.run("spec_chain2", BatchLayout([table], [2], [1]), {"tokens": tokens, "hidden": hidden})
    assert lanes == [2] and out["tokens"].shape == (1,) and planned.batch_size == 1
    fn = graphs._forwards["spec_chain1"][0]
    for bad in (-1, 1.0, True, 64):
        with pytest.raises(InvalidArgument, match="lane must be"):
            graphs.register("x", fn, {"tokens": ((), torch.long)}, (1,), lane=bad)
    with pytest.raises(InvalidArgument, match="lane must be"):
        graphs.register("x", fn, {"tokens": ((), torch.long)}, (2,), lanes=lambda q: (q, 1), lane=1)
    assert "x" not in graphs._forwards


def test_run_lanes_refuses_layouts_the_graph_was_not_made_for():
    setup = make_setup("eagle3", max_draft_tokens=3, graphs="pad", fused_graphs="one")
    graphs = setup.engine.graphs
    table = [[0, 1]]
    verify, chain = BatchLayout(table, [2], [4]), BatchLayout(table, [2], [1])
    inputs = {"last": torch.zeros(1, dtype=torch.long), "d1": torch.zeros(1, dtype=torch.long),
              "forced": torch.zeros(1, dtype=torch.long), "cap": torch.zeros(1, dtype=torch.long),
              "hidden": torch.zeros(1, setup.draft.chain_hidden_size)}
    with pytest.raises(InvalidArgument, match="not covered"):
        graphs.run_lanes("spec", 3, [verify, chain], inputs)  # k = 3 needs 3 plans
    with pytest.raises(InvalidArgument, match="not covered"):
        graphs.run_lanes("spec", 3, [chain, chain, chain], inputs)  # the verify's query length first
    with pytest.raises(InvalidArgument, match="not covered"):
        graphs.run_lanes("spec", 4, [BatchLayout(table, [2], [5])] + [chain] * 3, inputs)  # k > max_draft_tokens
    with pytest.raises(InvalidArgument, match="several plans"):
        graphs.run("spec", verify, inputs)
    with pytest.raises(InvalidArgument, match="lane must be"):
        type(setup.engine.backend).plan(setup.engine.backend, chain, lane=-1)  # unchecked by make_setup's wrapper


def _outcome(trace: Trace) -> dict:
    return {rid: (c.tokens, c.counts, c.finish_reason, c.publishable_positions) for rid, c in trace.done.items()}


def _silent(trace: Trace) -> list[str]:
    """Decoding requests that streamed nothing in a step (every prompt here is one chunk)."""
    return [rid for step in trace.steps for rid, v in step.items() if not v[0] and v[-1] is None]


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("scripted", [True, False])
def test_overlapped_fused_steps_stream_the_same_tokens_a_step_later(k, scripted, launch):
    """With ``overlap`` a fused step's verdict is read at the start of the next step: a report
    then carries the previous step's tokens; every request's tokens, counts and published
    prefix end as without it, and every published block holds the from-scratch KV."""
    off, on = _trace(False, k=k, scripted=scripted), _trace(True, k=k, scripted=scripted, overlap=True, fused_graphs=launch)
    assert on.engine.fused_steps >= 3
    assert _outcome(on) == _outcome(off)
    # every verify is reported once, with its own acceptance length, also where a lagged verdict
    # and a phase-by-phase verify of the same request land in one report
    assert sorted(on.lengths) == sorted(off.lengths) and len(on.lengths) == sum(c.counts.decode_steps for c in on.done.values())
    # the first fused step of a run streams nothing: its tokens come with the next report
    assert _silent(on) and not _silent(off)
    _published_kv_is_final(on)


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("forced", [None, 2])
def test_overlapped_fused_steps_with_a_stop_an_abort_and_forced_acceptance(forced, launch):
    """The abort comes while r2's verdict is still on the device: nothing of it is applied, and
    its tokens are those streamed before (one step fewer than without overlap, whose abort after
    the same step came after that verdict was applied)."""
    on = _trace(True, k=3, scripted=True, stop=True, abort_when=_pending("r2"), forced=forced, overlap=True,
                fused_graphs=launch)
    assert on.aborted_at is not None and on.engine.fused_steps > 0 and _silent(on)
    off = _trace(False, k=3, scripted=True, stop=True, abort_at=on.aborted_at - 1, forced=forced)
    assert _outcome(on) == _outcome(off)
    _published_kv_is_final(on)


def test_overlapped_fused_steps_under_the_rejected_trim_policy():
    """``trim_policy="rejected"`` gives back blocks past L after every verify: while a verdict is
    on the device, L is the old one and the blocks its step writes (up to L + k) must stay."""
    off = _trace(False, k=3, scripted=True, trim_policy="rejected", scribble=True)
    on = _trace(True, k=3, scripted=True, trim_policy="rejected", overlap=True, scribble=True)
    assert on.engine.fused_steps >= 3
    assert _outcome(on) == _outcome(off)
    ps = prompts(LENGTHS, seed=11)
    for i, p in enumerate(ps):
        assert on.done[f"r{i}"].tokens == plain_greedy(p, 6 if i == 3 else MAX_NEW)


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("overlap", [False, True])
def test_prompts_arriving_beside_fused_steps(overlap, launch):
    """Requests that arrive while others decode (a served worker's usual step): the decodes still
    run as one fused forward and the new prompt beside it as an eager one; tokens, counts and
    published KV as on the phase-by-phase path (step for step without overlap)."""
    off = _trace(False, k=3, scripted=True, stagger=True)
    on = _trace(True, k=3, scripted=True, stagger=True, overlap=overlap, fused_graphs=launch)
    beside = [i for i in on.fused_at if any(v[3] == v[4] + 1 and v[0] and not v[1] and v[-1] is None
                                                    for v in on.steps[i].values())]
    assert beside, on.fused_at  # a fused step whose report has a prompt's first token
    if overlap:
        assert _outcome(on) == _outcome(off)
    else:
        assert on.steps == off.steps
        _same_publishing(on, off)
    _published_kv_is_final(on)


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("case", ["scripted", "random", "forced", "stop", "abort", "arrivals"])
def test_continued_fused_steps_equal_phase_by_phase_steps(case, launch):
    """With room reserved ahead (no extends), an overlapped fused step over the batch of the
    last one is launched before that one's verdict is applied (``Engine._continue_fused``);
    where the batch changes (a request ends on a stop token or its length, is aborted, or
    arrives) the step is scheduled instead. Tokens, counts and published KV as phase by phase."""
    kw = dict(k=3, scripted=case != "random", headroom=48, max_new=40)
    kw.update({"forced": dict(forced=2, scripted=False), "stop": dict(stop=True, stop_at=25),
               "arrivals": dict(stagger=True)}.get(case, {}))
    on = _trace(True, overlap=True, fused_graphs=launch, abort_when=_pending("r2") if case == "abort" else None, **kw)
    off = _trace(False, abort_at=None if on.aborted_at is None else on.aborted_at - 1, **kw)
    engine = on.engine
    assert engine.continued_steps >= 2 and engine.fused_steps > engine.continued_steps
    assert _outcome(on) == _outcome(off)
    _published_kv_is_final(on)
    if case == "stop":  # it ended on its stop token in the middle of the run, the others went on
        r1 = on.done["r1"]
        assert r1.finish_reason.value == "stop" and len(r1.tokens) < 40 == len(on.done["r0"].tokens)
    if case == "arrivals":  # a request admitted between steps is prefilled by the next one, not held back
        ps = prompts(LENGTHS, seed=11)
        assert on.steps[2]["r2"][4] == len(ps[2]) and on.steps[4]["r3"][4] == len(ps[3])


@pytest.mark.parametrize("launch", LAUNCHES)
def test_a_request_swapped_in_between_steps_is_not_continued_over(launch):
    """An abort and an arrival between two steps leave the batch its size but not its requests:
    the next step is scheduled (the newcomer prefilled, the aborted one gone), not continued."""
    ps = prompts((7, 11, 9), seed=4)
    setup = make_setup("eagle3", chunk_size=64, max_batch_tokens=128, max_draft_tokens=5, graphs="pad", overlap=True,
                       fused_graphs=launch)
    engine = setup.engine
    for i in (0, 1):
        submit(setup, f"r{i}", ps[i], max_new_tokens=30, k=3, headroom=40)
    while engine.continued_steps < 2:
        engine.step()
    engine.abort("r1")
    setup.source.release("r1")
    submit(setup, "x", ps[2], max_new_tokens=30, k=3, headroom=40)
    report = engine.step()
    assert report.results["x"].target_len == len(ps[2]) and "x" in engine.request_ids()
    assert "r1" not in report.results and engine.request_ids() == ["r0", "x"]
    done = run_until_done(setup)
    assert report.results["x"].new_token_ids + done["x"].tokens == plain_greedy(ps[2], 30)
    assert len(done["r0"].tokens) > 0 and done["r0"].finish_reason.value == "length"


def _capped_launches(engine) -> list[tuple[list[int], int, int]]:
    """Wrap ``engine._launch_fused`` to record, per fused launch, its caps (the drafts each
    request may keep), its k and how many of its verify tables end on the scratch page."""
    seen, launch = [], engine._launch_fused
    scratch = engine.graphs.scratch_block

    def wrapped(states, k, *a, **kw):
        verdict = launch(states, k, *a, **kw)
        padded = sum(len(t) > len(s.block_table) and int(t[-1]) == scratch for s, t in zip(states, verdict.tables))
        seen.append((verdict.caps or [k] * len(states), k, padded))
        return verdict

    engine._launch_fused = wrapped
    return seen


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("case", ["scripted", "random", "forced", "stagger"])
@pytest.mark.parametrize("headroom", [0, 48])
def test_requests_with_smaller_budgets_ride_in_the_fused_step(case, headroom, launch):
    """A request near its max_new_tokens (r3 ends at 6) drafts fewer than the others; it still
    joins the fused step, verifies k and keeps at most its own budget (a cap), instead of putting
    the whole batch on the phase-by-phase path (with no headroom every step extends to exactly
    what it needs). Tokens, counts and published KV stay those of phase by phase, with free
    blocks scribbled over after every step, and no step with decodes runs by phases."""
    kw = dict(k=3, scripted=case != "random", headroom=headroom, scribble=True)
    kw.update({"forced": dict(forced=2, scripted=False), "stagger": dict(stagger=True)}.get(case, {}))
    launches: list = []  # recorded from the first step on (``extra`` runs before it)
    on = _trace(True, fused_graphs=launch, extra=lambda setup: launches.append(_capped_launches(setup.engine)), **kw)
    off = _trace(False, **kw)
    assert on.steps == off.steps
    _same_publishing(on, off)
    seen = launches[0]
    mixed = [(caps, k) for caps, k, _ in seen if min(caps) < k]
    assert mixed, seen  # some fused step carried a request with a smaller budget
    # every step with decodes ran fused (prompt-only steps aside): no fallback for budgets
    decode_steps = [i for i, step in enumerate(on.steps) if any(v[1] or v[2] for v in step.values())]
    assert set(decode_steps) <= set(on.fused_at), (decode_steps, on.fused_at)


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("short_prompt", [11, 14])
def test_a_capped_request_keeps_exactly_its_budget_whatever_the_verdict(short_prompt, launch):
    """Forced acceptance of every draft: a request with budget b < k keeps b drafts (then the
    target's token) and ends on its max_new_tokens; without the cap it would keep k. Its blocks
    hold exactly what it needs (no headroom, pages of 4): after a prompt of 11 its verify of k
    fits them (positions 15 .. 18 of 20), after one of 14 it passes them (18 .. 21): the last two
    rows go to the scratch page, and what the block source handed out is all the step wrote."""
    ps = prompts((7, short_prompt), seed=8)
    setup = make_setup("eagle3", chunk_size=64, max_batch_tokens=128, max_draft_tokens=5, graphs="pad",
                       forced_acceptance=3, fused_graphs=launch)
    seen = _capped_launches(setup.engine)
    submit(setup, "long", ps[0], max_new_tokens=40, k=3)
    submit(setup, "short", ps[1], max_new_tokens=7, k=3)  # 1, 5, then a budget of 1: keeps 1 + 1 token
    counts = []
    done = run_until_done(setup, on_step=lambda rep: counts.extend(
        (rid, r.proposed_drafts, r.accepted_drafts) for rid, r in rep.results.items() if rid == "short" and r.proposed_drafts))
    assert done["short"].finish_reason.value == "length" and len(done["short"].tokens) == 7
    assert counts == [("short", 3, 3), ("short", 1, 1)], counts
    capped = [padded for caps, k, padded in seen if caps == [3, 1] and k == 3]
    assert capped == [1 if short_prompt == 14 else 0], seen
    off = make_setup("eagle3", chunk_size=64, max_batch_tokens=128, max_draft_tokens=5, graphs="pad",
                     forced_acceptance=3, fused_spec=False)
    submit(off, "long", ps[0], max_new_tokens=40, k=3)
    submit(off, "short", ps[1], max_new_tokens=7, k=3)
    assert {rid: c.tokens for rid, c in run_until_done(off).items()} == {rid: c.tokens for rid, c in done.items()}


@pytest.mark.parametrize("launch", LAUNCHES)
def test_a_newcomer_in_an_aborted_requests_row_does_not_take_its_carry(launch):
    """[a, b] run fused (overlap: the verdict is applied next step); c's prompt runs beside them
    and leaves it a budget of 0 (max_new_tokens 2: no proposal, no chain hidden); b is aborted
    before that verdict is applied, so its row of the carry holds no proposal either. The next
    fused step is [a, c]: as long as the last one, a in its row, c holding no proposal just as
    b's dropped row; yet b's newest token must not be fed to c (its one token would be wrong)."""
    ps = prompts((7, 9, 5), seed=6)
    setup = make_setup("eagle3", chunk_size=64, max_batch_tokens=128, max_draft_tokens=5, graphs="pad",
                       fused_graphs=launch, overlap=True)
    engine = setup.engine
    submit(setup, "a", ps[0], max_new_tokens=30, k=3)
    submit(setup, "b", ps[1], max_new_tokens=30, k=3)
    while engine.fused_steps < 2:
        engine.step()
    submit(setup, "c", ps[2], max_new_tokens=2, k=3)
    first = engine.step().results["c"].new_token_ids
    assert engine.state("c").drafts is None and engine._verdict is not None
    engine.abort("b")
    setup.source.release("b")
    fused, tokens, result = engine.fused_steps, list(first), None
    while result is None or result.finish_reason is None:
        result = engine.step().results.get("c")
        tokens += result.new_token_ids if result is not None else []
    assert engine.fused_steps > fused and result.finish_reason.value == "length"
    assert tokens == plain_greedy(ps[2], 2)


def _churn(fused: bool, *, overlap: bool, launch: str = "one", forced=None, scripted=True, stop=False,
           sampled=False, total: int = 18, concurrency: int = 6, **config):
    """A closed loop, as a busy server sees it: ``concurrency`` requests of staggered lengths,
    each finished one replaced by the next (its prompt then runs beside the others' decodes),
    room reserved ahead as the worker's watermark does. ``stop``: every third request has a stop
    token in the middle of its output; ``sampled``: the ninth one samples (temperature 0.8),
    which no fused step may take. Returns (engine, outcome, calls of ``_feed``)."""
    ps = prompts([5 + (7 * i) % 17 for i in range(total)], seed=21)
    max_new = [4 + (5 * i) % 15 for i in range(total)]
    expected = {f"c{i}": p + plain_greedy(p, max_new[i]) for i, p in enumerate(ps)}
    setup = make_setup("eagle3", scripted=expected if scripted else None, chunk_size=64, max_batch_tokens=128,
                       max_draft_tokens=5, graphs="pad", fused_spec=fused, overlap=overlap, forced_acceptance=forced,
                       fused_graphs=launch, **config)
    feeds, feed = [], setup.engine._feed
    setup.engine._feed = lambda *a: (feeds.append(1), feed(*a))[1]
    admitted: list[int] = []

    def admit() -> None:
        i = len(admitted)
        admitted.append(i)
        stop_ids = (expected[f"c{i}"][len(ps[i]) + max_new[i] // 2],) if stop and i % 3 == 0 else ()
        sampling = SamplingParams(temperature=0.8, seed=i) if sampled and i == 8 else SamplingParams()
        submit(setup, f"c{i}", ps[i], max_new_tokens=max_new[i], k=3, headroom=24, stop_ids=stop_ids, sampling=sampling)

    for _ in range(concurrency):
        admit()

    def on_step(report) -> None:
        for r in report.results.values():
            if r.finished and len(admitted) < total:
                admit()

    done = run_until_done(setup, on_step=on_step)
    assert len(done) == total
    return setup.engine, {rid: (c.tokens, c.counts, c.finish_reason) for rid, c in done.items()}, len(feeds)


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("case", ["scripted", "random", "forced", "stop", "sampled", "prefill_wait"])
def test_continued_steps_through_a_changing_batch_equal_phase_by_phase(case, launch):
    """Requests end and arrive nearly every step: the next fused step is still launched before
    the last verdict is applied, over the requests that go on (those it ends dropped) and those
    whose prompt ended since (fed from their state, the others from the verdict's rows), with the
    newcomers' prompt chunks beside (a sampled newcomer is no candidate: the step is scheduled,
    phase by phase). Every request's tokens, counts and finish reason are those of the
    phase-by-phase engine without overlap. With prefill batching new prompts are held a few
    steps while the batch decodes on, continued (the real schedule decides what is held)."""
    kw = {"scripted": dict(), "random": dict(scripted=False), "forced": dict(forced=2, scripted=False),
          "stop": dict(stop=True), "sampled": dict(sampled=True),
          "prefill_wait": dict(prefill_wait_steps=2, prefill_batch=3)}[case]
    on, on_out, feeds = _churn(True, overlap=True, launch=launch, **kw)
    _, off_out, _ = _churn(False, overlap=False, **kw)
    assert on_out == off_out
    least = 0.3 if case == "sampled" else 0.6
    assert on.continued_steps >= least * on.fused_steps and feeds >= 3, (on.continued_steps, on.fused_steps, feeds)
    if case == "stop":
        assert sum(c[2].value == "stop" for c in on_out.values()) >= 3
