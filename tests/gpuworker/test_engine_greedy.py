"""Speculative greedy decoding is token-identical to plain greedy decoding.

For EAGLE-3 and MTP (K = 2, and K = 3 so that k > K chains the last module), k ∈ {1, 2, 4},
one continuous batch of prompts of mixed lengths, chunked (chunk 3, smaller than a block of 4)
and unchunked prefill, plus a late request that reuses the first blocks an earlier request wrote.
Drafts are scripted (see test_engine_support) so that both accepted and rejected drafts occur; the
acceptance rate is asserted too, which only a correctly aligned engine reaches.
"""

from __future__ import annotations

import pytest
import torch

from services.gpuworker.attention.base import BatchLayout, get_backend
from services.gpuworker.engine.local import run_until_done, submit
from test_engine_support import make_setup, models, plain_greedy, prompts

MAX_NEW = 14
LENGTHS = (5, 13, 22)


@pytest.mark.parametrize("chunk", [3, 64])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("mode", ["eagle3", "mtp2", "mtp3"])
def test_speculative_greedy_equals_plain_greedy(mode, k, chunk):
    ps = prompts(LENGTHS)
    expected = {f"r{i}": p + plain_greedy(p, MAX_NEW) for i, p in enumerate(ps)}
    # the late request shares the first 8 tokens' blocks of r2 (+ the lookahead span) and differs after
    reuse_prompt = ps[2][:12] + prompts([6], seed=9)[0]
    expected["late"] = reuse_prompt + plain_greedy(reuse_prompt, MAX_NEW)
    setup = make_setup(mode, scripted=expected, chunk_size=chunk, max_batch_tokens=24)
    for i, p in enumerate(ps):
        submit(setup, f"r{i}", p, max_new_tokens=MAX_NEW, k=k)
    done = run_until_done(setup, keep=["r2"])
    reused = 8
    shared = done["r2"].block_table[: reused // 4]
    assert done["r2"].publishable_positions >= reused
    submit(setup, "late", reuse_prompt, max_new_tokens=MAX_NEW, k=k, prefix_blocks=shared, reused_positions=reused)
    writes = []
    done.update(run_until_done(setup, on_step=lambda rep: writes.extend(
        b for r in rep.results.values() for b in r.blocks_written)))
    assert not set(shared) & set(writes), "a reused block was written again"
    for rid, seq in expected.items():
        prompt_len = len(reuse_prompt) if rid == "late" else len(ps[int(rid[1])])
        assert done[rid].tokens == seq[prompt_len:], rid
    proposed = sum(c.proposed_drafts for c in done.values())
    accepted = sum(c.accepted_drafts for c in done.values())
    assert proposed > 0
    # scripted drafts are right ~75 % of the time: a misaligned engine would accept ~nothing
    assert accepted / proposed > (0.5 if k == 1 else 0.35), (accepted, proposed)
    assert accepted < proposed, "some drafts must be rejected for the test to mean anything"
    steps = sum(c.decode_steps for c in done.values())
    assert steps < len(expected) * MAX_NEW  # speculation saved target forwards


@pytest.mark.parametrize("mode", ["eagle3", "mtp2"])
def test_unscripted_random_draft_still_matches(mode):
    ps = prompts((7, 18), seed=3)
    setup = make_setup(mode, chunk_size=5, max_batch_tokens=16)
    for i, p in enumerate(ps):
        submit(setup, f"r{i}", p, max_new_tokens=10, k=3)
    done = run_until_done(setup)
    for i, p in enumerate(ps):
        assert done[f"r{i}"].tokens == plain_greedy(p, 10)


@torch.inference_mode()
def test_plain_engine_matches_full_recompute():
    """The baseline itself: the engine's plain greedy equals recomputing the whole sequence from
    scratch (fresh pool, one prefill) for every new token."""
    target, _ = models("none")
    prompt = prompts((9,), seed=5)[0]
    seq = list(prompt)
    for _ in range(6):
        backend = get_backend("torch", "cpu", target.attention_geometry(4))
        pool = target.new_kv_pool(8, 4)
        plan = backend.plan(BatchLayout([list(range(8))], [0], [len(seq)]))
        logits = target(torch.tensor(seq), plan, backend, pool).logits
        seq.append(int(torch.argmax(logits[-1])))
    assert plain_greedy(prompt, 6) == seq[len(prompt):]


@pytest.mark.parametrize("mode", ["none", "eagle3", "mtp3"])
def test_bucket_padded_batches_give_the_same_tokens(mode):
    """The layouts CUDA graphs replay (batches padded to buckets with scratch-page rows) run
    eagerly here and give exactly the tokens of unpadded batches; the padding rows write only
    the scratch page, never a block the block source handed out."""
    ps = prompts((5, 13, 22), seed=4)
    expected = {f"r{i}": plain_greedy(p, MAX_NEW) for i, p in enumerate(ps)}
    scripted = {f"r{i}": p + expected[f"r{i}"] for i, p in enumerate(ps)} if mode != "none" else None
    # phase by phase (a fused step verifies, fills and pads inside one forward: its own tests)
    setup = make_setup(mode, scripted=scripted, chunk_size=64, max_batch_tokens=64, graphs="pad", fused_spec=False)
    graphs = setup.engine.graphs
    assert graphs.buckets[:3] == (1, 2, 4) and graphs.scratch_block == setup.engine.num_blocks
    scratch_before = setup.engine.target_pool.layer(0)[graphs.scratch_block].clone()
    ran, original = [], graphs.run
    graphs.run = lambda name, layout, inputs: (ran.append((name, layout.arrays.uniform_q, inputs)), original(name, layout, inputs))[1]
    for i, p in enumerate(ps):
        submit(setup, f"r{i}", p, max_new_tokens=MAX_NEW, k=0 if mode == "none" else 3)
    done = run_until_done(setup)
    for rid, toks in expected.items():
        assert done[rid].tokens == toks, rid
    assert graphs.eager_runs > 0, "no batch went through the padded path"
    if mode == "eagle3":  # fills after verifies ran padded too, some with rows padded inside a request
        fills = [(q, inputs["last"].tolist()) for name, q, inputs in ran if name == "fill"]
        assert any(last[b] - b * q + 1 < q for q, last in fills for b in range(len(last))), fills
    # three requests pad to a bucket of 4: the scratch page was written by the padding row
    assert not torch.equal(setup.engine.target_pool.layer(0)[graphs.scratch_block], scratch_before)


@pytest.mark.parametrize("mode, fused", [("none", False), ("eagle3", False), ("eagle3", True)])
def test_prompt_chunks_beside_padded_decodes_give_the_same_tokens(mode, fused):
    """Requests that arrive while others decode (a served worker's usual step): the decode and
    verify rows run padded, as their graphs replay them (fused: the whole speculative step as
    one), and the prompt chunks as an eager forward beside them in the same step (EAGLE-3: the
    fill likewise); tokens equal plain greedy decoding."""
    ps = prompts((5, 13, 22, 9), seed=7)
    expected = {f"r{i}": plain_greedy(p, MAX_NEW) for i, p in enumerate(ps)}
    scripted = {f"r{i}": p + expected[f"r{i}"] for i, p in enumerate(ps)} if mode != "none" else None
    setup = make_setup(mode, scripted=scripted, chunk_size=8, max_batch_tokens=64, graphs="pad", fused_spec=fused)
    engine, k = setup.engine, 0 if mode == "none" else 3
    events: list[str] = []
    graph_run, eager, lanes = engine.graphs.run, engine._eager_target, engine.graphs.run_lanes
    engine.graphs.run = lambda name, layout, inputs: (events.append(name), graph_run(name, layout, inputs))[1]
    engine.graphs.run_lanes = lambda name, q, layouts, inputs: (events.append(name), lanes(name, q, layouts, inputs))[1]
    engine._eager_target = lambda *a: (events.append("eager target"), eager(*a))[1]
    steps = []

    def arrive(report) -> None:  # one new request every other step, while the others decode
        steps.append(list(events))
        events.clear()
        i = len(steps) // 2
        if len(steps) % 2 == 0 and i < len(ps):
            submit(setup, f"r{i}", ps[i], max_new_tokens=MAX_NEW, k=k)

    submit(setup, "r0", ps[0], max_new_tokens=MAX_NEW, k=k)
    done = run_until_done(setup, on_step=arrive)
    for rid, toks in expected.items():
        assert done[rid].tokens == toks, rid
    launched = (lambda s: any(e.startswith("spec") for e in s)) if fused else (lambda s: "target" in s)
    mixed = [s for s in steps if launched(s) and "eager target" in s]
    assert mixed, steps  # decodes replayed (padded) beside an eager prompt chunk in one step
    if mode == "eagle3" and not fused:
        assert any("fill" in s for s in mixed), mixed
    if fused:  # the fused step ran its decodes: no per-phase forward beside it but the prompt's
        assert all("target" not in s and "chain" not in s for s in mixed), mixed
