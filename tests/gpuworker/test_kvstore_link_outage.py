"""The worker's reads from the kvstore ride through an outage (a failover to a standby): the
GetReservation of a new request is resent until the kvstore answers, within a bound."""

from __future__ import annotations

import grpc
import pytest

from services.common.errors import Unavailable
from services.common.spec import SpecMode


def _refusing_kvstore(start_kvstore, refuse: int):
    from services.kvstore.servicer import KVStoreServicer

    class Failover(KVStoreServicer):
        down = refuse

        async def GetReservation(self, request, context):
            if Failover.down:
                Failover.down -= 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no leader yet")
            return await super().GetReservation(request, context)

    return start_kvstore(Failover), Failover


@pytest.mark.parametrize("retry_s", [5.0, 0.0])
def test_get_reservation_is_resent_through_an_outage(start_kvstore, retry_s):
    """The reader on the gRPC process's loop resends while the kvstore answers UNAVAILABLE (up to
    ``retry_s``), then raises it typed; a read naming another incarnation fails at once (FAILED_PRECONDITION)."""
    import asyncio

    from services.common.channels import open_channel
    from services.common.errors import FailedPrecondition
    from services.gpuworker.kvstore_link import KVStoreLink
    from services.gpuworker.reservation_reader import ReservationReader

    svc, failover = _refusing_kvstore(start_kvstore, refuse=3)
    link = KVStoreLink(svc.address, timeout_s=2.0)
    try:
        info = link.register(worker_id="w", address="x", model_id="m", spec_mode=SpecMode.NONE, mtp_depth=0,
                             block_size=4, num_blocks=16, vocab_size=100, max_seq_len=64)
        r = svc.in_loop(lambda: svc.payload.reserve(worker_id="w", incarnation=info.incarnation, request_id="q",
                                                    tokens=list(range(10))))

        async def read():
            reader = ReservationReader(open_channel(svc.address, trace=False), timeout_s=2.0)
            try:
                if retry_s:
                    got = await reader.get(r.reservation_id, info.incarnation, retry_s=retry_s)
                    assert list(got.reservation.block_table) == list(r.block_table) and failover.down == 0
                    with pytest.raises(FailedPrecondition):  # not a transient error: no resend
                        await reader.get(r.reservation_id, info.incarnation + 1, retry_s=retry_s)
                else:
                    with pytest.raises(Unavailable):
                        await reader.get(r.reservation_id, info.incarnation, retry_s=retry_s)
                    assert failover.down == 2
            finally:
                await reader.close()

        asyncio.run(read())
    finally:
        link.close()


def test_publish_many_answers_per_item_and_raises_when_every_item_was_forgotten(start_kvstore):
    """One PublishMany per engine step: per item its answer or typed error; a batch the kvstore
    refused whole as unknown (it forgot this worker) raises, so the courier can resend it."""
    from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
    from services.gpuworker.kvstore_link import KVStoreLink

    svc = start_kvstore()
    link = KVStoreLink(svc.address, timeout_s=2.0)
    try:
        info = link.register(worker_id="w", address="x", model_id="m", spec_mode=SpecMode.NONE, mtp_depth=0,
                             block_size=4, num_blocks=16, vocab_size=100, max_seq_len=64)
        r = svc.in_loop(lambda: svc.payload.reserve(worker_id="w", incarnation=info.incarnation, request_id="q",
                                                    tokens=list(range(10)), headroom_positions=6))
        inc = info.incarnation
        ok, bad, ghost = link.publish_many([(r.reservation_id, inc, [], 8, 0), (r.reservation_id, inc, [], 99, 0),
                                            ("r-ghost", inc, [], 4, 0)])
        assert ok.published_blocks == 2 and ok.block_table == list(r.block_table)  # plain values: they cross a pipe
        assert isinstance(bad, InvalidArgument) and isinstance(ghost, NotFound)
        with pytest.raises(NotFound):
            link.publish_many([("r-ghost", inc, [], 4, 0)])
        # incarnation 0: the reservation died with a memory kvstore; nothing is sent for it
        assert link.publish_many([(r.reservation_id, 0, [], 8, 0)]) == [None]
        dead, again = link.publish_many([("r-ghost", 0, [], 4, 0), (r.reservation_id, inc, [], 8, 0)])
        assert dead is None and again.published_blocks == 2
        assert link.release("r-ghost", 0, [], 4) is False and link.abort("r-ghost", 0) is None
        link.register(worker_id="w", address="x", model_id="m", spec_mode=SpecMode.NONE, mtp_depth=0,
                      block_size=4, num_blocks=16, vocab_size=100, max_seq_len=64)  # r died with incarnation inc
        with pytest.raises(FailedPrecondition):
            link.publish_many([(r.reservation_id, inc, [10, 11], 8, 10), (r.reservation_id, inc, [], 8, 0)])
    finally:
        link.close()


