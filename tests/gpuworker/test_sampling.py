"""Sampling transform, seeded draws and greedy / forced acceptance."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgument
from services.gpuworker.engine.acceptance import accept_greedy, accept_sampled_batch
from services.gpuworker.engine.sampling import (
    SamplingParams,
    draw_uniforms,
    make_generator,
    probs_from_logits,
    sample_rows,
    sample_tokens,
)


def test_params_validation():
    for bad in (dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5),
                dict(top_k=-1), dict(seed=-3), dict(min_p=-0.1), dict(min_p=1.5), dict(presence_penalty=2.5),
                dict(frequency_penalty=-3.0), dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0)):
        with pytest.raises(InvalidArgument):
            SamplingParams(**bad)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


def test_top_k_and_top_p_filter_and_renormalise():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    pk = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.count_nonzero(pk) == 2 and pk[0, :2].gt(0).all()
    assert torch.allclose(pk.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)[0]
    # top_p just above the mass of the first two tokens keeps exactly three.
    pp = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=float(full[:2].sum()) + 1e-3))
    assert torch.count_nonzero(pp) == 3
    assert torch.allclose(pp[0, :3], full[:3] / full[:3].sum())
    # a tiny top_p still keeps the most likely token
    assert torch.count_nonzero(probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=1e-6))) == 1
    hot = probs_from_logits(logits, SamplingParams(temperature=0.1))
    cold = probs_from_logits(logits, SamplingParams(temperature=10.0))
    assert hot[0, 0] > 0.99 and cold[0, 0] < 0.3
    with pytest.raises(InvalidArgument):
        probs_from_logits(logits, SamplingParams())


def test_min_p_drops_tokens_below_its_share_of_the_top_one():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, min_p=0.3))  # threshold 0.15
    assert torch.allclose(p[0], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    assert torch.count_nonzero(probs_from_logits(logits, SamplingParams(temperature=1.0, min_p=1.0))) == 1
    assert torch.allclose(probs_from_logits(logits, SamplingParams(temperature=1.0, min_p=0.0)), torch.exp(logits))
    # min_p then top_p: the nucleus is taken over what min_p kept
    both = probs_from_logits(logits, SamplingParams(temperature=1.0, min_p=0.3, top_p=0.6))
    assert torch.count_nonzero(both) == 2


def test_sample_rows_never_picks_zero_probability_and_matches_frequencies():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    gen = torch.Generator().manual_seed(0)
    u = draw_uniforms(gen, 50_000)
    toks = sample_rows(probs.expand(50_000, -1), u)
    freq = torch.bincount(toks, minlength=6).double() / 50_000
    assert freq[[0, 2, 5]].sum() == 0
    assert torch.allclose(freq, probs.double(), atol=0.01)
    # edge uniforms: 0 and the largest float below 1 land on the first / last token with mass
    edge = sample_rows(probs.expand(2, -1), torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64))
    assert edge.tolist() == [1, 4]


def test_seeded_generators_are_reproducible_and_independent():
    params = SamplingParams(temperature=1.0, seed=42)
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    a = sample_tokens(logits, params, make_generator(params, "x"))
    b = sample_tokens(logits, params, make_generator(params, "y"))  # same seed wins over the id
    assert torch.equal(a, b)
    unseeded = SamplingParams(temperature=1.0)
    c = sample_tokens(logits, unseeded, make_generator(unseeded, "req-1"))
    d = sample_tokens(logits, unseeded, make_generator(unseeded, "req-1"))
    e = sample_tokens(logits, unseeded, make_generator(unseeded, "req-2"))
    assert torch.equal(c, d) and not torch.equal(c, e)


def test_greedy_sampling_is_argmax_and_leaves_generator_alone():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    assert sample_tokens(logits, SamplingParams(), gen).tolist() == [1, 0]  # ties → lowest id
    assert torch.equal(gen.get_state(), state)


def test_accept_greedy_prefix_bonus_and_forced():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 4]).tokens == (5, 6, 9)
    v = accept_greedy([5, 6, 7], [5, 6, 7, 4])
    assert (v.accepted, v.tokens) == (3, (5, 6, 7, 4))
    assert accept_greedy([], [8]).tokens == (8,)
    assert accept_greedy([1, 2], [3, 2, 2]).tokens == (3,)  # a later match does not count
    forced = accept_greedy([1, 2, 3], [9, 9, 9, 7], forced=2)
    assert (forced.accepted, forced.tokens) == (2, (1, 2, 9))
    with pytest.raises(InvalidArgument):
        accept_greedy([1], [1])
    with pytest.raises(InvalidArgument):
        accept_greedy([1], [1, 2], forced=2)


def test_sampled_acceptance_with_equal_distributions_accepts_everything():
    torch.manual_seed(0)
    b, k, vocab = 64, 4, 10
    p = torch.softmax(torch.randn(b, k + 1, vocab), -1)
    drafts = torch.randint(0, vocab, (b, k))
    u = torch.rand(b, k, dtype=torch.float64)
    accepted, token = accept_sampled_batch(drafts, p[:, :k], p, torch.full((b,), k), u, torch.rand(b, dtype=torch.float64))
    assert accepted.eq(k).all()
    # padding: rows with fewer real drafts stop there, and their token comes from p at that row
    nd = torch.arange(b) % (k + 1)
    p2 = p.clone()
    p2[torch.arange(b), nd] = torch.nn.functional.one_hot(torch.full((b,), 3), vocab).float()
    accepted, token = accept_sampled_batch(drafts, p[:, :k], p2, nd, u, torch.rand(b, dtype=torch.float64))
    assert torch.equal(accepted, nd) and token.eq(3).all()


def test_sampled_rejection_samples_from_residual():
    # q puts all mass on token 0, p none: the draft is always rejected and the token comes from
    # norm(max(0, p - q)) = p, never token 0.
    b = 2000
    p = torch.tensor([0.0, 0.25, 0.75]).expand(b, 2, 3)
    q = torch.tensor([1.0, 0.0, 0.0]).expand(b, 1, 3)
    accepted, token = accept_sampled_batch(
        torch.zeros(b, 1, dtype=torch.long), q, p, torch.ones(b, dtype=torch.long),
        torch.rand(b, 1, dtype=torch.float64), torch.rand(b, dtype=torch.float64))
    assert accepted.eq(0).all() and token.ne(0).all()
    assert abs(token.eq(2).double().mean().item() - 0.75) < 0.04
