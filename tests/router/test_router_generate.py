"""Router.Generate through a real kvstore and scripted workers: the happy path and reuse."""

from __future__ import annotations

import threading
import time

import grpc

from router_rig import Script, collect
from services.common.tokenizer import ByteTokenizer
from services.common.wire import tokens_from_proto
from router_rig import SALT_SECRET
from services.router.tenants import tenant_salt
from tandem.common.v1 import common_pb2

TOK = ByteTokenizer()


def test_streams_text_ids_and_usage(rig):
    worker = rig.worker("w0")
    router = rig.router()
    msgs, err = collect(router, text="Hello, router!", max_new_tokens=40)
    assert err is None
    final = msgs[-1]
    assert final.HasField("usage") and not any(m.HasField("usage") for m in msgs[:-1])
    ids = [t for m in msgs for t in m.token_ids]
    assert ids == [worker.script.token(i) for i in range(40)]
    # text deltas never split a multi-byte character and add up to the decoded ids
    assert "".join(m.text for m in msgs) == worker.script.expected_text(40)
    assert all("\ufffd" not in m.text for m in msgs)
    u = final.usage
    prompt = TOK.encode("Hello, router!")
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (len(prompt), 40, 0)
    assert u.worker_id == "w0" and final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert u.mean_acceptance_length == 1.0
    assert 0 < u.time_to_first_token_s < 5

    (req,) = worker.requests
    assert tokens_from_proto(req.prompt).tolist() == prompt
    scope, _, rid = req.request_id.partition("/")
    assert len(scope) == 12 and len(rid) == 32  # tenant scope / generated uuid4 hex
    assert req.sampling.max_new_tokens == 40 and req.sampling.top_p == 1.0
    assert TOK.eos_token_id in req.sampling.stop_token_ids
    assert req.spec.num_draft_tokens == 3  # a worker advertising no default k (an older one) gets 3
    # the reservation covers the prompt plus the first step's draft + bonus tokens
    assert len(worker.reservations[0].block_table) * 16 >= len(prompt) + 4  # as the worker read it from the kvstore
    assert worker.ended == {req.request_id: "released"}
    rig.wait_no_live_reservations()


def test_request_fields_reach_the_worker(rig):
    worker = rig.worker("w0")
    router = rig.router()
    ids = common_pb2.TokenIds(list=common_pb2.Uint32List(values=[256, 1, 2, 3]))
    msgs, err = collect(router, token_ids=ids, max_new_tokens=3, temperature=0.5, top_p=0.9, top_k=7, seed=11,
                        num_draft_tokens=0, stop_token_ids=[9], request_id="my-request", min_p=0.25)
    assert err is None, err
    (req,) = worker.requests
    assert req.request_id.endswith("/my-request")  # scoped by the tenant
    assert tokens_from_proto(req.prompt).tolist() == [256, 1, 2, 3]
    s = req.sampling
    assert (round(s.temperature, 3), round(s.top_p, 3), s.top_k, s.seed) == (0.5, 0.9, 7, 11)
    assert list(s.stop_token_ids) == [9, TOK.eos_token_id]
    assert s.min_p == 0.25
    assert req.spec.num_draft_tokens == 0
    assert msgs[-1].usage.prompt_tokens == 4


def test_seed_zero_is_a_seed_and_unset_fields_get_their_defaults(rig):
    """optional fields: seed 0 reaches the worker as a seed; unset seed stays unset (unseeded);
    unset temperature is greedy on gRPC and unset top_p is 1."""
    worker = rig.worker("w0")
    router = rig.router()
    for fields in ({"seed": 0, "temperature": 0.7}, {}):
        msgs, err = collect(router, text="seed?", max_new_tokens=2, **fields)
        assert err is None, err
    seeded, unset = (r.sampling for r in worker.requests)
    assert seeded.HasField("seed") and seeded.seed == 0 and round(seeded.temperature, 3) == 0.7
    assert not unset.HasField("seed")
    assert (unset.temperature, unset.top_p) == (0.0, 1.0)


def test_second_request_reuses_the_prefix_within_a_tenant_only(rig):
    rig.worker("w0")
    router = rig.router(tenants="tokA=alice,tokB=bob")
    prompt = "A long shared system prompt that spans several blocks of sixteen tokens each. " * 2
    alice = [("authorization", "Bearer tokA")]
    bob = [("authorization", "Bearer tokB")]

    first, err = collect(router, text=prompt, max_new_tokens=4, metadata=alice)
    assert err is None and first[-1].usage.cached_tokens == 0
    again, err = collect(router, text=prompt, max_new_tokens=4, metadata=alice)
    assert err is None
    n = len(TOK.encode(prompt))
    cached = again[-1].usage.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached <= n - 1
    # another tenant's namespace holds nothing of alice's
    other, err = collect(router, text=prompt, max_new_tokens=4, metadata=bob)
    assert err is None and other[-1].usage.cached_tokens == 0
    rig.wait_no_live_reservations()