def test_a_publish_answer_carries_the_table_only_when_the_published_blocks_moved(start_kvstore):
    """Twin requests on one worker: the second's Publish deduplicates its blocks against the
    first's, so its answer brings the remapped table; a Publish whose blocks stayed put answers
    without one, and so does a resend of it. A resend of the deduplicating Publish (its answer
    lost) brings the table again, and so does any answer when what the caller holds differs
    anywhere in the published blocks (a block it should have remapped earlier, e.g. after a
    Redis kvstore lost an acknowledged Publish)."""
    from services.gpuworker.kvstore_link import KVStoreLink, table_digest

    svc = start_kvstore()
    link = KVStoreLink(svc.address, timeout_s=2.0)
    try:
        info = link.register(worker_id="w", address="x", model_id="m", spec_mode=SpecMode.NONE, mtp_depth=0,
                             block_size=4, num_blocks=32, vocab_size=100, max_seq_len=64)
        inc = info.incarnation
        prompt = list(range(10))
        a = svc.in_loop(lambda: svc.payload.reserve(worker_id="w", incarnation=inc, request_id="a", tokens=prompt,
                                                    headroom_positions=6))
        b = svc.in_loop(lambda: svc.payload.reserve(worker_id="w", incarnation=inc, request_id="b", tokens=prompt,
                                                    headroom_positions=6))
        ta, tb = list(a.block_table), list(b.block_table)
        assert ta[:2] != tb[:2]  # two copies of the same two full blocks, nothing published yet
        (first,) = link.publish_many([(a.reservation_id, inc, [], 8, 0)], [(2, table_digest(ta[:2]))])
        assert first.published_blocks == 2 and first.block_table is None  # nothing moved
        (twin,) = link.publish_many([(b.reservation_id, inc, [], 8, 0)], [(2, table_digest(tb[:2]))])
        assert twin.published_blocks == 2 and twin.block_table is not None
        assert twin.block_table[:2] == ta[:2] and twin.block_table[2:] == tb[2:]  # b reads a's copy now
        (lost_answer_resent,) = link.publish_many([(b.reservation_id, inc, [], 8, 0)], [(2, table_digest(tb[:2]))])
        assert lost_answer_resent.block_table == twin.block_table
        (again,) = link.publish_many([(a.reservation_id, inc, [], 8, 0)], [(2, table_digest(ta[:2]))])
        assert again.block_table is None
        (stale,) = link.publish_many([(a.reservation_id, inc, [], 8, 0)], [(2, table_digest([ta[1], ta[0]]))])
        assert stale.block_table == ta  # the caller's blocks differ from the kvstore's: the table comes back
        (plain,) = link.publish_many([(b.reservation_id, inc, [], 8, 0)])  # nothing expected: the table
        assert plain.block_table == twin.block_table
    finally:
        link.close()


def test_a_publish_the_kvstore_lost_is_caught_by_the_next_answer():
    """A Redis kvstore (appendfsync everysec) that crashed may come back without a Publish it
    had acknowledged. The request's next Publish then publishes those blocks again and may
    deduplicate them below what the worker holds as confirmed: its answer must bring the table,
    or the worker would keep reading blocks the kvstore freed (found by review)."""
    from services.gpuworker.kvstore_link import _publish_answer, table_digest
    from services.kvstore.journal import JournaledStore
    from services.kvstore.types import WorkerSpec
    from tandem.kvstore.v1 import kvstore_pb2 as kv

    def as_proto(result):
        r = result.reservation
        return kv.PublishResponse(reservation=kv.Reservation(block_table=list(r.block_table), published_blocks=r.published_blocks),
                                  deduplicated=result.deduplicated)

    entries = []
    leader = JournaledStore({}, sink=lambda seq, entry: entries.append(entry))
    inc = leader.register_worker(WorkerSpec("w", "x", "m", SpecMode.NONE, 0, 4, 32, 100, 64)).incarnation
    prompt = list(range(20))
    r = leader.reserve(worker_id="w", incarnation=inc, request_id="r", tokens=prompt, headroom_positions=4)
    held = list(r.block_table)  # the worker's table
    snapshot = leader.snapshot()
    # chunked prefill: the first chunk's Publish (blocks 0-1) is acknowledged without a table
    first = _publish_answer(as_proto(leader.publish(reservation_id=r.reservation_id, incarnation=inc, final_positions=8,
                                                    known_tokens=20)), (2, table_digest(held[:2])))
    assert first.block_table is None and first.published_blocks == 2
    entries.pop()  # ...and lost with the leader: the standby recovers without it
    standby = JournaledStore.recover({}, snapshot, [])
    twin = standby.reserve(worker_id="w", incarnation=inc, request_id="s", tokens=prompt, headroom_positions=4)
    standby.publish(reservation_id=twin.reservation_id, incarnation=inc, final_positions=8, known_tokens=20)
    # the second chunk's Publish (blocks 0-3): blocks 0-1 are deduplicated onto the twin's copies
    second = _publish_answer(as_proto(standby.publish(reservation_id=r.reservation_id, incarnation=inc,
                                                      final_positions=16, known_tokens=20)), (4, table_digest(held[:4])))
    assert second.block_table is not None, "the worker was not told that blocks it reads moved"
    assert second.block_table[:2] == list(twin.block_table[:2]) != held[:2]
