"""Issue 8 ("a trust boundary inside the suite"): one regression test per row of its table,
against the real suite on loopback with mTLS on every hop (see ``trust_rig``). Each attack that
used to succeed now fails with the documented status code and changes nothing."""

from __future__ import annotations

import re
import threading
import time

import grpc
import pytest

from services.common.wire import tokens_to_proto
from tandem.common.v1 import common_pb2
from tandem.kvstore.v1 import kvstore_pb2 as kv_pb
from tandem.router.v1 import router_pb2
from tandem.worker.v1 import worker_pb2 as w_pb
from trust_rig import TIMEOUT, TrustRig, code_of, make_pki

DENIED = grpc.StatusCode.PERMISSION_DENIED
PROMPT = "Tandem keeps every tenant's KV cache to itself. " * 2


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def rig(pki, start_service):
    rig = TrustRig(pki, start_service)
    rig.start_kvstore()
    rig.start_worker("w0")
    rig.start_router(tenants="tokA=alice,tokB=bob")
    yield rig
    rig.close()


def _register(worker_id: str, **fields) -> kv_pb.RegisterWorkerRequest:
    base = dict(worker_id=worker_id, address="127.0.0.1:1", model_id="m", spec_mode=common_pb2.SPEC_MODE_NONE,
                block_size=16, num_blocks=64, vocab_size=300, max_seq_len=1024)
    return kv_pb.RegisterWorkerRequest(**{**base, **fields})


def _reserve(rig: TrustRig, request_id: str, tokens: list[int], headroom: int = 8) -> kv_pb.Reservation:
    return rig.kv_as("router").Reserve(kv_pb.ReserveRequest(
        worker_id="w0", incarnation=rig.incarnation(), request_id=request_id, tokens=tokens_to_proto(tokens),
        headroom_positions=headroom), timeout=TIMEOUT).reservation


def _snapshot(rig: TrustRig):
    stats = rig.stats()
    workers = rig.kv_as("router").ListWorkers(kv_pb.ListWorkersRequest(), timeout=TIMEOUT).workers
    return ([(w.worker_id, w.incarnation, w.address) for w in workers],
            [(w.worker_id, w.pool.free, w.pool.cached, w.pool.in_use, w.published_blocks) for w in stats.workers],
            stats.live_reservations, stats.ending_reservations, stats.trie_nodes)


def test_row7_mtls_end_to_end_plaintext_and_foreign_certificates_refused(rig):
    ids, usage = rig.generate(PROMPT, token="tokA", max_new_tokens=8)
    assert len(ids) == 8
    _, again = rig.generate(PROMPT, token="tokA", max_new_tokens=8)
    assert again.cached_tokens > 0  # the router -> kvstore -> worker path works over mTLS, reuse included
    for stub_call in (
        lambda name: rig.kv_as(name).Stats(kv_pb.StatsRequest(), timeout=5),
        lambda name: rig.worker_as(name).Info(w_pb.InfoRequest(), timeout=5),
    ):
        assert code_of(stub_call, None) == grpc.StatusCode.UNAVAILABLE  # no TLS: no handshake
        assert code_of(stub_call, "foreign") == grpc.StatusCode.UNAVAILABLE  # another CA's certificate
    assert rig.invariants().ok


def test_row1_only_a_worker_registers_and_only_under_its_own_id(rig):
    before = _snapshot(rig)
    kv_evil, kv_router, kv_client = rig.kv_as("evil"), rig.kv_as("router"), rig.kv_as("alice")
    assert code_of(kv_evil.RegisterWorker, _register("w0"), timeout=5) == DENIED  # someone else's id
    assert code_of(kv_router.RegisterWorker, _register("w0"), timeout=5) == DENIED  # not a worker
    assert code_of(kv_client.RegisterWorker, _register("alice"), timeout=5) == DENIED
    assert code_of(kv_evil.Heartbeat, kv_pb.HeartbeatRequest(worker_id="w0", incarnation=rig.incarnation()), timeout=5) == DENIED
    assert _snapshot(rig) == before, "a denied call changed the kvstore"
    # requests keep going to the real worker, whose cache is intact
    _, usage = rig.generate(PROMPT, token="tokA", max_new_tokens=4)
    assert usage.worker_id == "w0"


def _generate_on_worker(rig: TrustRig, request_id: str, prompt: list[int], reservation: kv_pb.Reservation,
                       max_new_tokens: int = 4):
    request = w_pb.GenerateRequest(
        request_id=request_id, prompt=tokens_to_proto(prompt), sampling=w_pb.SamplingParams(max_new_tokens=max_new_tokens),
        reservation=w_pb.ReservationRef(reservation_id=reservation.reservation_id, incarnation=reservation.incarnation))
    return list(rig.worker_as("router").Generate(request, timeout=TIMEOUT))


