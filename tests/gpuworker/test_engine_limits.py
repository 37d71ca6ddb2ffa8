"""Stopping rules, forced acceptance, capacity (extend / trim) and request lifecycle.

Every engine here runs with ``checked_plans``: each table it attends with must be exactly a live
reservation's table of the block source, with its kv_len inside the capacity — so an overrun by
speculative tokens fails whichever test causes it.
"""

from __future__ import annotations

import pytest

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from services.gpuworker.engine.capacity import LocalBlockSource, blocks_for
from services.gpuworker.engine.engine import EngineConfig
from services.gpuworker.engine.local import run_until_done, submit
from services.gpuworker.engine.request import FinishReason, RequestSpec
from services.gpuworker.engine.sampling import SamplingParams
from test_engine_support import checked_plans, make_setup, plain_greedy, prompts

BS = 4


def _scripted(rid, prompt, n):
    return {rid: prompt + plain_greedy(prompt, n)}


@pytest.mark.parametrize("mode", ["eagle3", "mtp2"])
def test_max_seq_len_stops_output_and_drafting(mode):
    prompt = prompts((20,), seed=1)[0]
    setup = make_setup(mode, scripted=_scripted("a", prompt, 40), miss_percent=0, max_seq_len=31, chunk_size=7)
    kv_lens = checked_plans(setup)
    submit(setup, "a", prompt, max_new_tokens=100, k=4)
    done = run_until_done(setup)["a"]
    assert done.finish_reason is FinishReason.MAX_SEQ_LEN
    assert done.tokens == plain_greedy(prompt, 11)  # 20 + 11 = max_seq_len
    # nothing (target verify nor draft chain) ever touched a position >= max_seq_len - 1
    assert max(kv_lens) <= 30
    assert done.accepted_drafts > 0 and done.decode_steps < 10


@pytest.mark.parametrize("k", [0, 4])
def test_stop_token_ends_output_inside_accepted_drafts(k):
    prompt = prompts((9,), seed=2)[0]
    ref = plain_greedy(prompt, 20)
    stop = ref[6]
    cut = ref.index(stop) + 1
    setup = make_setup("eagle3", scripted=_scripted("a", prompt, 30), miss_percent=0)
    submit(setup, "a", prompt, max_new_tokens=20, k=k, stop_ids=[stop, 511])
    done = run_until_done(setup)["a"]
    assert done.finish_reason is FinishReason.STOP
    assert done.tokens == ref[:cut]


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_max_new_tokens_exact_with_speculation(max_new):
    prompt = prompts((6,), seed=3)[0]
    setup = make_setup("mtp2", scripted=_scripted("a", prompt, 12), miss_percent=0)
    submit(setup, "a", prompt, max_new_tokens=max_new, k=4)
    done = run_until_done(setup)["a"]
    assert done.finish_reason is FinishReason.LENGTH
    assert done.tokens == plain_greedy(prompt, max_new)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=5)])
def test_forced_acceptance_pins_the_accepted_count(sampling):
    prompt = prompts((10,), seed=4)[0]
    setup = make_setup("eagle3", forced_acceptance=2)  # random draft: real verification rejects nearly all
    submit(setup, "a", prompt, max_new_tokens=25, k=4, sampling=sampling)
    counts = []
    run_until_done(setup, on_step=lambda rep: counts.extend(
        (r.proposed_drafts, r.accepted_drafts, len(r.new_token_ids)) for r in rep.results.values() if r.verified))
    assert counts and all(acc == min(2, prop) for prop, acc, _ in counts)
    assert all(n == acc + 1 for _, acc, n in counts[:-1])
    assert sum(prop for prop, _, _ in counts) > 0 and counts[0][0] == 4


def test_default_engine_does_not_force():
    assert EngineConfig().forced_acceptance is None


def test_top_k_one_sampling_equals_greedy_through_rejection_sampling():
    """temperature > 0 with top_k = 1 makes p and q one-hot: rejection sampling must then accept
    exactly the drafts greedy verification accepts."""
    prompt = prompts((8,), seed=6)[0]
    for mode in ("eagle3", "mtp2"):
        setup = make_setup(mode, scripted=_scripted("a", prompt, 16))
        submit(setup, "a", prompt, max_new_tokens=12, k=3, sampling=SamplingParams(temperature=0.7, top_k=1, seed=1))
        done = run_until_done(setup)["a"]
        assert done.tokens == plain_greedy(prompt, 12)
        assert 0 < done.accepted_drafts < done.proposed_drafts


