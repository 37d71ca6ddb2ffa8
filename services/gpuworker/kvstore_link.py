"""The worker's side of the kvstore contract, over synchronous gRPC.

* :class:`KVStoreLink` — register (new incarnation), heartbeat, and the reservation verbs
  (Publish, Extend, Trim, Release, Abort), which the courier's carrier calls (a thread, or a
  process of its own, so arguments and answers are plain values). Every call has a deadline.
* :class:`ReservationBlockSource` — the engine's ``BlockSource`` protocol mapped onto ONE batched
  ``Extend`` and ONE batched ``Trim`` RPC per step (request id → reservation id), both carried by
  the worker's :class:`~services.gpuworker.kvstore_courier.KVStoreCourier`: the step waits for an
  Extend (it needs the blocks now, and ahead-of-need Extends make that rare) but not for a Trim.

Called from a carrier (reservation verbs) and the heartbeat thread (lease); gRPC stubs
are thread-safe and this module holds no other shared mutable state except the incarnation,
which only :meth:`KVStoreLink.register` changes.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, NamedTuple, Protocol

import grpc

from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TandemError,
    Unavailable,
)
from services.common.channels import open_sync_channel
from services.common.spec import SpecMode
from services.common.wire import spec_mode_to_proto, tokens_to_proto
from services.gpuworker.kvstore_carrier import LateAnswer
from tandem.kvstore.v1 import kvstore_pb2 as kv
from tandem.kvstore.v1 import kvstore_pb2_grpc

if TYPE_CHECKING:  # a carrier process imports this module: no torch, no engine at run time
    from services.gpuworker.engine.fence import StepFence
    from services.gpuworker.kvstore_courier import KVStoreCourier

log = logging.getLogger(__name__)

_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}
_ITEM_ERRORS = {3: InvalidArgument, 5: NotFound, 7: PermissionDenied, 8: ResourceExhausted, 9: FailedPrecondition}


def _item_error(result) -> TandemError:
    """The typed error of one failed item of a batched call (its status code and message)."""
    return _ITEM_ERRORS.get(result.code, Unavailable)(f"kvstore: {result.message}")


def domain_error(err: grpc.RpcError) -> TandemError:
    """A kvstore RPC failure as a typed domain error (anything unexpected is UNAVAILABLE)."""
    cls = _ERRORS.get(err.code(), Unavailable)
    return cls(f"kvstore: {err.details()}")


class KVStoreLink:
    """Synchronous kvstore client for one worker identity."""

    def __init__(self, address: str, *, timeout_s: float = 5.0, channel: grpc.Channel | None = None,
                 credentials: grpc.ChannelCredentials | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = channel or open_sync_channel(address, credentials=credentials)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self.incarnation = 0
        self.worker_id = ""  # set by register: Abort names it (the owner confirms, see kvstore Abort)
        self.generation = 0  # re-registrations with held state so far (see forgot_us)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise domain_error(err) from None

    # -- registry ---------------------------------------------------------------------------------

    def register(
        self,
        *,
        worker_id: str,
        address: str,
        model_id: str,
        spec_mode: SpecMode,
        mtp_depth: int,
        block_size: int,
        num_blocks: int,
        vocab_size: int,
        max_seq_len: int,
    ) -> kv.WorkerInfo:
        """Register (or re-register) and remember the new incarnation."""
        response = self._call(
            self._stub.RegisterWorker,
            kv.RegisterWorkerRequest(
                worker_id=worker_id,
                address=address,
                model_id=model_id,
                spec_mode=spec_mode_to_proto(spec_mode),
                mtp_depth=mtp_depth,
                block_size=block_size,
                num_blocks=num_blocks,
                vocab_size=vocab_size,
                max_seq_len=max_seq_len,
            ),
        )
        with self._lock:
            self.incarnation = response.worker.incarnation
            self.worker_id = worker_id
        return response.worker

    def restore(self, registration: dict, held_reservations: list[kv.HeldReservation],
                held_sequences: list[kv.HeldSequence]) -> kv.RegisterWorkerResponse:
        """Re-register after the kvstore forgot this worker, re-announcing what it still holds
        (``registration``: the keyword arguments of :meth:`register`); remembers the new
        incarnation. The answer lists the reservations re-created and those dropped."""
        request = kv.RegisterWorkerRequest(
            **{k: v for k, v in registration.items() if k != "spec_mode"},
            spec_mode=spec_mode_to_proto(registration["spec_mode"]),
            held_reservations=held_reservations,
            held_sequences=held_sequences,
        )
        response = self._call(self._stub.RegisterWorker, request)
        self.adopt(registration["worker_id"], response.worker.incarnation, restored=True)
        return response

    def adopt(self, worker_id: str, incarnation: int, *, restored: bool = False) -> None:
        """Take a registration another link made for this worker (an engine process and its gRPC
        process each hold a link): the incarnation, and with ``restored`` one more generation
        (see :meth:`forgot_us`), as :meth:`restore` would have counted it."""
        with self._lock:
            self.worker_id = worker_id
            self.incarnation = incarnation
            if restored:
                self.generation += 1

    def follow(self, incarnation: int, generation: int) -> None:
        """Take the registration of the link that owns it (a carrier process's link follows the
        engine's): the incarnation Heartbeats name, and the re-registration count ``forgot_us``
        compares with."""
        with self._lock:
            self.incarnation = incarnation
            self.generation = generation

    def forgot_us(self, generation: int) -> bool:
        """Whether a verb sent at ``generation`` that the kvstore answered NOT_FOUND or
        FAILED_PRECONDITION may have failed only because the kvstore forgot this worker: we
        re-registered since, or the kvstore does not know our incarnation now (a memory kvstore
        restarted; the heartbeat re-registers us). The kvstore cannot tell this apart itself — a
        fresh memory kvstore never saw the reservation — so the worker asks (one Heartbeat)."""
        if generation != self.generation:
            return True
        try:
            self.heartbeat(self.worker_id)
        except (NotFound, FailedPrecondition, Unavailable):
            return True
        return generation != self.generation

    def heartbeat(self, worker_id: str) -> kv.HeartbeatResponse:
        """Extend the lease; the answer lists reservations the router ended (to stop and confirm)."""
        return self._call(self._stub.Heartbeat, kv.HeartbeatRequest(worker_id=worker_id, incarnation=self.incarnation))

    # -- reservation verbs ------------------------------------------------------------------------

    def publish_many(self, items: list[tuple[str, int, list[int], int, int]],
                     expected: list[tuple[int, int]] | None = None) -> list[PublishAnswer | TandemError | None]:
        """One PublishMany of ``items`` (reservation id, incarnation, new tokens, final positions,
        known tokens — ``known_tokens`` is what the kvstore holds before the new ones, which makes a
        resend safe): per item its answer, or its error as a typed domain error. An item of
        incarnation 0 (its reservation died with a memory kvstore) is not sent and answers None.
        A call whose every item failed NOT_FOUND / FAILED_PRECONDITION raises that error
        instead, as a lone Publish would: the courier then asks whether the kvstore forgot this
        worker (a restart) and resends the whole batch once it re-registered.

        ``expected``, per item: (n, ``table_digest`` of the caller's first n table blocks), n
        the blocks this Publish publishes — the only positions a Publish can move. An answer
        that deduplicated nothing and whose first n blocks are what the caller holds carries no
        table (``block_table`` None): the caller's table is current. Anything else carries the
        whole table: a dedup, a resend whose lost first answer deduplicated, a kvstore that lost
        an acknowledged Publish (Redis ``everysec``) and publishes those blocks again. (The caller
        checks an answer without a table against what it holds when it applies it: a remap
        applied since, which the kvstore's table does not show, means the kvstore lost it.)
        (16 tables of ~70 ids a step at c 64 were most of what crossed the carrier's pipe.)"""
        sent = [i for i, item in enumerate(items) if item[1]]
        if not sent:
            return [None] * len(items)
        request = kv.PublishManyRequest(items=[
            kv.PublishRequest(reservation_id=rid, incarnation=inc, new_tokens=tokens_to_proto(new), final_positions=final,
                              known_tokens=known) for rid, inc, new, final, known in (items[i] for i in sent)])
        results = self._call(self._stub.PublishMany, request).results
        if len(results) != len(sent):
            raise Unavailable(f"kvstore: PublishMany answered {len(results)} results for {len(sent)} items")
        answers = [_publish_answer(r.response, expected[i] if expected is not None else None)
                   if r.code == 0 else _item_error(r) for i, r in zip(sent, results)]
        if all(isinstance(a, (NotFound, FailedPrecondition)) for a in answers):
            raise answers[0]
        if len(sent) == len(items):
            return answers
        back = iter(answers)
        return [next(back) if item[1] else None for item in items]

    def release(self, reservation_id: str, incarnation: int, new_tokens, final_positions: int) -> bool:
        """End the reservation, publishing what it computed. Incarnation 0 (it died with a memory
        kvstore): nothing is sent, False."""
        if not incarnation:
            return False
        self._call(
            self._stub.Release,
            kv.ReleaseRequest(
                reservation_id=reservation_id,
                incarnation=incarnation,
                new_tokens=tokens_to_proto(new_tokens),
                final_positions=final_positions,
            ),
        )
        return True

    def abort(self, reservation_id: str, incarnation: int) -> None:
        """Abort, tolerating a reservation the kvstore already dropped (lease lapse, restart;
        incarnation 0: it died with a memory kvstore, nothing is sent)."""
        if not incarnation:
            return
        try:
            self._call(self._stub.Abort, kv.AbortRequest(reservation_id=reservation_id, incarnation=incarnation,
                                                         worker_id=self.worker_id))
        except (NotFound, FailedPrecondition) as exc:
            log.info("abort of %s: %s", reservation_id, exc.message)

    def extend(self, items: list[tuple[str, int, int]]) -> list[CapacityAnswer]:
        """One Extend of ``items`` (reservation id, incarnation, capacity in positions)."""
        return _capacity(self._call(self._stub.Extend, kv.ExtendRequest(items=_capacity_items(items))).results)

    def trim(self, items: list[tuple[str, int, int]]) -> list[CapacityAnswer]:
        """One Trim of ``items`` (reservation id, incarnation, capacity kept in positions)."""
        return _capacity(self._call(self._stub.Trim, kv.TrimRequest(items=_capacity_items(items))).results)


class PublishAnswer(NamedTuple):
    """What a Publish answers that the worker uses (plain values: answers cross a pipe)."""

    published_blocks: int
    # the reservation's table, deduplicated blocks remapped; None: the blocks the Publish
    # published are the ones the caller holds (see KVStoreLink.publish_many's ``expected``)
    block_table: list[int] | None


def table_digest(blocks) -> int:
    """A digest of block ids that every process of the worker computes alike (the hash of a tuple
    of ints is not salted per process, unlike a str's). Tables differing in one block never
    share one; others about once in 2**61 comparisons."""
    return hash(tuple(blocks))


def _publish_answer(response, expected: tuple[int, int] | None) -> PublishAnswer:
    reservation = response.reservation
    table = reservation.block_table
    if expected is not None and not response.deduplicated:
        n, digest = expected
        if len(table) >= n and table_digest(table[:n]) == digest:  # a repeated field's slice is a list
            return PublishAnswer(reservation.published_blocks, None)
    return PublishAnswer(reservation.published_blocks, list(table))


class CapacityAnswer(NamedTuple):
    """One item of an Extend or Trim answer (plain values: answers cross a pipe)."""

    code: int  # 0 = OK, else a gRPC status code
    message: str
    block_table: list[int]


def _capacity_items(items: list[tuple[str, int, int]]) -> list[kv.CapacityItem]:
    return [kv.CapacityItem(reservation_id=rid, incarnation=inc, capacity_positions=cap) for rid, inc, cap in items]


def _capacity(results) -> list[CapacityAnswer]:
    return [CapacityAnswer(r.code, r.message, list(r.block_table)) for r in results]


class ReservationRef(Protocol):
    """What a binding must have: the reservation's id and its current incarnation."""

    reservation_id: str
    incarnation: int


class ReservationBlockSource:
    """``BlockSource`` over kvstore Extend/Trim: request id → its reservation.

    ``bind``/``unbind`` are called by the engine thread when a request joins or leaves; the engine
    calls ``extend``/``trim`` at most once each per step. A binding is the request's own record
    (the runner's ``Job``: anything with ``reservation_id`` and ``incarnation``), read when a
    call is sent, not copied: a reservation re-created under a new incarnation (kvstore restart)
    is named by its new one in every call queued after the owner updated it.
    """

    def __init__(self, courier: KVStoreCourier, *, step_wait_s: float = 1.0):
        self._courier = courier
        self._bound: dict[str, ReservationRef] = {}  # request id -> its owner's record
        self.step_wait_s = step_wait_s  # longest a step waits for its own Extend
        self.pending: set[str] = set()  # requests whose step Extend answers late (see extend)
        # Set by the runner: every table the kvstore hands out passes through on_table (its own
        # blocks are about to be written); late step-Extend answers go to on_late.
        self.on_table = None
        self.on_late = None

    def bind(self, request_id: str, binding: ReservationRef) -> None:
        self._bound[request_id] = binding

    def unbind(self, request_id: str) -> None:
        self._bound.pop(request_id, None)

    def _items(self, wants: dict[str, int]):
        """(request ids, a function building the items when the call is sent): the incarnation
        is read then, so a call queued across a kvstore restart names the new one."""
        rids = list(wants)
        bindings = [self._bound[rid] for rid in rids]
        caps = [wants[rid] for rid in rids]

        def items() -> tuple[list[tuple[str, int, int]]]:  # link.extend / link.trim's arguments
            return ([(b.reservation_id, b.incarnation, c) for b, c in zip(bindings, caps)],)

        return rids, items

    def extend_request(self, wants: dict[str, int]):
        """The request ids and an Extend-items builder for ``wants`` (request id → positions)."""
        return self._items(wants)

    def extend(self, wants: dict[str, int]) -> dict[str, list[int] | Exception]:
        """After every kvstore call sent before it (see the courier), waiting at most
        ``step_wait_s`` (not at all while the courier resends through an outage): a request
        whose answer is late gets ``Unavailable`` — the engine runs it in the capacity it holds,
        or not this step — and the answer is adopted when it comes (``on_late``)."""
        rids = [rid for rid in wants if rid not in self.pending]
        if not rids:
            return {rid: Unavailable("kvstore: an Extend for this request is pending") for rid in wants}
        rids, items = self._items({rid: wants[rid] for rid in rids})
        wait_s = 0.0 if self._courier.resending else self.step_wait_s

        def late(results) -> None:
            self.pending.difference_update(rids)
            if self.on_late is not None:
                self.on_late(rids, results)

        self.pending.update(rids)
        try:
            results = self._courier.call("extend", items, wait_s=wait_s, on_late=late)
        except LateAnswer as exc:  # still pending: ``late`` takes it off when the answer comes
            return {rid: exc for rid in wants}
        except TandemError as exc:  # the whole call failed: every item failed, nothing changed
            self.pending.difference_update(rids)
            return {rid: exc for rid in wants}
        self.pending.difference_update(rids)
        answers = capacity_answers(rids, results)
        if self.on_table is not None:
            for rid, answer in answers.items():
                if not isinstance(answer, Exception):
                    self.on_table(rid, answer)
        for rid in wants:  # those with an Extend still pending run in what they hold
            answers.setdefault(rid, Unavailable("kvstore: an Extend for this request is pending"))
        return answers

    def trim(self, keeps: dict[str, int], *, after: StepFence | None = None) -> dict[str, list[int]]:
        """Sent once ``after`` completed, not waited for: the engine cuts its tables as asked
        (answers nothing). A failed trim leaves the reservation as it was: keeping blocks is
        always safe."""
        rids, items = self._items(keeps)

        def done(results) -> None:
            if isinstance(results, Exception):
                log.warning("trim of %d reservations failed: %s", len(rids), results)
                return
            for rid, result in zip(rids, results):
                if result.code != 0:
                    log.warning("trim of %s failed: %s", rid, result.message)

        if after is None:
            self._courier.send("trim", "trim", items, done)
        else:
            self._courier.send("trim", "trim", items, done, after=after)
        return {}


def capacity_answers(rids: list[str], results) -> dict[str, list[int] | Exception]:
    """Per request: its new block table, or the item's error as a typed domain error."""
    out: dict[str, list[int] | Exception] = {}
    for rid, result in zip(rids, results):
        if result.code == 0:
            out[rid] = list(result.block_table)
        else:
            out[rid] = _item_error(result)
    return out