def test_row2_generate_takes_blocks_and_prefix_from_the_kvstore(rig):
    victim = list(PROMPT.encode()) + [1]
    seed = _reserve(rig, "seed", victim)
    _generate_on_worker(rig, "seed", victim, seed)  # publishes the prompt's blocks
    assert rig.wait_settled().live_reservations == 0
    r = _reserve(rig, "victim", victim)
    assert r.reused_positions > 0
    forged = [7] * len(victim)
    with pytest.raises(grpc.RpcError) as err:  # not the prompt the reservation was made for
        _generate_on_worker(rig, "forged", forged, r)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # the reservation names the blocks; another worker (or a router) may not even read it
    get = kv_pb.GetReservationRequest(reservation_id=r.reservation_id, incarnation=r.incarnation)
    assert code_of(rig.kv_as("evil").GetReservation, get, timeout=5) == DENIED
    assert code_of(rig.kv_as("router").GetReservation, get, timeout=5) == DENIED
    # the genuine request runs on what the kvstore says, and ends the reservation
    last = _generate_on_worker(rig, "honest", victim, r)[-1]
    assert last.usage.cached_tokens == r.reused_positions
    assert rig.wait_settled().live_reservations == 0 and rig.invariants().ok


def test_row3_only_the_owning_worker_publishes(rig):
    tokens = list(range(40, 120))
    r = _reserve(rig, "claimer", tokens)
    before = _snapshot(rig)
    release = kv_pb.ReleaseRequest(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=len(tokens))
    publish = kv_pb.PublishRequest(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=len(tokens))
    assert code_of(rig.kv_as("router").Release, release, timeout=5) == DENIED  # routers never publish
    assert code_of(rig.kv_as("evil").Publish, publish, timeout=5) == DENIED  # another worker's reservation
    assert code_of(rig.kv_as("evil").Release, release, timeout=5) == DENIED
    assert code_of(rig.kv_as("alice").Publish, publish, timeout=5) == DENIED
    assert _snapshot(rig) == before
    rig.kv_as("router").Abort(kv_pb.AbortRequest(reservation_id=r.reservation_id, incarnation=r.incarnation), timeout=5)
    assert rig.wait_settled().ending_reservations == 0  # the worker confirmed via its heartbeat
    assert rig.stats().trie_nodes == before[4] and rig.invariants().ok


def test_row4_an_outside_abort_frees_nothing_until_the_worker_confirms(rig):
    call = rig.router.stub.Generate(router_pb2.GenerateRequest(temperature=0.0, text=PROMPT, max_new_tokens=4000),
                                    timeout=TIMEOUT, metadata=[("authorization", "Bearer tokA")])
    assert next(call).token_ids  # it is running
    [live] = rig.kv.in_loop(lambda: rig.kv.payload.view().reservations())
    in_use = rig.stats().workers[0].pool.in_use
    assert rig.kv_as("router").Abort(kv_pb.AbortRequest(reservation_id=live.reservation_id, incarnation=live.incarnation),
                                     timeout=5).aborted
    stats = rig.stats()
    # ended, but the worker may still be writing its blocks: none went back to the free queue
    assert stats.live_reservations == 0 and stats.ending_reservations == 1
    assert stats.workers[0].pool.in_use >= in_use
    with pytest.raises(grpc.RpcError) as err:  # the worker stops the request (heartbeat), then confirms
        for _ in call:
            pass
    # stopped by its heartbeat (CANCELLED) or by the kvstore refusing its next Extend (the router
    # then reports the failure after streamed tokens as UNAVAILABLE); either way it says why
    assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert "ended by the router" in err.value.details()
    stats = rig.wait_settled()
    assert (stats.live_reservations, stats.ending_reservations, stats.workers[0].pool.in_use) == (0, 0, 0)
    assert rig.invariants().ok
    _, usage = rig.generate(PROMPT, token="tokA", max_new_tokens=4)  # and it serves on
    assert usage.completion_tokens == 4


def test_row5_reservation_ids_are_unguessable(rig):
    made = [_reserve(rig, f"q{i}", [i + 1] * 20, headroom=0) for i in range(8)]
    ids = [r.reservation_id for r in made]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"r-[0-9a-f]{32}", i) for i in ids)  # 128 random bits
    near = ids[0][:-1] + ("0" if ids[0][-1] != "0" else "1")
    assert code_of(rig.kv_as("router").Abort, kv_pb.AbortRequest(reservation_id=near, incarnation=made[0].incarnation),
                   timeout=5) == grpc.StatusCode.NOT_FOUND
    for r in made:
        rig.kv_as("w0").Abort(kv_pb.AbortRequest(reservation_id=r.reservation_id, incarnation=r.incarnation, worker_id="w0"),
                              timeout=5)
    assert rig.wait_settled().live_reservations == 0


def test_row6_match_and_watch_events_are_for_routers_only(rig):
    match = kv_pb.MatchRequest(tokens=tokens_to_proto(list(PROMPT.encode())))
    assert code_of(rig.kv_as("router").Match, match, timeout=5) == grpc.StatusCode.OK
    for name in ("w0", "evil", "alice"):
        assert code_of(rig.kv_as(name).Match, match, timeout=5) == DENIED
        assert code_of(rig.kv_as(name).Reserve, kv_pb.ReserveRequest(), timeout=5) == DENIED
        assert code_of(rig.kv_as(name).WatchEvents, kv_pb.WatchEventsRequest(worker_id="w0"), timeout=5) == DENIED