def test_the_salt_comes_from_the_tenant(rig):
    """Match with alice's salt finds what the router published for alice; a request body cannot
    pick a namespace (there is no such field), and bob's salt finds nothing."""
    from services.common.wire import tokens_to_proto
    from tandem.kvstore.v1 import kvstore_pb2 as kv_pb

    rig.worker("w0")
    router = rig.router(tenants="tokA=alice,tokB=bob")
    prompt = "x" * 80
    _, err = collect(router, text=prompt, max_new_tokens=2, metadata=[("authorization", "Bearer tokA")])
    assert err is None
    tokens = tokens_to_proto(TOK.encode(prompt))

    def reusable(salt):
        resp = rig.kv.stub.Match(kv_pb.MatchRequest(tokens=tokens, cache_salt=salt), timeout=5)
        return resp.workers[0].reusable_positions

    assert reusable(tenant_salt("alice", SALT_SECRET)) == 80  # 81 tokens: 5 full blocks
    assert reusable(tenant_salt("bob", SALT_SECRET)) == 0
    assert reusable(b"") == 0


def test_duplicate_live_request_id_is_rejected(rig):
    rig.worker("w0", Script(delay_s=0.02))
    router = rig.router()
    results = {}

    def run_first():
        results["first"] = collect(router, text="hello", max_new_tokens=20, request_id="dup")

    t = threading.Thread(target=run_first)
    t.start()
    try:
        end = time.monotonic() + 5
        while rig.live() == 0 and time.monotonic() < end:
            time.sleep(0.01)
        _, err = collect(router, text="hello", max_new_tokens=2, request_id="dup")
        assert err is not None and err.code() == grpc.StatusCode.ALREADY_EXISTS
    finally:
        t.join(10)
    assert results["first"][1] is None
    rig.wait_no_live_reservations()


# ------------------------------------------------------------------ the default k is the worker's
def test_without_a_router_setting_a_request_runs_with_the_workers_default_k(rig):
    """The worker knows which k its model, draft and device run best at (Info.num_draft_tokens):
    a request that names none runs with it, and the reservation covers that k's first step
    (a 10-token prompt + 6 drafts + 1 bonus = 17 positions: two blocks of 16, where the old
    fixed headroom would have reserved one)."""
    worker = rig.worker("w0", Script(num_draft_tokens=6, max_draft_tokens=8))
    router = rig.router()
    msgs, err = collect(router, text="ten bytes!", max_new_tokens=3)
    assert err is None, err
    assert worker.requests[-1].spec.num_draft_tokens == 6
    assert len(worker.reservations[-1].block_table) * 16 >= 10 + 6 + 1
    # a request's own k wins, whatever the worker's default
    for k in (0, 2, 8):
        _, err = collect(router, text="ten bytes!", max_new_tokens=3, num_draft_tokens=k)
        assert err is None, err
        assert worker.requests[-1].spec.num_draft_tokens == k
    rig.wait_no_live_reservations()


def test_an_explicit_router_setting_wins_over_the_workers_default(rig):
    worker = rig.worker("w0", Script(num_draft_tokens=2, max_draft_tokens=8))
    router = rig.router(num_draft_tokens=5)
    _, err = collect(router, text="router says five", max_new_tokens=3)
    assert err is None, err
    assert worker.requests[-1].spec.num_draft_tokens == 5
    _, err = collect(router, text="request says one", max_new_tokens=3, num_draft_tokens=1)
    assert err is None, err
    assert worker.requests[-1].spec.num_draft_tokens == 1  # and the request's own over both
    rig.wait_no_live_reservations()


def test_each_worker_gets_its_own_default_and_headroom_covers_it(rig):
    """Workers of one router advertise different defaults (a no-draft worker 0): each request
    runs with the default of the worker that took it, inside a reservation that covers it."""
    workers = {"small": rig.worker("small", Script(num_draft_tokens=1)),
               "large": rig.worker("large", Script(num_draft_tokens=7)),
               "plain": rig.worker("plain", Script(num_draft_tokens=0, max_draft_tokens=0))}
    router = rig.router(policy="round_robin")
    prompt = "fifteen bytes.."
    for i in range(6):
        _, err = collect(router, text=prompt, max_new_tokens=2, request_id=f"r{i}")
        assert err is None, err
    want = {"small": 1, "large": 7, "plain": 0}
    for name, worker in workers.items():
        assert worker.requests, f"round robin never chose {name}"
        for req, reservation in zip(worker.requests, worker.reservations):
            assert req.spec.num_draft_tokens == want[name]
            assert len(reservation.block_table) * 16 >= len(prompt) + want[name] + 1
    rig.wait_no_live_reservations()


def test_a_workers_default_above_a_request_limit_is_capped_by_its_own_maximum(rig):
    """A router's explicit setting above what a worker accepts runs at the worker's maximum
    (the cap that requests already had), not refused."""
    worker = rig.worker("w0", Script(num_draft_tokens=2, max_draft_tokens=4))
    router = rig.router(num_draft_tokens=10, max_draft_tokens=16)
    _, err = collect(router, text="capped", max_new_tokens=3)
    assert err is None, err
    assert worker.requests[-1].spec.num_draft_tokens == 4
    rig.wait_no_live_reservations()


def test_router_draft_settings_are_validated():
    import pytest
    from pydantic import ValidationError

    from services.router.settings import RouterSettings

    assert RouterSettings().num_draft_tokens is None  # unset: the worker's default
    assert RouterSettings(num_draft_tokens=0).num_draft_tokens == 0
    for bad in ({"num_draft_tokens": -1}, {"num_draft_tokens": 17}, {"num_draft_tokens": 5, "max_draft_tokens": 4}):
        with pytest.raises(ValidationError):
            RouterSettings(**bad)
