"""The routing policy as a pure function: reuse vs load, seeded ties, exclusions."""

from __future__ import annotations

import random

import pytest

from services.common.errors import InvalidArgument
from services.router.policy import (
    PolicyWeights,
    WorkerCandidate,
    missing_blocks,
    rank_workers,
    worker_cost,
)

W = PolicyWeights(alpha=1.0, beta=0.01, gamma=2.0)


def cand(worker_id, *, reusable=0, active=0, queued=0, model="m", block_size=16, healthy=True):
    return WorkerCandidate(worker_id, model, block_size, reusable, active, queued, healthy)


def order(cands, prompt_tokens=160, weights=W, seed=0, **kw):
    return [r.worker_id for r in rank_workers(cands, prompt_tokens=prompt_tokens, weights=weights,
                                              rng=random.Random(seed), **kw)]


def test_missing_blocks_rounds_the_prompt_up_to_blocks():
    assert missing_blocks(160, 16, 0) == 10
    assert missing_blocks(161, 16, 0) == 11
    assert missing_blocks(161, 16, 10) == 1
    assert missing_blocks(16, 16, 5) == 0  # never negative


def test_docstring_worked_example():
    cands = [cand("gpu0", reusable=8, active=300, queued=3), cand("gpu1", active=20), cand("gpu2", reusable=8, active=100, queued=2)]
    costs = {c.worker_id: worker_cost(c, 160, W) for c in cands}
    assert costs == pytest.approx({"gpu0": 11.0, "gpu1": 10.2, "gpu2": 7.0})
    assert order(cands) == ["gpu2", "gpu1", "gpu0"]


def test_reuse_beats_moderate_load():
    # 9 of 10 blocks cached on "warm" outweigh its two extra running requests (2·2 < 9).
    cands = [cand("warm", reusable=9, queued=2), cand("cold")]
    assert order(cands) == ["warm", "cold"]


def test_load_beats_small_reuse():
    # 2 reusable blocks do not pay for 3 requests ahead (1·2 < 2·3).
    cands = [cand("warm", reusable=2, queued=3), cand("cold")]
    assert order(cands) == ["cold", "warm"]


def test_weights_move_the_balance():
    cands = [cand("warm", reusable=9, queued=2), cand("cold")]
    assert order(cands, weights=PolicyWeights(alpha=1.0, beta=0.0, gamma=10.0)) == ["cold", "warm"]
    assert order(cands, weights=PolicyWeights(alpha=1.0, beta=0.0, gamma=0.0)) == ["warm", "cold"]


def test_active_blocks_count_with_beta():
    cands = [cand("busy", active=500), cand("idle", active=0)]
    assert order(cands) == ["idle", "busy"]
    # with beta = 0 they tie, and both orders occur
    no_beta = PolicyWeights(1.0, 0.0, 2.0)
    assert {tuple(order(cands, weights=no_beta, seed=s)) for s in range(20)} == {("idle", "busy"), ("busy", "idle")}


def test_ties_are_random_but_reproducible_with_a_seed():
    cands = [cand(f"w{i}") for i in range(6)]
    orders = {tuple(order(cands, seed=s)) for s in range(40)}
    assert len(orders) > 5, "ties must not always resolve the same way"
    for s in (0, 7, 123):
        assert order(cands, seed=s) == order(cands, seed=s)
    # the first choice spreads over every tied worker
    firsts = {order(cands, seed=s)[0] for s in range(200)}
    assert firsts == {c.worker_id for c in cands}


def test_ties_never_override_cost():
    cands = [cand("a"), cand("b"), cand("cheap", reusable=5)]
    for s in range(30):
        assert order(cands, seed=s)[0] == "cheap"


def test_incompatible_unhealthy_and_excluded_workers_are_left_out():
    cands = [
        cand("other-model", reusable=10, model="other"),
        cand("sick", reusable=10, healthy=False),
        cand("failed", reusable=10),
        cand("ok"),
    ]
    assert order(cands, model_id="m", exclude={"failed"}) == ["ok"]
    # without a model filter, other models are eligible
    assert "other-model" in order(cands, exclude={"failed"})


