"""gRPC adapter of the kvstore: proto → :class:`~services.kvstore.store.KVStore` call → proto.

Nothing here decides anything: validation, atomicity and state live in the core. The core is
synchronous and single-threaded; every handler calls it without awaiting in between, so calls on
the one event loop are serialized and each transaction is atomic with respect to the others.
Domain errors become status codes in ``services.common.server.ErrorMappingInterceptor``.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.common.errors import InvalidArgument, PermissionDenied, TandemError
from services.common.peers import acting_worker, current_peer
from services.common.wire import spec_mode_from_proto, spec_mode_to_proto, tokens_from_proto
from services.kvstore import types as core
from services.kvstore import validation
from services.kvstore.store import KVStore
from tandem.kvstore.v1 import kvstore_pb2 as pb
from tandem.kvstore.v1 import kvstore_pb2_grpc

log = logging.getLogger(__name__)

_INTERNAL = grpc.StatusCode.INTERNAL.value[0]


def _pool(p) -> pb.PoolUsage:
    return pb.PoolUsage(total=p.total, free=p.free, cached=p.cached, in_use=p.in_use)


def _worker_info(w: core.WorkerInfo) -> pb.WorkerInfo:
    s = w.spec
    return pb.WorkerInfo(
        worker_id=s.worker_id,
        incarnation=w.incarnation,
        address=s.address,
        model_id=s.model_id,
        spec_mode=spec_mode_to_proto(s.spec_mode),
        mtp_depth=s.mtp_depth,
        span=w.span,
        block_size=s.block_size,
        vocab_size=s.vocab_size,
        max_seq_len=s.max_seq_len,
        pool=_pool(w.pool),
        live_reservations=w.live_reservations,
        lease_expires_in_s=w.lease_expires_in_s,
    )


def _reservation(r: core.Reservation) -> pb.Reservation:
    return pb.Reservation(
        reservation_id=r.reservation_id,
        request_id=r.request_id,
        worker_id=r.worker_id,
        incarnation=r.incarnation,
        block_table=r.block_table,
        reused_positions=r.reused_positions,
        capacity_positions=r.capacity_positions,
        published_blocks=r.published_blocks,
    )


def _capacity_result(item_id: str, result: core.ItemResult) -> pb.CapacityResult:
    if result.error is None:
        return pb.CapacityResult(
            reservation_id=item_id,
            code=0,
            block_table=result.block_table,
            capacity_positions=result.capacity_positions,
        )
    err = result.error
    code = err.code.number if isinstance(err, TandemError) else _INTERNAL
    message = err.message if isinstance(err, TandemError) else "internal error"
    return pb.CapacityResult(
        reservation_id=item_id,
        code=code,
        message=message,
        block_table=result.block_table,
        capacity_positions=result.capacity_positions,
    )


def _capacity_items(items, cls) -> list:
    return [
        cls(reservation_id=i.reservation_id, incarnation=i.incarnation, capacity_positions=i.capacity_positions)
        for i in items
    ]


_EVENT_KINDS = {
    core.EventKind.STORED: pb.BlockEvent.KIND_STORED,
    core.EventKind.REMOVED: pb.BlockEvent.KIND_REMOVED,
    core.EventKind.CLEARED: pb.BlockEvent.KIND_CLEARED,
}


def _event(worker_id: str, e: core.Event) -> pb.BlockEvent:
    return pb.BlockEvent(
        seq=e.seq,
        worker_id=worker_id,
        incarnation=e.incarnation,
        kind=_EVENT_KINDS[e.kind],
        block_keys=[bytes(k) for k in e.block_keys],
        block_ids=list(e.block_ids),
        parent_key=bytes(e.parent_key or b""),
    )


WORKER, ROUTER = frozenset({"worker"}), frozenset({"router"})
# Who may call what with mTLS (services.common.peers.PeerRoleInterceptor); finer rules (own id,
# own reservations) are checked per call below and in the core.
ROLE_RULES = {
    "RegisterWorker": WORKER, "Heartbeat": WORKER, "GetReservation": WORKER,
    "Extend": WORKER, "Trim": WORKER, "Publish": WORKER, "PublishMany": WORKER, "Release": WORKER, "Suspend": WORKER,
    "Abort": WORKER | ROUTER,
    "ListWorkers": ROUTER, "Match": ROUTER, "Reserve": ROUTER, "WatchEvents": ROUTER,
    "Stats": WORKER | ROUTER, "CheckInvariants": WORKER | ROUTER,
}


def _own_worker(worker_id: str) -> None:
    """A worker peer names only itself (PermissionDenied otherwise; no-op in insecure mode)."""
    peer = current_peer()
    if peer is not None and peer.role == "worker" and worker_id != peer.id:
        raise PermissionDenied(f"worker {peer.id!r} cannot act as worker {worker_id[:64]!r}")


def _caller_worker() -> str | None:
    """The worker id a reservation verb acts as (None: unchecked, insecure mode)."""
    return acting_worker(current_peer())


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    """Thin adapter over one :class:`KVStore`."""

    def __init__(self, store: KVStore, *, event_queue: int = 4096):
        self.store = store
        self._event_queue = event_queue
        # A durable store (``journal.JournaledStore``) says when a mutation is in Redis; the
        # reply waits for that. The memory store has no such hook.
        self._durable = getattr(store, "durable", None)

    async def _committed(self) -> None:
        if self._durable is not None:
            pending = self._durable()
            if pending is not None:
                await pending

    async def RegisterWorker(self, request, context):
        _own_worker(request.worker_id)
        spec = core.WorkerSpec(
            worker_id=request.worker_id,
            address=request.address,
            model_id=request.model_id,
            spec_mode=spec_mode_from_proto(request.spec_mode),
            mtp_depth=request.mtp_depth or 1,
            block_size=request.block_size,
            num_blocks=request.num_blocks,
            vocab_size=request.vocab_size,
            max_seq_len=request.max_seq_len,
        )
        if not request.held_reservations and not request.held_sequences:
            info = self.store.register_worker(spec)
            await self._committed()
            return pb.RegisterWorkerResponse(worker=_worker_info(info))
        result = self.store.restore_worker(
            spec,
            reservations=[core.HeldReservation(h.reservation_id, h.request_id, h.tokens_packed, h.cache_salt,
                                               tuple(h.block_table), h.published_blocks) for h in request.held_reservations],
            cached=[core.HeldSequence(h.tokens_packed, h.cache_salt, tuple(h.block_ids)) for h in request.held_sequences],
        )
        await self._committed()
        return pb.RegisterWorkerResponse(
            worker=_worker_info(result.worker),
            restored=[_reservation(r) for r in result.restored],
            dropped=[pb.DroppedReservation(reservation_id=rid, reason=why) for rid, why in result.dropped],
            restored_cached_blocks=result.cached_blocks,
        )

    async def ListWorkers(self, request, context):
        return pb.ListWorkersResponse(workers=[_worker_info(w) for w in self.store.list_workers()])

    async def Heartbeat(self, request, context):
        _own_worker(request.worker_id)
        left = self.store.heartbeat(request.worker_id, request.incarnation)
        await self._committed()
        ending = self.store.ending_for(request.worker_id, request.incarnation)
        return pb.HeartbeatResponse(lease_expires_in_s=left, ending_reservation_ids=ending)

    async def GetReservation(self, request, context):
        worker_id = _caller_worker()
        r = self.store.get_reservation(request.reservation_id, request.incarnation, worker_id=worker_id)
        prompt = self.store.reservation_prompt(request.reservation_id, request.incarnation, worker_id=worker_id)
        salt = self.store.reservation_salt(request.reservation_id, request.incarnation, worker_id=worker_id)
        return pb.GetReservationResponse(reservation=_reservation(r), prompt_packed=prompt, cache_salt=salt)

    async def Match(self, request, context):
        tokens = tokens_from_proto(request.tokens)
        results = self.store.match(tokens, cache_salt=request.cache_salt, model_id=request.model_id or None)
        return pb.MatchResponse(
            workers=[
                pb.WorkerMatch(
                    worker_id=m.worker_id,
                    incarnation=m.incarnation,
                    reusable_positions=m.reusable_positions,
                    reusable_blocks=m.reusable_blocks,
                    pool=_pool(m.pool),
                    live_reservations=m.live_reservations,
                )
                for m in results
            ]
        )

    async def Reserve(self, request, context):
        common = dict(
            request_id=request.request_id,
            tokens=tokens_from_proto(request.tokens),
            cache_salt=request.cache_salt,
            headroom_positions=request.headroom_positions,
        )
        if request.candidates:
            if request.worker_id or request.incarnation:
                raise InvalidArgument("set either worker_id/incarnation or candidates, not both")
            r = self.store.reserve_first(candidates=[(c.worker_id, c.incarnation) for c in request.candidates], **common)
        else:
            r = self.store.reserve(worker_id=request.worker_id, incarnation=request.incarnation, **common)
        await self._committed()
        return pb.ReserveResponse(reservation=_reservation(r))

    async def Extend(self, request, context):
        results = self.store.extend(_capacity_items(request.items, core.ExtendItem), worker_id=_caller_worker())
        await self._committed()
        return pb.ExtendResponse(
            results=[_capacity_result(i.reservation_id, r) for i, r in zip(request.items, results)]
        )

    async def Trim(self, request, context):
        results = self.store.trim(_capacity_items(request.items, core.TrimItem), worker_id=_caller_worker())
        await self._committed()
        return pb.TrimResponse(
            results=[_capacity_result(i.reservation_id, r) for i, r in zip(request.items, results)]
        )

    def _publish(self, request, worker_id: str | None) -> pb.PublishResponse:
        result = self.store.publish(
            reservation_id=request.reservation_id,
            incarnation=request.incarnation,
            new_tokens=tokens_from_proto(request.new_tokens, field="new_tokens"),
            final_positions=request.final_positions,
            worker_id=worker_id,
            known_tokens=request.known_tokens,
        )
        return pb.PublishResponse(
            reservation=_reservation(result.reservation),
            newly_published=result.newly_published,
            deduplicated=result.deduplicated,
        )

    async def Publish(self, request, context):
        response = self._publish(request, _caller_worker())
        await self._committed()
        return response

    async def PublishMany(self, request, context):
        validation.items(request.items, self.store.max_items)
        worker_id = _caller_worker()
        results = []
        for item in request.items:  # one Publish each, no await between them: one transaction each
            try:
                results.append(pb.PublishResult(code=0, response=self._publish(item, worker_id)))
            except TandemError as exc:
                results.append(pb.PublishResult(code=exc.code.number, message=exc.message))
        await self._committed()
        return pb.PublishManyResponse(results=results)

    async def _end(self, verb, request) -> pb.ReleaseResponse:
        result = verb(
            reservation_id=request.reservation_id,
            incarnation=request.incarnation,
            new_tokens=tokens_from_proto(request.new_tokens, field="new_tokens"),
            final_positions=request.final_positions,
            worker_id=_caller_worker(),
        )
        await self._committed()
        return pb.ReleaseResponse(
            newly_published=result.newly_published, freed_blocks=result.freed_blocks, deduplicated=result.deduplicated
        )

    async def Release(self, request, context):
        return await self._end(self.store.release, request)

    async def Suspend(self, request, context):
        return await self._end(self.store.suspend, request)

    async def Abort(self, request, context):
        worker_id = acting_worker(current_peer(), request.worker_id)
        aborted = self.store.abort(reservation_id=request.reservation_id, incarnation=request.incarnation,
                                   worker_id=worker_id)
        await self._committed()
        return pb.AbortResponse(aborted=bool(aborted))

    async def Stats(self, request, context):
        s = self.store.stats(request.worker_id or None)
        return pb.StatsResponse(
            workers=[
                pb.WorkerStats(
                    worker_id=w.worker_id,
                    pool=_pool(w.pool),
                    live_reservations=w.live_reservations,
                    requested_positions=w.requested_positions,
                    reused_positions=w.reused_positions,
                    evictions=w.evictions,
                    published_blocks=w.published_blocks,
                    deduplicated_blocks=w.deduplicated_blocks,
                    ending_reservations=w.ending_reservations,
                )
                for w in s.workers
            ],
            matches=s.matches,
            reservations_created=s.reservations_created,
            live_reservations=s.live_reservations,
            ending_reservations=s.ending_reservations,
            trie_nodes=s.trie_nodes,
        )

    async def CheckInvariants(self, request, context):
        violations = self.store.check_invariants()
        return pb.CheckInvariantsResponse(ok=not violations, violations=violations)

    async def WatchEvents(self, request, context):
        if not request.worker_id:
            raise InvalidArgument("worker_id is required")
        queue: asyncio.Queue = asyncio.Queue(maxsize=self._event_queue)
        overflow = False

        def on_event(worker_id: str, event) -> None:
            nonlocal overflow
            if worker_id != request.worker_id or overflow:
                return
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                overflow = True  # a slow reader is cut off rather than stalling the store

        # Subscribe before replaying so nothing falls between the two; seq dedups the overlap.
        unsubscribe = self.store.subscribe(on_event)
        try:
            last = request.after_seq
            for event in self.store.events_since(request.worker_id, request.after_seq):
                last = event.seq
                yield _event(request.worker_id, event)
            while True:
                if overflow:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"event stream fell more than {self._event_queue} events behind; resume with after_seq={last}",
                    )
                event = await queue.get()
                if event.seq <= last:
                    continue
                last = event.seq
                yield _event(request.worker_id, event)
        finally:
            unsubscribe()
