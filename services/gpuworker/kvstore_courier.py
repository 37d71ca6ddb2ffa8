"""The kvstore off the engine's critical path: kvstore verbs go out in the order they were sent,
through a carrier (``kvstore_carrier.py``: a thread, or a process of its own), and their answers
are applied on the engine thread, in that same order.

    engine thread                                      carrier                          kvstore
    ── step N ──▶ send(Publish, after=fence N)         (held: fence N not done)
    ── step N+1 ─▶ send(Extend ahead)  ─ fence N done ─▶ Publish, Extend ─────────────────▶
    drain(): on_done(Publish answer), on_done(Extend answer)   (between steps, FIFO)
    call(Extend, needed now) ─ ships everything before it, waits for its answer, drains ─▶ answer

Why one FIFO and answers applied in order: a Publish may deduplicate, i.e. free one of our blocks
in the kvstore and pin another request's copy. Until the engine adopts the new table it may still
read the freed block, so no block the kvstore hands out after that Publish (an Extend answer, a
new request's reservation) may be written before the Publish's answer has been applied. Extend
answers follow the Publish through this queue; a new request whose table holds a block some
Publish in flight may free (that Publish's fresh blocks, never a reused prefix: the runner's
``_publishing``) is admitted only once that answer is applied.

Why verbs wait here for their step's fence (DESIGN §2: a verb that frees blocks goes out only
after the step that last wrote them completed on the device): the engine thread asks each fence
``done()`` (an event query, no wait) whenever it sends or drains, and ships the verbs at the head
of the queue whose fences are done; it waits on a fence only when it has nothing else to do
(``wait_answer``, ``wait_idle``) or needs an answer now (``call``). Fences complete in order, so a
step's verbs go out at the latest when the next step's verdict has come back.

A verb is a link method's name and a function that builds its arguments when it is shipped, so a
verb queued across a kvstore restart names the incarnation renewed meanwhile. Riding through an
outage is the carrier's (``retryable``), and so is asking whether the kvstore forgot this worker
when a worker verb is answered NOT_FOUND / FAILED_PRECONDITION (``KVStoreLink.forgot_us``, a
Heartbeat: never on the engine thread). If it did (a memory kvstore restarted), the verb comes
back here "stuck", and the engine thread builds its arguments again, with those of every verb
shipped behind it before the worker re-registered, under the incarnation it holds now: one round
trip however many verbs queued up during the outage.

Not thread-safe: the engine thread alone sends, calls and drains.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.gpuworker.engine.fence import COMPLETE, StepFence
from services.gpuworker.kvstore_carrier import Carrier, CarrierGone, LateAnswer

log = logging.getLogger(__name__)

Done = Callable[[Any], None]  # receives the result, or the exception the call raised
Args = Callable[[], tuple]  # builds a verb's arguments when it is shipped


@dataclass(slots=True)
class _Verb:
    seq: int
    kind: str
    method: str  # a KVStoreLink method
    args: Args
    on_done: Done | None
    after: StepFence
    generation: int = 0  # the link's re-registration count when it was shipped (see forgot_us)


class KVStoreCourier:
    """A FIFO of kvstore verbs carried by ``carrier``; ``on_done`` callbacks run on the thread
    that calls :meth:`drain` (the engine thread). Mutates only its own queues."""

    def __init__(self, carrier: Carrier):
        self._carrier = carrier
        self._next_seq = 0
        self._held: collections.deque[_Verb] = collections.deque()  # sent, waiting for their fence
        self._shipped: collections.deque[_Verb] = collections.deque()  # with the carrier, not applied
        self._answers: dict[int, Any] = {}  # seq -> result, arrived, not applied yet
        self._in_flight: collections.Counter = collections.Counter()  # kind -> sent, not drained
        self._closed = False
        self._gone: CarrierGone | None = None
        self.resending = False  # the carrier is resending a verb through an outage right now
        self.retries = 0  # verbs sent again (a counter for tests and logs)
        # Set by the owner of the kvstore link: its registration now, (incarnation, generation =
        # re-registrations with held state so far). Each shipment carries it: a carrier with a link
        # of its own follows it, and a verb the kvstore forgot (a memory kvstore restarted) is
        # resent with its arguments built again once the generation moved (``EngineRunner.reregister``).
        self.registration: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self.on_gone: Callable[[CarrierGone], None] | None = None  # the carrier died (once)

    # -- engine thread ----------------------------------------------------------------------------

    def send(self, kind: str, method: str, args: Args, on_done: Done | None = None, *,
             after: StepFence = COMPLETE) -> None:
        """Queue ``link.<method>(*args())`` (a kvstore call; ``args`` runs when it is shipped),
        to go out at the next :meth:`drain` (or ``call``, ``wait_*``) once ``after`` completed
        (the fence of the step that last wrote the blocks it frees) and everything sent before
        it went: one message carries a turn's verbs. Its result (or exception) reaches
        ``on_done`` at a later :meth:`drain`."""
        if self._closed:
            raise RuntimeError("the kvstore courier is closed")
        self._next_seq += 1
        self._held.append(_Verb(self._next_seq, kind, method, args, on_done, after))
        self._in_flight[kind] += 1  # shipped at the next drain (the engine loop's next turn), with the turn's others

    def call(self, method: str, args: Args, *, wait_s: float | None = None, on_late: Done | None = None) -> Any:
        """Run ``link.<method>(*args())`` after everything sent before it, wait for it, apply
        every earlier answer (``drain``), and return its result or raise its exception.

        With ``wait_s``, wait at most that long (0 while the courier is resending a call through
        an outage makes sense: it would wait behind it): if no answer came, raise ``Unavailable``
        (``LateAnswer``) at once and hand the answer, when it comes, to ``on_late`` at a later
        ``drain`` — the call still happens, in order; only the caller stops waiting for it."""
        box: list = []
        self.send("call", method, args, box.append)
        verb = self._held[-1]
        self._ship(wait=True)
        if not self._receive_until(lambda: self._answered_through(verb.seq), wait_s):
            verb.on_done = on_late
            self.drain()
            raise LateAnswer(f"kvstore did not answer within {wait_s:.2f} s; the call goes on without us")
        self.drain()
        result = box[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def wait_answer(self, timeout_s: float) -> None:
        """Wait until some answer is ready to drain, or ``timeout_s`` passed (an engine with
        nothing it can run waits here instead of spinning). Ships what waits for a fence first,
        waiting for the device if it must."""
        self._ship(wait=True)
        if not self._answers and self._shipped:
            self._receive(timeout_s)
        elif not self._shipped:
            time.sleep(timeout_s)  # nothing will answer: the caller's wait, as asked

    def drain(self, *, ship: bool = True) -> int:
        """Ship what its fence allows (unless ``ship`` is False: a re-registration that will renew
        the incarnations the held verbs name), then apply the answers that arrived, in the order
        their calls were sent. Returns how many."""
        if ship:
            self._ship(wait=False)
        self._receive(0)  # also how a carrier that died is noticed by an idle engine (one poll)
        applied = 0
        while self._shipped and self._shipped[0].seq in self._answers:
            verb = self._shipped.popleft()
            result = self._answers.pop(verb.seq)
            self._in_flight[verb.kind] -= 1
            if verb.on_done is not None:
                verb.on_done(result)
            applied += 1
        return applied

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every sent call has answered, then drain. False on timeout."""
        self._ship(wait=True)
        idle = self._receive_until(lambda: self._answered_through(self._next_seq), timeout_s)
        self.drain()
        return idle

    @property
    def busy(self) -> bool:
        """Calls sent whose answers have not been drained (read-only)."""
        return bool(self._held or self._shipped)

    def in_flight(self, kind: str) -> int:
        """Calls of ``kind`` sent whose answers have not been drained yet."""
        return self._in_flight[kind]

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what was sent (answers are drained by the caller if it wants them) and stop."""
        if self._closed:
            return
        self._ship(wait=True)
        self._closed = True
        self._carrier.close(timeout_s)

    # -- internals (engine thread) ------------------------------------------------------------------

    def _ship(self, *, wait: bool) -> None:
        """Hand the carrier the held verbs whose fences completed, in order, as one message (each
        message costs a pickle and a write that wakes the carrier); with ``wait``, all of them
        (waiting for the device)."""
        if not self._held:
            return
        batch = []
        registration = self.registration()
        while self._held:
            verb = self._held[0]
            if not verb.after.done():
                if not wait:
                    break
                verb.after.wait()
            self._held.popleft()
            self._shipped.append(verb)
            if self._gone is not None:
                self._answers[verb.seq] = self._gone
                continue
            try:
                args = verb.args()
            except Exception as exc:  # noqa: BLE001 - a verb whose arguments cannot be built fails alone
                self._answers[verb.seq] = exc
                continue
            verb.generation = registration[1]
            batch.append((verb.seq, verb.kind, verb.method, args))
        if batch:
            self._carrier.put(("verbs", batch, registration))

    def _answered_through(self, seq: int) -> bool:
        """Every verb shipped up to ``seq`` has its answer here (``drain`` can apply them all)."""
        return all(v.seq in self._answers for v in self._shipped if v.seq <= seq)

    def _receive_until(self, done: Callable[[], bool], timeout_s: float | None) -> bool:
        """Take the carrier's messages until ``done()`` or ``timeout_s`` passed (None: no limit);
        whether it is done."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not done():
            remaining = 1.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._receive(remaining)
        return True

    def _receive(self, timeout_s: float) -> None:
        """Take the carrier's messages: the first waiting up to ``timeout_s``, then what is there."""
        try:
            message = self._carrier.get(timeout_s)
            while message is not None:
                self._take(message)
                message = self._carrier.get(0)
        except CarrierGone as exc:
            self._lost(exc)

    def _take(self, message: tuple) -> None:
        kind, seq = message[0], message[1]
        if kind == "answer":
            self._answers[seq] = message[2]
            self.resending = False
        elif kind == "retrying":
            self.resending = True
            self.retries += 1
        elif kind == "stuck":
            # the carrier found the kvstore forgot us: build the stuck verb's arguments again, and
            # those of every verb shipped behind it before the worker re-registered, in one reply
            self.resending = True
            self.retries += 1
            registration = self.registration()
            rebuilt = {}
            for verb in self._shipped:
                if verb.seq not in self._answers and (verb.seq == seq or verb.generation != registration[1]):
                    try:
                        rebuilt[verb.seq] = verb.args()
                    except Exception:  # noqa: BLE001 - its first arguments stand; its error will too
                        continue
                    verb.generation = registration[1]
            if seq in rebuilt:
                self._carrier.put(("resend", seq, rebuilt, registration))
            else:
                self._carrier.put(("give_up", seq))

    def _lost(self, exc: CarrierGone) -> None:
        """The carrier died: every verb it held is answered with that, and so is every later one."""
        if self._gone is not None:
            return
        self._gone = exc
        log.error("%s", exc.message)
        for verb in self._shipped:
            self._answers.setdefault(verb.seq, exc)
        if self.on_gone is not None:
            self.on_gone(exc)