def test_sampling_is_reproducible_and_independent_of_the_batch():
    ps = prompts((7, 12, 5), seed=7)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)

    def run(batch, k):
        setup = make_setup("mtp2", chunk_size=4)
        for i in batch:
            submit(setup, f"r{i}", ps[i], max_new_tokens=10, k=k,
                   sampling=params if i == 0 else SamplingParams(temperature=1.0, seed=i))
        return run_until_done(setup)["r0"].tokens

    alone = run([0], 3)
    assert run([0, 1, 2], 3) == alone
    assert run([2, 0], 3) == alone
    other = make_setup("mtp2")
    submit(other, "x", ps[0], max_new_tokens=10, k=3, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=12))
    assert run_until_done(other)["x"].tokens != alone


def test_one_extend_and_one_trim_per_step_and_rejected_trim_policy():
    ps = prompts((9, 14, 6), seed=8)
    expected = {f"r{i}": p + plain_greedy(p, 15) for i, p in enumerate(ps)}
    setup = make_setup("eagle3", scripted=expected, miss_percent=50, trim_policy="rejected", chunk_size=5,
                       max_batch_tokens=20)
    for i, p in enumerate(ps):
        submit(setup, f"r{i}", p, max_new_tokens=15, k=3)
    calls = []

    def on_step(rep):
        calls.append((len(setup.source.extend_calls), len(setup.source.trim_calls)))
        for rid, r in rep.results.items():
            if r.verified and not r.finished:  # rolled back to the blocks of accepted tokens
                assert r.target_len <= r.capacity_after <= blocks_for(r.logical_len, BS) * BS
                assert len(setup.source.table(rid)) == len(r.block_table)

    done = run_until_done(setup, on_step=on_step)
    per_step = [(e1 - e0, t1 - t0) for (e0, t0), (e1, t1) in zip([(0, 0)] + calls, calls)]
    assert all(e <= 1 and t <= 1 for e, t in per_step)
    assert sum(t for _, t in per_step) >= 2 and sum(e for e, _ in per_step) > 3
    for i, p in enumerate(ps):
        assert done[f"r{i}"].tokens == expected[f"r{i}"][len(p):]
    assert setup.source.free_blocks == setup.source.num_blocks  # everything released, nothing leaked


def test_unneeded_headroom_is_trimmed_once():
    prompt = prompts((10,), seed=9)[0]
    setup = make_setup("eagle3")
    submit(setup, "a", prompt, max_new_tokens=5, k=2, headroom=40)
    rep = setup.engine.step()
    assert rep.trim_keeps == {"a": 10 + 5 - 1}
    assert rep.results["a"].capacity_after == blocks_for(14, BS) * BS < rep.results["a"].capacity_before
    done = run_until_done(setup)
    assert rep.results["a"].new_token_ids + done["a"].tokens == plain_greedy(prompt, 5)


def test_extend_failure_shrinks_the_step_then_finishes_with_capacity():
    prompt = prompts((8,), seed=10)[0]
    setup = make_setup("eagle3", num_blocks=5, chunk_size=64)  # 20 positions in all
    submit(setup, "a", prompt, max_new_tokens=30, k=4)
    reports = []
    done = run_until_done(setup, on_step=reports.append)["a"]
    assert done.finish_reason is FinishReason.CAPACITY
    # it ran as far as the pool allows (19 positions written + the last token), output intact
    assert done.tokens == plain_greedy(prompt, len(done.tokens)) and len(done.tokens) >= 11
    errors = [r.error for rep in reports for r in rep.results.values() if r.error is not None]
    assert errors and all(isinstance(e, ResourceExhausted) for e in errors)
    shrunk = [r for rep in reports for r in rep.results.values() if r.error is not None and not r.finished]
    assert shrunk and all(r.proposed_drafts < 4 for r in shrunk)