def test_row8_work_per_call_is_bounded(rig):
    kv = rig.kv_as("w0")
    inc = rig.incarnation()
    items = [kv_pb.CapacityItem(reservation_id=f"r-{i:032x}", incarnation=inc, capacity_positions=16) for i in range(5000)]
    started = time.monotonic()
    assert code_of(kv.Extend, kv_pb.ExtendRequest(items=items), timeout=5) == grpc.StatusCode.INVALID_ARGUMENT
    assert time.monotonic() - started < 2.0
    evil = rig.kv_as("evil")
    assert code_of(evil.RegisterWorker, _register("evil", num_blocks=1 << 22), timeout=5) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(evil.RegisterWorker, _register("evil", address="x" * 300), timeout=5) == grpc.StatusCode.INVALID_ARGUMENT
    long_id = "x" * 200
    with pytest.raises(grpc.RpcError) as err:
        rig.kv_as("router").Reserve(kv_pb.ReserveRequest(worker_id="w0", incarnation=inc, request_id=long_id,
                                                         tokens=tokens_to_proto([1, 2])), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(err.value.details()) < 200  # id cut
    with pytest.raises(grpc.RpcError) as err:
        rig.kv_as("router").Abort(kv_pb.AbortRequest(reservation_id="y" * 20_000, incarnation=inc), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and len(err.value.details()) < 200
    assert rig.stats().live_reservations == 0 and rig.invariants().ok


def test_row12_request_ids_are_per_tenant_and_workers_obey_only_routers(rig):
    results = {}

    def run(token):
        results[token] = rig.generate(PROMPT, token=token, max_new_tokens=6, request_id="same-id")

    threads = [threading.Thread(target=run, args=(t,)) for t in ("tokA", "tokB")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert sorted(results) == ["tokA", "tokB"] and all(len(ids) == 6 for ids, _ in results.values())
    for name in ("alice", "w0", "evil"):
        assert code_of(rig.worker_as(name).Abort, w_pb.AbortRequest(request_id="same-id"), timeout=5) == DENIED
        assert code_of(rig.worker_as(name).Generate, w_pb.GenerateRequest(request_id="x"), timeout=5) == DENIED


def test_row13_malformed_messages_are_invalid_argument(rig):
    bad_utf8 = b"\x0a\x02\xff\xfe"  # field 1 (a string) holding invalid UTF-8
    truncated = b"\x0a\x05ab"  # length 5, two bytes follow
    for channel, method in (
        (rig.channel(rig.kv.address, "w0"), "/tandem.kvstore.v1.KVStore/RegisterWorker"),
        (rig.channel(rig.kv.address, "router"), "/tandem.kvstore.v1.KVStore/Match"),
        (rig.channel(rig.workers["w0"].address, "router"), "/tandem.worker.v1.Worker/Abort"),
    ):
        call = channel.unary_unary(method)
        for payload in (bad_utf8, truncated):
            with pytest.raises(grpc.RpcError) as err:
                call(payload, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "Traceback" not in err.value.details() and "DecodeError" not in err.value.details()
    stream = rig.router.channel.unary_stream("/tandem.router.v1.Router/Generate")
    for payload in (bad_utf8, truncated):  # GenerateRequest.text is field 1
        assert code_of(stream, payload, timeout=5, metadata=[("authorization", "Bearer tokA")]) == grpc.StatusCode.INVALID_ARGUMENT
    assert rig.invariants().ok


def test_row9_a_frozen_worker_ends_its_streams_with_unavailable(pki, start_service):
    """SIGSTOP a worker process mid-stream: its lease lapses, it leaves the registry, and the
    router ends its stream with UNAVAILABLE in seconds (it used to hang until the 600 s deadline);
    the kvstore dropped its blocks."""
    import signal

    from trust_rig import spawn_worker, wait_workers

    rig = TrustRig(pki, start_service)
    proc = None
    try:
        rig.start_kvstore()
        proc = spawn_worker(rig, "w1")
        wait_workers(rig, {"w1"})
        rig.start_router()
        call = rig.router.stub.Generate(router_pb2.GenerateRequest(temperature=0.0, text=PROMPT, max_new_tokens=4000), timeout=120)
        assert next(call).token_ids
        proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 15
        stats = rig.wait_settled()
        assert (stats.live_reservations, stats.ending_reservations, len(stats.workers)) == (0, 0, 0)
        assert rig.invariants().ok
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)
        rig.close()


def test_row15_the_router_takes_its_draft_limit_from_the_worker(rig):
    """The router allows 16 draft tokens, the worker 8: a request for 12 runs (with 8) instead of
    reserving and then failing."""
    ids, usage = rig.generate(PROMPT, token="tokA", max_new_tokens=6, num_draft_tokens=12)
    assert len(ids) == 6 and usage.completion_tokens == 6
