"""The published-KV invariant (DESIGN §1): every block the engine reports publishable holds the
target and draft KV that a from-scratch, unchunked prefill of the same tokens writes
(allclose 1e-5) — whatever chunking, prefix reuse or speculation produced it — and is never
written again afterwards.

Chunk sizes 1 … block_size + 3, reuse depths 0, 1 and 2 blocks, EAGLE-3 and MTP (K = 2);
scripted drafts so that accepted drafts' KV gets published too, and one sampled run.
"""

from __future__ import annotations

import pytest
import torch

from services.gpuworker.engine.local import run_until_done, submit
from services.gpuworker.engine.sampling import SamplingParams
from test_engine_support import MODES, make_setup, plain_greedy, prompts, reference_kv

BS = 4


class PublishWatcher:
    """Follows step reports: publishable prefixes only grow, stay within L - D, are never written
    again; remembers each publishable block's content when first reported."""

    def __init__(self, setup, span: int):
        self.setup, self.span = setup, span
        self.snap: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.published: dict[str, set[int]] = {}
        self.last: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}

    def __call__(self, report) -> None:
        eng = self.setup.engine
        for rid, r in report.results.items():
            assert r.publishable_positions >= self.last.get(rid, 0), "publishable prefix shrank"
            assert r.publishable_positions <= r.logical_len - self.span
            assert r.publishable_positions <= r.target_len
            pub = self.published.setdefault(rid, set())
            assert not pub & set(r.blocks_written), f"{rid}: a publishable block was written again"
            self.last[rid] = r.publishable_positions
            self.tables[rid] = r.block_table
            for i, b in enumerate(r.publishable_blocks):
                if b not in pub:
                    pub.add(b)
                    self.snap[(rid, i)] = (eng.target_pool.data[:, b].clone(), eng.drafter.pool.data[:, b].clone())

    def check(self, rid: str, tokens: list[int], mode: str) -> int:
        """Compare every block ``rid`` published with the reference; returns how many."""
        eng = self.setup.engine
        ref_t, ref_d, final = reference_kv(mode, tokens, BS)
        n = 0
        for (owner, i), (t_snap, d_snap) in self.snap.items():
            if owner != rid:
                continue
            b = self.tables[rid][i]
            assert (i + 1) * BS <= final
            # unchanged since first reported, and equal to the from-scratch prefill
            assert torch.equal(eng.target_pool.data[:, b], t_snap) and torch.equal(eng.drafter.pool.data[:, b], d_snap)
            torch.testing.assert_close(t_snap, ref_t.data[:, i], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(d_snap, ref_d.data[:, i], atol=1e-5, rtol=1e-5, msg=lambda m: f"{rid} block {i}: {m}")
            n += 1
        return n


@pytest.mark.parametrize("chunk, graphs", [(c, "off") for c in range(1, BS + 4)] + [(2, "pad"), (5, "pad")])
@pytest.mark.parametrize("mode", ["eagle3", "mtp2"])
def test_published_blocks_equal_unchunked_prefill(mode, chunk, graphs):
    """``graphs="pad"``: decode, verify, chain and (EAGLE-3) the fill after a verify run padded
    to buckets and query lengths, as CUDA graphs replay them; padding rows write speculative
    positions only, so what is published is still exactly the unchunked prefill's KV."""
    span = MODES[mode][1] if mode.startswith("mtp") else 1
    first = prompts((15,), seed=chunk)[0]
    tails = prompts((5, 3, 6), seed=100 + chunk)
    later = {f"reuse{r}": first[: r + span + 1] + tails[j] for j, r in enumerate((0, BS, 2 * BS))}
    expected = {"first": first + plain_greedy(first, 9)}
    expected.update({rid: p + plain_greedy(p, 9) for rid, p in later.items()})
    setup = make_setup(mode, scripted=expected, chunk_size=chunk, max_batch_tokens=max(chunk, 8), max_draft_tokens=4,
                       graphs=graphs)
    watch = PublishWatcher(setup, span)
    submit(setup, "first", first, max_new_tokens=9, k=3)
    done = run_until_done(setup, keep=["first"], on_step=watch)
    for rid, p in later.items():
        r = int(rid[5:])
        assert done["first"].publishable_positions >= r
        # k = 0 too: a request that does not speculate must still leave final draft KV behind
        submit(setup, rid, p, max_new_tokens=9, k=0 if r == 0 else 2,
               prefix_blocks=done["first"].block_table[: r // BS], reused_positions=r)
    done.update(run_until_done(setup, keep=list(later), on_step=watch))
    assert sum(c.accepted_drafts for c in done.values()) > 0
    for rid, c in done.items():
        prompt = first if rid == "first" else later[rid]
        assert c.tokens == expected[rid][len(prompt):]
        # everything final at the end is publishable (L - D positions), and every full block of
        # it was checked
        assert c.publishable_positions == len(prompt) + len(c.tokens) - span
        assert watch.check(rid, prompt + c.tokens, mode) == c.publishable_positions // BS
    if graphs == "pad":  # the padded paths ran: what was checked above is what graphs publish
        ran = setup.engine.graphs.eager_runs
        assert ran > 0, "no forward went through the padded layouts"


@pytest.mark.parametrize("mode", ["eagle3", "mtp2"])
def test_published_blocks_with_sampling(mode):
    span = MODES[mode][1] if mode.startswith("mtp") else 1
    setup = make_setup(mode, chunk_size=3, max_batch_tokens=12, max_draft_tokens=4)
    watch = PublishWatcher(setup, span)
    ps = prompts((11, 6), seed=42)
    for i, p in enumerate(ps):
        submit(setup, f"s{i}", p, max_new_tokens=12, k=3, sampling=SamplingParams(temperature=0.8, seed=i))
    done = run_until_done(setup, keep=["s0", "s1"], on_step=watch)
    for i, p in enumerate(ps):
        c = done[f"s{i}"]
        assert watch.check(f"s{i}", p + c.tokens, mode) == c.publishable_positions // BS >= 3


def test_plain_decoding_fills_the_draft_once_per_block():
    """k = 0 needs draft KV only to publish whole blocks: the fill waits for a block boundary
    (or the end) instead of running a draft forward per token, and what it publishes is still
    the reference KV (checked by ``watch``)."""
    setup = make_setup("eagle3", chunk_size=64, max_batch_tokens=64)
    watch = PublishWatcher(setup, 1)
    fills = []
    drafter = setup.engine.drafter
    real = drafter._fill_eagle
    drafter._fill_eagle = lambda run: (fills.append(len(run)), real(run))[1]
    prompt = prompts((6,), seed=7)[0]
    submit(setup, "plain", prompt, max_new_tokens=21, k=0)
    done = run_until_done(setup, keep=["plain"], on_step=watch)
    c = done["plain"]
    assert len(c.tokens) == 21
    assert c.publishable_positions == len(prompt) + 21 - 1
    # prefill once, then one fill per block crossed (plus the final one), not 20 per-token fills
    assert len(fills) <= 1 + -(-21 // BS) + 1, fills
    assert watch.check("plain", prompt + c.tokens, "eagle3") == c.publishable_positions // BS


def assert_published_and_decoded_as_alone(done, ps, watch: PublishWatcher, mode: str, new: int) -> None:
    """Requests ``p0, p1, ...`` (prompts ``ps``) each generated ``new`` tokens, published every
    position the draft span allows with the reference KV, and decoded the tokens they decode
    alone (k = 0, a fresh engine)."""
    for i, p in enumerate(ps):
        c = done[f"p{i}"]
        assert len(c.tokens) == new and c.publishable_positions == len(p) + new - watch.span
        assert watch.check(f"p{i}", p + c.tokens, mode) == c.publishable_positions // BS
        alone = make_setup(mode, chunk_size=64, max_batch_tokens=64)
        submit(alone, "a", p, max_new_tokens=new, k=0)
        assert run_until_done(alone)["a"].tokens == c.tokens


@pytest.mark.parametrize("mode, graphs", [("eagle3", "off"), ("mtp2", "off"), ("eagle3", "pad"), ("mtp2", "pad")])
def test_staggered_plain_decoding_requests_fill_in_rounds(mode, graphs):
    """Plain-decoding requests whose prompts end at different offsets in a block cross their
    block boundaries in different steps. Their fills wait for the engine's fill round (every
    block_size steps) and run together, instead of one eager draft forward nearly every step;
    what they publish is still the reference KV, and their tokens are the ones they decode alone.
    ``graphs="pad"``: the decode rows kept for a later fill come from a graph's outputs, which
    the next step's replay rewrites (the padded CPU path rewrites them likewise)."""
    lengths = (5, 6, 7, 8)  # offsets 1, 2, 3, 0 in a block of 4: a boundary crossed every step
    new = 24
    span = MODES[mode][1] if mode.startswith("mtp") else 1
    setup = make_setup(mode, chunk_size=64, max_batch_tokens=64, graphs=graphs)
    watch = PublishWatcher(setup, span)
    fills, steps = [], []
    drafter = setup.engine.drafter
    name = "_fill_eagle" if mode == "eagle3" else "_fill_mtp"
    real = getattr(drafter, name)
    setattr(drafter, name, lambda run: (fills.append(len(steps)), real(run))[1])
    ps = prompts(lengths, seed=11)
    for i, p in enumerate(ps):
        submit(setup, f"p{i}", p, max_new_tokens=new, k=0)
    done = run_until_done(setup, keep=[f"p{i}" for i in range(len(ps))], on_step=lambda r: (steps.append(r), watch(r)))
    # the prompts' fills (up to one each), one per round, the final one: not one per step (24
    # with a fill at every boundary crossed)
    assert len(fills) <= len(ps) + -(-len(steps) // BS) + 1, (fills, len(steps))
    assert_published_and_decoded_as_alone(done, ps, watch, mode, new)


@pytest.mark.parametrize("overlap", [False, True])
def test_plain_decoding_rows_do_not_keep_a_mixed_batch_out_of_fused_steps(overlap):
    """A greedy batch of k = 0 and k > 0 requests runs as fused speculative steps (EAGLE-3) only while no
    row has draft rows pending (``_fusable``): a k = 0 newcomer fills its prompt at once, and a
    fill round fills every pending row, so the batch fuses from its first decodes on (a round
    that waited for one crossed boundary per request kept it unfused for a third of its steps).
    Published KV and tokens as elsewhere."""
    ks, new = (0, 0, 0, 0, 2, 3), 24
    setup = make_setup("eagle3", chunk_size=64, max_batch_tokens=64, graphs="pad", overlap=overlap, max_draft_tokens=4)
    watch = PublishWatcher(setup, 1)
    ps = prompts((5, 6, 7, 8, 9, 10), seed=5)
    for i, (p, k) in enumerate(zip(ps, ks)):
        submit(setup, f"p{i}", p, max_new_tokens=new, k=k)
    steps = []
    done = run_until_done(setup, keep=[f"p{i}" for i in range(len(ps))], on_step=lambda r: (steps.append(r), watch(r)))
    # every step but the prefill and the last few (requests ending) is fused
    assert setup.engine.fused_steps >= len(steps) - 4, (setup.engine.fused_steps, len(steps))
    assert_published_and_decoded_as_alone(done, ps, watch, "eagle3", new)