def test_abort_and_lifecycle():
    prompt = prompts((6,), seed=11)[0]
    setup = make_setup("eagle3")
    submit(setup, "a", prompt, max_new_tokens=50, k=2)
    submit(setup, "b", prompt, max_new_tokens=3, k=2)
    setup.engine.step()
    setup.engine.abort("a")
    setup.source.release("a")
    with pytest.raises(NotFound):
        setup.engine.abort("a")
    done = run_until_done(setup)
    assert set(done) == {"b"} and not setup.engine.has_work()
    assert setup.source.free_blocks == setup.source.num_blocks


def test_add_request_validation():
    setup = make_setup("mtp2", max_draft_tokens=4, max_seq_len=64)
    table = setup.source.reserve("v", 32)
    ok = dict(request_id="v", prompt_ids=list(range(20)), block_table=table, max_new_tokens=4, k=2)
    bad = [
        dict(prompt_ids=[]),
        dict(prompt_ids=[0, 512]),  # outside the vocabulary
        dict(prompt_ids=list(range(64))),  # no room under max_seq_len
        dict(k=5),
        dict(max_new_tokens=0),
        dict(reused_positions=2),  # not a whole block
        dict(reused_positions=20),  # reuse must leave the last position and the span (D=2)
        dict(block_table=table[:2] + table[:1]),
        dict(block_table=[10_000]),
    ]
    for override in bad:
        with pytest.raises(InvalidArgument):
            setup.engine.add_request(RequestSpec(**{**ok, **override}))
    setup.engine.add_request(RequestSpec(**{**ok, "reused_positions": 16}))
    with pytest.raises(AlreadyExists):
        setup.engine.add_request(RequestSpec(**ok))
    plain = make_setup("none")
    t2 = plain.source.reserve("p", 8)
    with pytest.raises(InvalidArgument):
        plain.engine.add_request(RequestSpec("p", [1, 2, 3], t2, k=1))
    with pytest.raises(InvalidArgument):
        EngineConfig(max_batch_tokens=4, max_draft_tokens=4)
    with pytest.raises(InvalidArgument):
        EngineConfig(trim_policy="sometimes")
    with pytest.raises(InvalidArgument, match="fused_graphs"):
        EngineConfig(fused_graphs="two")


def test_local_block_source_is_atomic_per_item():
    src = LocalBlockSource(4, BS)
    src.reserve("a", 4)
    src.reserve("b", 4, prefix_blocks=src.table("a"))
    out = src.extend({"a": 12, "b": 20, "zz": 4})
    assert len(out["a"]) == 3 and isinstance(out["b"], ResourceExhausted) and isinstance(out["zz"], NotFound)
    assert src.table("b") == src.table("a")[:1]  # the failed item changed nothing
    src.trim({"a": 1})
    src.release("a")
    assert src.refcount(src.table("b")[0]) == 1 and src.free_blocks == 3


def test_remap_published_blocks_after_dedup():
    """Two requests with the same prompt compute the same blocks; once the second one's first
    blocks are publishable they are swapped for the first request's copies (kvstore dedup). It
    then reads those, never writes them, and its output does not change."""
    prompt = prompts((14,), seed=12)[0]
    setup = make_setup("eagle3", chunk_size=4)
    submit(setup, "a", prompt, max_new_tokens=6, k=2)
    a = run_until_done(setup, keep=["a"])["a"]
    submit(setup, "b", prompt, max_new_tokens=12, k=2)
    eng = setup.engine
    early = []
    while eng.state("b").draft_len < 2 * BS:
        early += eng.step().results["b"].new_token_ids
    mine = eng.state("b").block_table
    theirs = a.block_table[:2] + mine[2:]
    with pytest.raises(FailedPrecondition):
        eng.remap_blocks("b", a.block_table[:3] + mine[3:])  # block 2 is not publishable yet
    eng.remap_blocks("b", theirs[:1])  # the kvstore's table may be shorter by now: prefix only
    assert eng.state("b").block_table == theirs[:1] + mine[1:]
    with pytest.raises(NotFound):
        eng.remap_blocks("zz", theirs)
    setup.source.remap("b", theirs)
    eng.remap_blocks("b", theirs)
    writes = []
    done = run_until_done(setup, on_step=lambda rep: writes.extend(rep.results["b"].blocks_written if "b" in rep.results else []))
    assert early + done["b"].tokens == plain_greedy(prompt, 12)
    assert done["b"].block_table[:2] == a.block_table[:2] and not set(a.block_table[:2]) & set(writes)


