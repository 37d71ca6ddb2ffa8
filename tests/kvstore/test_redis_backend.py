"""The Redis backend: journal replay, fencing, repair of lost writes, and a real failover —
two ``tandem kvstore --backend redis`` processes on one real redis-server, the leader SIGKILLed,
the standby taking over with the exact state, a client following the address list."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from services.common.channels import FAILOVER_OPTIONS, grpc_target
from services.common.errors import InvalidArgument
from services.common.spec import SpecMode
from services.common.wire import tokens_to_proto
from services.kvstore import KVStore, WorkerSpec
from services.kvstore.journal import MUTATING, READ_ONLY, JournalDiverged, JournaledStore
from services.kvstore.redis_backend import NODE_NAME_PREFIX, Fenced, RedisLog
from tandem.kvstore.v1 import kvstore_pb2 as pb
from tandem.kvstore.v1 import kvstore_pb2_grpc
from tests.redis_server import free_port, unique_prefix

ROOT = Path(__file__).resolve().parents[2]
ARGS = dict(lease_ttl_s=30.0, epoch=7, events_per_worker=0)
SPEC = WorkerSpec("w", "", "m", SpecMode.EAGLE3, 0, 4, 16, 100, 64)


def test_every_public_verb_is_classified():
    """A verb added to the core must be declared mutating (journaled) or read-only."""
    public = {n for n in dir(KVStore) if not n.startswith("_") and callable(getattr(KVStore, n))}
    assert public - {"expire_leases"} == MUTATING | READ_ONLY
    assert not MUTATING & READ_ONLY


def _fill(store: JournaledStore) -> None:
    w = store.register_worker(SPEC)
    r = store.reserve(worker_id="w", incarnation=w.incarnation, request_id="a", tokens=list(range(20)), headroom_positions=4)
    store.release(reservation_id=r.reservation_id, incarnation=w.incarnation, final_positions=19)
    store.reserve(worker_id="w", incarnation=w.incarnation, request_id="b", tokens=list(range(24)))


def test_replay_reproduces_the_state_and_detects_divergence():
    entries: list = []
    store = JournaledStore(ARGS, lambda s, e: entries.append((s, e)))
    _fill(store)
    again = JournaledStore.recover(ARGS, None, entries)
    assert again.seq == store.seq == len(entries)
    assert again.store.view().reservations() == store.store.view().reservations()
    assert again.match(list(range(24)))[0].reusable_blocks == store.match(list(range(24)))[0].reusable_blocks == 4
    with pytest.raises(JournalDiverged, match="gap"):
        JournaledStore.recover(ARGS, None, entries[:1] + entries[2:])
    # Replayed with other constructor arguments the outcomes differ, and replay says so.
    with pytest.raises(JournalDiverged):
        JournaledStore.recover({**ARGS, "epoch": 8}, None, entries)


def test_a_rejected_call_is_not_journaled():
    entries: list = []
    store = JournaledStore(ARGS, lambda s, e: entries.append((s, e)))
    store.register_worker(SPEC)
    with pytest.raises(InvalidArgument):
        store.reserve(worker_id="w", incarnation=store.list_workers()[0].incarnation, request_id="x", tokens=[])
    assert len(entries) == 1


def test_only_the_lease_holder_writes(redis_server):
    prefix = unique_prefix()
    a = RedisLog(redis_server.url, prefix=prefix, lease_ms=1000)
    b = RedisLog(redis_server.url, prefix=prefix, lease_ms=1000)
    assert a.try_acquire() and b.try_acquire() is None
    assert a.append(1, [b"x"]) == 1
    assert a.append(1, [b"x"]) == 1  # a retried batch that had landed is recognised, not doubled
    while a.holder() is not None:  # a's lease lapses (it was cut off and did not renew)
        time.sleep(0.05)
    assert b.try_acquire() and int(b.token.split(":")[0]) > int(a.token.split(":")[0])  # a fresh fencing epoch
    with pytest.raises(Fenced):
        a.append(2, [b"y"])
    with pytest.raises(Fenced):
        a.write_snapshot(1, b"s")
    assert not a.renew()
    assert b.append(2, [b"z"]) == 2
    a.close(), b.wipe(), b.close()


def test_redis_that_lost_acknowledged_writes_is_repaired_from_memory(redis_server):
    """``appendfsync everysec``: a Redis crash may lose the last second of entries. A leader that
    still holds them notices (Redis has fewer than it acknowledged) and writes its memory back."""
    log = RedisLog(redis_server.url, prefix=unique_prefix(), lease_ms=60_000)
    assert log.try_acquire()
    store = log.load(ARGS, lambda s, e: log.append(s, [e]))
    _fill(store)
    log.client.rpop(log.keys["journal"], 2)  # what a crash with everysec may do
    assert log.length() == store.seq - 2
    epoch = log.epoch()
    log.resign()
    assert log.try_acquire() and log.epoch() == epoch + 1  # nobody led in between
    kept = log.load(ARGS, None, previous=store, previous_epoch=epoch, acknowledged=store.seq)
    assert kept is store and log.length() == store.seq
    # Had another kvstore led in between, Redis would be the truth, never our memory.
    other = RedisLog(redis_server.url, prefix=log.prefix, lease_ms=60_000)
    log.resign()
    assert other.try_acquire()
    other.resign()
    assert log.try_acquire()
    fresh_from_redis = log.load(ARGS, None, previous=store, previous_epoch=epoch + 1, acknowledged=store.seq)
    assert fresh_from_redis is not store and fresh_from_redis.seq == log.length()
    other.close()
    fresh = log.load(ARGS, None)
    assert fresh.store.view().reservations() == store.store.view().reservations()
    log.wipe(), log.close()


# ------------------------------------------------------------------------------------ failover


def _kvstore(url: str, prefix: str, port: int, lease_ms: int = 600) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "kvstore", "--backend", "redis", "--redis-url", url,
         "--redis-prefix", prefix, "--redis-lease-ms", str(lease_ms), "--port", str(port), "--lease-ttl-s", "30"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def _until(fn, timeout_s: float = 20.0):
    end = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except grpc.RpcError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def test_standby_takes_over_a_sigkilled_leader_with_the_exact_state(redis_server):
    prefix, ports = unique_prefix(), [free_port(), free_port()]
    procs = [_kvstore(redis_server.url, prefix, p) for p in ports]
    channel = grpc.insecure_channel(grpc_target(",".join(f"127.0.0.1:{p}" for p in ports)), options=FAILOVER_OPTIONS)
    stub = kvstore_pb2_grpc.KVStoreStub(channel)
    try:
        w = _until(lambda: stub.RegisterWorker(pb.RegisterWorkerRequest(
            worker_id="w", address="x", model_id="m", spec_mode=2, block_size=4, num_blocks=32,
            vocab_size=100, max_seq_len=128), timeout=2), 60).worker
        prompt = tokens_to_proto(list(range(40)))
        r = stub.Reserve(pb.ReserveRequest(worker_id="w", incarnation=w.incarnation, request_id="a", tokens=prompt,
                                           headroom_positions=8), timeout=2).reservation
        stub.Release(pb.ReleaseRequest(reservation_id=r.reservation_id, incarnation=w.incarnation, final_positions=39), timeout=2)
        live = stub.Reserve(pb.ReserveRequest(worker_id="w", incarnation=w.incarnation, request_id="b", tokens=prompt,
                                              headroom_positions=8), timeout=2).reservation
        before = stub.Stats(pb.StatsRequest(), timeout=2)
        match_before = stub.Match(pb.MatchRequest(tokens=prompt), timeout=2)

        leader = next(i for i, p in enumerate(procs) if _listening(ports[i]))
        procs[leader].send_signal(signal.SIGKILL)
        procs[leader].wait(5)
        after = _until(lambda: stub.Stats(pb.StatsRequest(), timeout=1), 60)  # how fast: bench/, not here
        assert _listening(ports[1 - leader]) and not _listening(ports[leader])

        before.ClearField("matches"), after.ClearField("matches")
        assert after == before  # pools, reservations, counters, trie: all back
        assert stub.Match(pb.MatchRequest(tokens=prompt), timeout=2).workers == match_before.workers
        # The live reservation goes on under the same incarnation: the worker notices nothing.
        assert stub.Heartbeat(pb.HeartbeatRequest(worker_id="w", incarnation=w.incarnation), timeout=2).lease_expires_in_s > 0
        res = stub.Extend(pb.ExtendRequest(items=[pb.CapacityItem(
            reservation_id=live.reservation_id, incarnation=w.incarnation, capacity_positions=64)]), timeout=2)
        assert res.results[0].code == 0 and list(res.results[0].block_table[:9]) == list(live.block_table[:9])
        assert stub.CheckInvariants(pb.CheckInvariantsRequest(), timeout=2).ok
    finally:
        channel.close()
        _stop(procs)


def test_a_standby_deposes_a_leader_whose_connections_closed(redis_server):
    """The leader names its connections after its lease; once Redis has none of them (a killed
    process's sockets close at once) a standby may drop the lease without waiting it out, and
    the deposed leader's writes are fenced from then on."""
    import redis as redis_py

    prefix = unique_prefix()
    leader, standby = (RedisLog(redis_server.url, prefix=prefix, lease_ms=60_000) for _ in range(2))
    try:
        token = leader.try_acquire()
        named = redis_py.Redis.from_url(redis_server.url, client_name=leader.connection_name())
        named.ping()
        assert standby.holder() == token and standby.holder_connected(token) is True
        named.close()
        end = time.monotonic() + 5
        while standby.holder_connected(token) and time.monotonic() < end:
            time.sleep(0.02)
        assert standby.holder_connected(token) is False
        assert not standby.depose("1:someone-else") and standby.holder() == token  # only the holder seen
        assert standby.depose(token) and standby.try_acquire().startswith("2:")
        with pytest.raises(Fenced):
            leader.append(1, [b"x"])
    finally:
        leader.wipe(), leader.close(), standby.close()


def test_without_client_list_a_standby_waits_for_the_lease(redis_server):
    """A Redis whose ACL denies CLIENT LIST gives no answer (None): the lease alone decides."""
    import redis as redis_py

    admin = redis_py.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", "nolist", "on", ">pw", "~*", "&*", "+@all", "-client")
    host_port = redis_server.url.split("//", 1)[1]
    log = RedisLog(f"redis://nolist:pw@{host_port}", prefix=unique_prefix(), lease_ms=60_000)
    try:
        assert log.try_acquire() and log.holder_connected(log.token) is None
    finally:
        log.wipe(), log.close()
        admin.execute_command("ACL", "DELUSER", "nolist"), admin.close()


def test_a_sigkilled_leader_is_replaced_before_its_lease_runs_out(redis_server):
    import redis as redis_py

    prefix, ports = unique_prefix(), [free_port(), free_port()]
    procs = [_kvstore(redis_server.url, prefix, p, lease_ms=20_000) for p in ports]
    channel = grpc.insecure_channel(grpc_target(",".join(f"127.0.0.1:{p}" for p in ports)), options=FAILOVER_OPTIONS)
    stub = kvstore_pb2_grpc.KVStoreStub(channel)
    client = redis_py.Redis.from_url(redis_server.url)
    try:
        _until(lambda: stub.Stats(pb.StatsRequest(), timeout=2), 60)
        end = time.monotonic() + 60  # the standby is up: both nodes hold their named Redis connection
        while len([c for c in client.client_list() if c["name"].startswith(NODE_NAME_PREFIX)]) < 2:
            assert time.monotonic() < end, "the standby never connected to Redis"
            time.sleep(0.1)
        leader = next(i for i, p in enumerate(procs) if _listening(ports[i]))
        lease_left_s = client.pttl(prefix + "lease") / 1000
        assert lease_left_s > 10
        killed = time.monotonic()
        procs[leader].send_signal(signal.SIGKILL)
        procs[leader].wait(5)
        _until(lambda: stub.Stats(pb.StatsRequest(), timeout=1), 30)
        assert time.monotonic() - killed < lease_left_s  # the lease was not waited out
        assert client.get(prefix + "lease").startswith(b"2:")
    finally:
        channel.close(), client.close()
        _stop(procs)


def _stop(procs) -> None:
    """SIGTERM every kvstore process still running, then wait (SIGKILL one that hangs)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_journal_of_another_format_is_refused_not_misread(redis_server):
    import pickle

    from services.kvstore.redis_backend import JournalFormatError

    log = RedisLog(redis_server.url, prefix=unique_prefix(), lease_ms=60_000)
    assert log.try_acquire()
    log.client.set(log.keys["meta"], pickle.dumps({"format": 0, "store_args": ARGS}))
    with pytest.raises(JournalFormatError, match="format 0"):
        log.load(ARGS)
    log.wipe(), log.close()


def test_a_serving_leader_repairs_redis_that_lost_writes(start_kvstore_service):
    """Redis restarted with ``appendfsync everysec`` and lost the last entries while the leader
    kept serving: the next append sees the gap and the leader writes its memory back, so a
    recovery from Redis afterwards has everything that was acknowledged."""
    svc = start_kvstore_service(backend="redis")
    kv, lead = svc.kv, svc.leadership
    w = kv.register("w0")
    r = kv.reserve(w, "a", range(40), headroom_positions=8)
    kv.release(r, final_positions=39)
    log = lead.log
    assert log.length() == lead.store.seq
    log.client.rpop(log.keys["journal"], 2)  # the lost second
    kv.reserve(w, "b", range(40))  # the next write finds the gap and repairs
    assert log.length() == lead.store.seq
    recovered = RedisLog(log.url, prefix=log.prefix).load({})
    assert svc.in_loop(lambda: recovered.store.view().reservations() == lead.store.store.view().reservations())
    assert recovered.match(list(range(40)))[0].reusable_blocks == 9


def test_snapshots_are_taken_while_serving_and_recovery_uses_them(start_kvstore_service):
    svc = start_kvstore_service(backend="redis", snapshot_every=4)
    kv, lead = svc.kv, svc.leadership
    w = kv.register("w0")
    for i in range(6):
        r = kv.reserve(w, f"q{i}", range(40 + i), headroom_positions=8)
        kv.release(r, final_positions=39 + i)
    log = lead.log
    end = time.monotonic() + 10
    while int(log.client.get(log.keys["base"]) or 0) == 0:  # a snapshot landed
        assert time.monotonic() < end, "no snapshot was written"
        time.sleep(0.05)
    kv.reserve(w, "live", range(40))
    # base and the journal's length read atomically: another snapshot may land at any moment
    base, length = log.client.pipeline(transaction=True).get(log.keys["base"]).llen(log.keys["journal"]).execute()
    assert 4 <= int(base) <= lead.store.seq and int(base) + length == lead.store.seq
    recovered = RedisLog(log.url, prefix=log.prefix).load({})
    assert recovered.seq == lead.store.seq
    assert svc.in_loop(lambda: recovered.store.view().reservations() == lead.store.store.view().reservations())


def test_a_snapshot_process_rebuilds_the_state_from_redis_and_is_fenced(redis_server):
    """Snapshots are made by another process from what Redis holds (the leader's loop is not
    held): its copy equals the leader's; an older snapshot never replaces a newer one; without
    the lease it writes nothing."""
    from services.kvstore.snapshotter import snapshot_from_redis

    log = RedisLog(redis_server.url, prefix=unique_prefix(), lease_ms=60_000)
    assert log.try_acquire()
    store = log.load(ARGS, lambda s, e: log.append(s, [e]))
    _fill(store)
    seq, size, _ = snapshot_from_redis(log.url, log.prefix, log.token)
    assert seq == store.seq and size > 0 and int(log.client.get(log.keys["base"])) == seq
    again = RedisLog(log.url, prefix=log.prefix).replica()
    assert again.store.view().reservations() == store.store.view().reservations()
    assert again.stats() == store.stats()
    log.write_snapshot(seq - 1, b"older")  # a slow snapshot process: refused, nothing trimmed
    assert int(log.client.get(log.keys["base"])) == seq and log.client.get(log.keys["snapshot"]) != b"older"
    token = log.token
    log.resign()
    with pytest.raises(Fenced):
        snapshot_from_redis(log.url, log.prefix, token)
    log.wipe(), log.close()


def test_a_warm_standby_copy_catches_up_to_exactly_what_a_load_gives(redis_server):
    """A standby keeps a copy current (catch_up after each poll), across a snapshot; at takeover
    the copy equals a full load from Redis."""
    from services.kvstore.snapshotter import snapshot_from_redis

    log = RedisLog(redis_server.url, prefix=unique_prefix(), lease_ms=60_000)
    assert log.try_acquire()
    store = log.load(ARGS, lambda s, e: log.append(s, [e]))
    standby = RedisLog(log.url, prefix=log.prefix)
    warm = standby.replica()
    _fill(store)
    assert standby.catch_up(warm) > 0 and warm.seq == store.seq
    snapshot_from_redis(log.url, log.prefix, log.token)  # the leader's snapshot trims the journal
    _fill(store)
    standby.catch_up(warm)
    full = RedisLog(log.url, prefix=log.prefix).replica()
    assert warm.seq == full.seq == store.seq
    assert warm.store.view().reservations() == full.store.view().reservations() == store.store.view().reservations()
    assert warm.stats() == full.stats()
    log.wipe(), log.close(), standby.close()


def test_a_takeover_keeps_its_lease_while_the_warm_copy_is_still_loading(redis_server):
    """The warm copy's step in flight (a replica build: seconds on a loaded machine) may outlast
    the lease; the new leader renews its lease meanwhile instead of losing it."""
    import asyncio

    from services.kvstore.leader import Leadership
    from services.kvstore.server import start_kvstore
    from services.kvstore.settings import KVStoreSettings

    prefix = unique_prefix()
    holder = RedisLog(redis_server.url, prefix=prefix, lease_ms=300)
    settings = KVStoreSettings(backend="redis", redis_url=redis_server.url, redis_prefix=prefix, redis_lease_ms=300,
                               port=0)

    async def start(settings, store):
        server, _ = await start_kvstore(settings, store=store)
        return server

    async def scenario():
        assert holder.try_acquire()
        holder.load(ARGS)  # a journal exists: the standby builds a warm copy of it
        leadership = Leadership(settings, start_server=start)
        real = leadership._keep_warm

        def slow_warm():
            real()
            time.sleep(1.0)  # three leases long

        leadership._keep_warm = slow_warm
        running = asyncio.ensure_future(leadership.run())
        await asyncio.sleep(0.2)  # its warm step is in flight
        holder.resign()
        await asyncio.wait_for(leadership.leading.wait(), 10)
        await asyncio.sleep(1.0)  # past three leases
        assert leadership.leading.is_set() and leadership.log.holder() == leadership.log.token
        leadership.stop.set()
        await asyncio.wait_for(running, 10)

    try:
        asyncio.run(scenario())
    finally:
        holder.wipe(), holder.close()



def _leading_store(log: RedisLog, **committer_kw):
    """(committer, store): ``log``'s lease taken and a store loaded from it whose mutations go
    through a ``Committer`` (not started), as ``Leadership`` wires them."""
    from services.kvstore.redis_backend import Committer

    assert log.try_acquire()
    holder = {}
    committer = Committer(log, lambda: holder["s"], **committer_kw)
    store = holder["s"] = log.load(ARGS, committer.submit)
    store.waiter = committer.durable
    return committer, store

def test_a_batch_cut_at_max_batch_answers_its_own_waiters(redis_server):
    """Group commit under a backlog: an entry that went out in a batch cut at ``max_batch`` is
    acknowledged with that batch, not held until every entry queued after it is durable (the
    waiters of a batch share one future; entries beyond the next batch must not join it)."""
    import asyncio

    log = RedisLog(redis_server.url, prefix=unique_prefix())

    async def scenario():
        committer, store = _leading_store(log, max_batch=2)
        seen = []  # (durable seq, was seq 1 acknowledged) at every advance
        advance = committer._advance
        committer._advance = lambda seq: (advance(seq), seen.append((seq, first.done())))
        tasks = committer.start(store.seq)
        store.register_worker(SPEC)
        first = store.durable()  # seq 1, not sent yet
        for _ in range(7):  # queued behind it before the committer runs: 4 batches of 2
            store.register_worker(SPEC)
            store.durable()
        await asyncio.wait_for(store.durable(), 5)
        for t in tasks:
            t.cancel()
        await committer.close()
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        log.wipe(), log.close()
    assert seen[0] == (2, True), seen  # the first batch (1, 2) answered seq 1


def test_the_fast_path_hands_a_failed_batch_to_the_retrying_path_and_takes_over_again(redis_server):
    """Group commit's fast path (batches sent from a loop callback, replies handled in the pipe's
    data_received): the first batch finds no connection and goes through the slow path, later
    batches go the fast way; a connection Redis drops under a batch in flight hands that batch
    back (resent, not lost, not doubled), and the fast path sends again once the queue drained."""
    import asyncio

    log = RedisLog(redis_server.url, prefix=unique_prefix())

    async def scenario():
        committer, store = _leading_store(log)
        tasks = committer.start(store.seq)
        inc = store.register_worker(SPEC).incarnation
        await asyncio.wait_for(store.durable(), 5)  # no connection yet: the slow path connects
        for i in range(20):  # one at a time: each its own fast-path batch
            store.heartbeat(worker_id="w", incarnation=inc)
            await asyncio.wait_for(store.durable(), 5)
        fast = committer.batches
        assert not committer._slow and fast == 21
        # Redis drops the append connection with a batch in flight: writes are paused, so the
        # batch is sent and cannot have been answered when its connection is killed
        handbacks = committer.handbacks
        killer = log.client
        killer.execute_command("CLIENT", "PAUSE", "5000", "WRITE")
        try:
            store.heartbeat(worker_id="w", incarnation=inc)
            pending = store.durable()
            committer._flush()  # sent now; Redis holds it
            assert committer._inflight is not None
            name = log.connection_name()
            for c in killer.client_list(_type="normal"):
                if c.get("name") == name:
                    killer.client_kill_filter(_id=c["id"])
            await asyncio.sleep(0.05)  # the pipe sees the close
        finally:
            killer.execute_command("CLIENT", "UNPAUSE")
        await asyncio.wait_for(pending, 5)
        assert committer.handbacks == handbacks + 1  # the slow path resent it
        for _ in range(5):
            store.heartbeat(worker_id="w", incarnation=inc)
            await asyncio.wait_for(store.durable(), 5)
        slow_after = committer._slow
        for t in tasks:
            t.cancel()
        await committer.close()
        return store.seq, committer.durable_seq, slow_after

    try:
        seq, durable, slow_after = asyncio.run(scenario())
        assert durable == seq == log.length() == 27  # every entry in Redis exactly once
        assert not slow_after  # back on the fast path
    finally:
        log.wipe(), log.close()


def test_early_flush_sends_a_batch_once_it_holds_flush_at_entries(redis_server):
    """``flush_at``: with nothing in flight (and Redis quick) a batch leaves from the handler
    that fills it to ``flush_at``, not at the end of the loop turn; the rest of the turn goes in
    the next batch, every entry once, in order."""
    import asyncio

    log = RedisLog(redis_server.url, prefix=unique_prefix())

    async def scenario():
        committer, store = _leading_store(log, flush_at=2, early_rtt_s=10.0)
        tasks = committer.start(store.seq)
        inc = store.register_worker(SPEC).incarnation
        await asyncio.wait_for(store.durable(), 5)  # the slow path connects
        store.heartbeat(worker_id="w", incarnation=inc)
        await asyncio.wait_for(store.durable(), 5)  # a fast-path batch: Redis was quick
        store.heartbeat(worker_id="w", incarnation=inc)
        store.heartbeat(worker_id="w", incarnation=inc)
        early = committer._inflight is not None and len(committer._inflight[1]) == 2  # sent from the handler
        store.heartbeat(worker_id="w", incarnation=inc)
        await asyncio.wait_for(store.durable(), 5)
        for t in tasks:
            t.cancel()
        await committer.close()
        return early, store.seq, committer.durable_seq, committer.batches

    try:
        early, seq, durable, batches = asyncio.run(scenario())
        assert early
        assert durable == seq == log.length() == 5
        assert batches == 4  # register, one heartbeat, the early pair, the last one
    finally:
        log.wipe(), log.close()


def test_a_commit_during_the_append_connections_handshake_waits_for_it(redis_server):
    """The append connection is published only once AUTH / SELECT / SCRIPT LOAD answered: a batch
    committed while the lease keeper reconnects (Redis restarted: no script cached, a db other than
    0) waits for the handshake instead of running first (NOSCRIPT, then a keeper that died on the
    half-open connection and a leader that kept answering past its lease)."""
    import asyncio

    import redis as redis_py

    url = redis_server.url.rstrip("/") + "/3"
    log = RedisLog(url, prefix=unique_prefix(), lease_ms=1500)

    async def scenario():
        committer, store = _leading_store(log)
        run_task, keeper = committer.start(store.seq)
        inc = store.register_worker(SPEC).incarnation
        await asyncio.wait_for(store.durable(), 5)
        redis_py.Redis.from_url(url).script_flush()
        committer._append.close()  # the idle append connection drops
        end = time.monotonic() + 3
        append = committer._append
        while not append._connecting.locked() and time.monotonic() < end:
            await asyncio.sleep(0)  # until the keeper is inside its reconnect
        assert append._connecting.locked()
        while append._proto is None and append._connecting.locked() and time.monotonic() < end:
            await asyncio.sleep(0)  # until the connection is published (or the reconnect is over)
        store.heartbeat(worker_id="w", incarnation=inc)  # committed during the handshake
        await asyncio.wait_for(store.durable(), 5)
        await asyncio.sleep(2.0)  # past the lease, had nobody renewed it
        alive, lost = not keeper.done(), committer.lost.is_set()
        store.heartbeat(worker_id="w", incarnation=inc)
        await asyncio.wait_for(store.durable(), 5)
        run_task.cancel(), keeper.cancel()
        await committer.close()
        return alive, lost, store.seq, committer.durable_seq

    try:
        alive, lost, seq, durable = asyncio.run(scenario())
        assert alive and not lost  # the keeper still renews
        assert durable == seq == log.length()
    finally:
        log.wipe(), log.close()