def test_block_size_is_per_worker():
    # 160 tokens: 10 blocks of 16 (0 cached) vs 5 blocks of 32 (0 cached)
    small, big = cand("small", block_size=16), cand("big", block_size=32)
    assert order([small, big]) == ["big", "small"]


def test_bad_inputs_are_invalid_argument():
    with pytest.raises(InvalidArgument):
        PolicyWeights(alpha=-1.0)
    with pytest.raises(InvalidArgument):
        PolicyWeights(beta=float("nan"))
    with pytest.raises(InvalidArgument):
        order([cand("a")], prompt_tokens=0)
    with pytest.raises(InvalidArgument):
        order([cand("a", reusable=-1)])


def test_no_candidates_gives_an_empty_order():
    assert order([]) == []


# --- round robin (the baseline policy) ------------------------------------------------------------

def rotation(cands, turn, prompt_tokens=160, **kw):
    from services.router.policy import rotate_workers

    return [r.worker_id for r in rotate_workers(cands, prompt_tokens=prompt_tokens, turn=turn, **kw)]


def test_round_robin_rotates_and_ignores_reuse_and_load():
    # c is by far the cheapest for kv_aware; round robin does not care.
    cands = [cand("c", reusable=10), cand("a", active=900, queued=9), cand("b")]
    assert order(cands)[0] == "c"
    assert rotation(cands, 0) == ["a", "b", "c"]
    assert rotation(cands, 1) == ["b", "c", "a"]
    assert rotation(cands, 2) == ["c", "a", "b"]
    assert rotation(cands, 3) == rotation(cands, 0)  # wraps around
    # consecutive turns put the first choice on every worker equally often
    firsts = [rotation(cands, t)[0] for t in range(30)]
    assert {w: firsts.count(w) for w in "abc"} == {"a": 10, "b": 10, "c": 10}


def test_round_robin_leaves_out_the_same_workers_and_still_offers_fall_through():
    cands = [cand("x", model="other"), cand("sick", healthy=False), cand("gone"), cand("p"), cand("q")]
    for turn in range(4):
        got = rotation(cands, turn, model_id="m", exclude={"gone"})
        assert sorted(got) == ["p", "q"]  # every eligible worker is offered (RESOURCE_EXHAUSTED falls through)
    assert rotation([], 5) == []


def test_round_robin_bad_inputs_are_invalid_argument():
    with pytest.raises(InvalidArgument):
        rotation([cand("a")], -1)
    with pytest.raises(InvalidArgument):
        rotation([cand("a")], 0, prompt_tokens=0)
    with pytest.raises(InvalidArgument):
        rotation([cand("a", queued=-1)], 0)


def test_policy_setting_reaches_the_dispatcher():
    from pydantic import ValidationError

    from services.router.server import dispatch_config
    from services.router.settings import RouterSettings

    assert dispatch_config(RouterSettings()).policy == "kv_aware"
    assert dispatch_config(RouterSettings(policy="round_robin")).policy == "round_robin"
    with pytest.raises(ValidationError):
        RouterSettings(policy="random")


def test_round_robin_router_alternates_where_kv_aware_sticks_to_the_warm_worker(rig):
    from router_rig import collect

    rig.worker("a")
    rig.worker("b")
    prompt = "shared system prompt, long enough for several blocks of sixteen bytes each. " * 2

    def workers(router, n, tag):
        got = []
        for i in range(n):
            msgs, err = collect(router, text=prompt, max_new_tokens=2, request_id=f"{tag}{i}")
            assert err is None, err
            got.append((msgs[-1].usage.worker_id, msgs[-1].usage.cached_tokens))
        return got

    rr = workers(rig.router(policy="round_robin"), 4, "rr")
    assert [w for w, _ in rr] == ["a", "b", "a", "b"]
    kv = workers(rig.router(), 4, "kv")  # both workers hold the prefix now: any is fine, but it stays
    assert all(cached > 0 for _, cached in kv)
    # a full worker is skipped on its turn (fall-through on RESOURCE_EXHAUSTED)
    full = rig.occupy("a", 64)
    assert [w for w, _ in workers(rig.router(policy="round_robin"), 2, "full")] == ["b", "b"]
    rig.free(full)
    rig.wait_no_live_reservations()
