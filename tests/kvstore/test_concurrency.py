"""Many clients at once over gRPC: 16 threads, each with its own channel, run whole request
lifecycles on overlapping prefixes against two small workers, while a 17th thread follows the
event stream of one worker.

Afterwards the store must be exactly as healthy as a sequential run would leave it: the audit is
clean, no reservation is live, every block is free or cached (nothing leaked), prefixes were
reused, and the event stream alone reconstructs the worker's cached blocks::

    client k:  Match ─▶ Reserve ─▶ [Extend] ─▶ Publish ─▶ Release | Suspend | Abort   (x ROUNDS)
                  (RESOURCE_EXHAUSTED on Reserve/Extend is an answer, not a failure)
"""

from __future__ import annotations

import random
import threading

import grpc

from services.common.wire import tokens_to_proto
from tandem.kvstore.v1 import kvstore_pb2 as pb
from tandem.kvstore.v1 import kvstore_pb2_grpc

CLIENTS = 16
ROUNDS = 20
DEADLINE = 10.0
BLOCK = 4
PREFIXES = [[100 * p + i for i in range(1, 13)] for p in range(5)]  # 12 tokens = 3 blocks each
TAILS = [[900 + 7 * t + i for i in range(6)] for t in range(3)]  # a few shared tails: dedup happens


def one_client(channel, seed: int, outcome: dict, errors: list) -> None:
    """Run ROUNDS lifecycles; tally outcomes; record any unexpected error (mutates the store)."""
    rng = random.Random(seed)
    stub = kvstore_pb2_grpc.KVStoreStub(channel)
    try:
        for n in range(ROUNDS):
            tail = rng.choice(TAILS)[: rng.randint(0, 6)] + [rng.randint(1, 999) for _ in range(rng.randint(0, 5))]
            ids = rng.choice(PREFIXES) + tail
            tokens = tokens_to_proto(ids)
            matches = stub.Match(pb.MatchRequest(tokens=tokens), timeout=DEADLINE).workers
            best = max(m.reusable_positions for m in matches)
            w = rng.choice([m for m in matches if m.reusable_positions == best])
            try:
                r = stub.Reserve(
                    pb.ReserveRequest(worker_id=w.worker_id, incarnation=w.incarnation, request_id=f"c{seed}-{n}",
                                      tokens=tokens, headroom_positions=rng.randint(0, 6)),
                    timeout=DEADLINE,
                ).reservation
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                outcome["exhausted"] += 1
                continue
            outcome["reused"] += r.reused_positions
            capacity = r.capacity_positions
            if rng.random() < 0.3:
                item = pb.CapacityItem(reservation_id=r.reservation_id, incarnation=r.incarnation,
                                       capacity_positions=capacity + BLOCK)
                (res,) = stub.Extend(pb.ExtendRequest(items=[item]), timeout=DEADLINE).results
                if res.code not in (0, 8):  # OK or RESOURCE_EXHAUSTED
                    raise AssertionError(f"Extend item failed: {res.code} {res.message}")
                capacity = res.capacity_positions if res.code == 0 else capacity
            new = [rng.randint(1, 999) for _ in range(min(rng.randint(0, 3), capacity - len(ids)))]
            final = rng.randint(0, len(ids) + len(new))
            stub.Publish(pb.PublishRequest(reservation_id=r.reservation_id, incarnation=r.incarnation,
                                           new_tokens=tokens_to_proto(new), final_positions=final),
                         timeout=DEADLINE)
            end = rng.choice(["Release", "Release", "Suspend", "Abort"])
            if end == "Abort":
                stub.Abort(pb.AbortRequest(reservation_id=r.reservation_id, incarnation=r.incarnation, worker_id=r.worker_id),
                           timeout=DEADLINE)
            else:
                getattr(stub, end)(pb.ReleaseRequest(reservation_id=r.reservation_id, incarnation=r.incarnation,
                                                     final_positions=final), timeout=DEADLINE)
            outcome[end] += 1
    except Exception as exc:  # noqa: BLE001 - reported by the test thread
        errors.append(exc)


def follow_events(stream, events: list, errors: list) -> None:
    """Collect events until the stream is cancelled."""
    try:
        for event in stream:
            events.append(event)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            errors.append(exc)


def test_many_clients_leave_a_consistent_store(kvstore_service):
    svc, kv = kvstore_service, kvstore_service.kv
    a = kv.register("a", num_blocks=20, block_size=BLOCK)
    kv.register("b", num_blocks=20, block_size=BLOCK)
    # One event on "a" before the watcher starts: reading it proves the stream is subscribed.
    seed = kv.reserve(a, "seed", PREFIXES[0] + [1])
    kv.release(seed, 13)
    stream = kv.stub.WatchEvents(pb.WatchEventsRequest(worker_id="a"), timeout=60)
    events = [next(stream)]
    errors: list = []
    watcher = threading.Thread(target=follow_events, args=(stream, events, errors))
    watcher.start()

    channels = [svc.new_channel() for _ in range(CLIENTS)]
    outcomes = [dict(exhausted=0, reused=0, Release=0, Suspend=0, Abort=0) for _ in range(CLIENTS)]
    threads = [
        threading.Thread(target=one_client, args=(ch, k, outcomes[k], errors)) for k, ch in enumerate(channels)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)

    try:
        assert not errors, errors[:3]
        check = kv.invariants()
        assert check.ok, list(check.violations)
        stats = kv.stats()
        assert stats.live_reservations == 0
        for w in stats.workers:
            assert w.pool.in_use == 0 and w.pool.free + w.pool.cached == w.pool.total, w
        ended = sum(o["Release"] + o["Suspend"] + o["Abort"] for o in outcomes)
        assert ended + sum(o["exhausted"] for o in outcomes) == CLIENTS * ROUNDS
        assert stats.reservations_created == ended + 1  # + the seed
        assert sum(o["reused"] for o in outcomes) > 0  # prefixes were shared across clients
        assert sum(w.reused_positions for w in stats.workers) == sum(o["reused"] for o in outcomes)
        assert sum(w.published_blocks for w in stats.workers) > 0
        assert sum(w.evictions for w in stats.workers) > 0  # 20-block pools: cache pressure is real

        # The event stream of "a", replayed on its own, lands on a's cached blocks.
        last_seq = svc.in_loop(lambda: svc.payload.events_since("a", 0)[-1].seq)
        for _ in range(500):  # the watcher may still be a few events behind: wait up to 5 s
            if events[-1].seq >= last_seq:
                break
            threading.Event().wait(0.01)
        assert [e.seq for e in events] == list(range(1, last_seq + 1))
        resident: dict[int, bytes] = {}
        for e in events:
            if e.kind == pb.BlockEvent.KIND_STORED:
                assert not set(e.block_ids) & set(resident), "a block was stored twice"
                resident.update(zip(e.block_ids, e.block_keys))
            elif e.kind == pb.BlockEvent.KIND_REMOVED:
                for block_id, key in zip(e.block_ids, e.block_keys):
                    assert resident.pop(block_id) == key
        assert len(resident) == stats.workers[0].pool.cached
    finally:
        stream.cancel()
        watcher.join(10)
        svc.stop()  # first: closing channels to a live server is slow
        for ch in channels:
            ch.close()