def test_a_request_without_capacity_ends_alone():
    """Two requests share a pool that cannot hold both to the end: the one that runs out
    finishes with CAPACITY; its neighbour's output is exactly plain greedy decoding."""
    small, big = prompts((6, 8), seed=13)
    setup = make_setup("eagle3", num_blocks=9, chunk_size=64)  # 36 positions in all
    submit(setup, "small", small, max_new_tokens=8, k=2)
    submit(setup, "big", big, max_new_tokens=60, k=2)
    done = run_until_done(setup)
    assert done["big"].finish_reason is FinishReason.CAPACITY
    assert done["small"].finish_reason is FinishReason.LENGTH
    assert done["small"].tokens == plain_greedy(small, 8)
    assert done["big"].tokens == plain_greedy(big, len(done["big"].tokens))


@pytest.mark.parametrize("watermark,chunk", [(1, 1), (2, 4), (0, 3)])
def test_ahead_of_need_extend_stays_within_watermark_plus_chunk(watermark, chunk):
    """Extending ahead of need, as the worker does between steps: no request ever holds more
    than watermark + chunk blocks past its next step's need, nor blocks it can never write (a
    later trim would take them back); and the step itself needs no extend once the ahead ones
    keep up (one block of rounding aside). Output stays plain greedy."""
    ps = prompts((7, 12, 3), seed=14)
    setup = make_setup("eagle3", chunk_size=64, max_batch_tokens=64)
    eng, src = setup.engine, setup.source
    for i, p in enumerate(ps):
        submit(setup, f"r{i}", p, max_new_tokens=40, k=3)
    step_extends = []
    done = {}

    def ahead(report) -> None:
        step_extends.append(len(report.extend_wants))
        wants = eng.capacity_wants(watermark, chunk)
        for rid, table in src.extend(wants).items():
            assert eng.adopt_table(rid, table)
        for rid in eng.request_ids():
            s = eng.state(rid)
            if s.in_prefill:
                continue
            # whole blocks: at most one block of rounding on top of watermark + chunk
            assert s.capacity - (s.logical_len + 3) < (watermark + chunk + 1) * BS, rid
            assert s.capacity <= blocks_for(s.num_prompt + 40 - 1, BS) * BS, rid

    done = run_until_done(setup, on_step=ahead)
    for i, p in enumerate(ps):
        assert done[f"r{i}"].tokens == plain_greedy(p, 40)
    if watermark >= 1:  # headroom was kept ahead: decode steps stopped asking for blocks
        assert sum(step_extends[3:]) == 0, step_extends


def test_an_unavailable_extend_makes_a_request_wait_not_fail():
    """The kvstore is away (its Extend answers UNAVAILABLE): a request that cannot go on in the
    capacity it holds waits its steps out instead of ending with CAPACITY, the others go on,
    and once Extends are answered again every output is token-identical."""
    from services.common.errors import Unavailable

    ps = prompts((9, 10), seed=11)
    setup = make_setup("eagle3", scripted={f"r{i}": p + plain_greedy(p, 24) for i, p in enumerate(ps)}, miss_percent=0)
    checked_plans(setup)
    source = setup.source
    real_extend, away = source.extend, {"steps": 6}

    def extend(wants):
        if away["steps"] > 0:
            away["steps"] -= 1
            return {rid: Unavailable("kvstore away") for rid in wants}
        return real_extend(wants)

    source.extend = extend
    submit(setup, "r0", ps[0], max_new_tokens=20, k=3)  # no headroom: it needs an Extend soon
    submit(setup, "r1", ps[1], max_new_tokens=20, k=3, headroom=40)  # holds all it needs
    seen_waiting = []
    done = run_until_done(setup, on_step=lambda rep: seen_waiting.append("r0" not in rep.results or
                                                                          not rep.results["r0"].new_token_ids))
    assert away["steps"] == 0 and any(seen_waiting)
    for i, p in enumerate(ps):
        assert done[f"r{i}"].finish_reason is FinishReason.LENGTH
        assert done[f"r{i}"].tokens == plain_greedy(p, 20)
