"""The kvstore off the engine's critical path: one background thread carries kvstore verbs in
the order they were sent, and their answers are applied on the engine thread, in that same order.

    engine thread                      courier thread                    kvstore
    ── step N ──▶ send(Publish) ──────▶ Publish ─────────────────────────▶
    ── step N+1 ─▶ send(Extend ahead) ─▶ Extend ──────────────────────────▶
    drain(): on_done(Publish answer), on_done(Extend answer)   (between steps, FIFO)
    call(Extend, needed now) ─ waits for everything before it, then drains ─▶ answer

Why one FIFO and answers applied in order: a Publish may deduplicate, i.e. free one of our blocks
in the kvstore and pin another request's copy. Until the engine adopts the new table it may still
read the freed block, so no block the kvstore hands out after that Publish (an Extend answer, a
new request's reservation) may be written before the Publish's answer has been applied. Extend
answers follow the Publish through this queue; a new request whose table holds a block some
Publish in flight may free (that Publish's fresh blocks, never a reused prefix: the runner's
``_publishing``) is admitted only once that answer is applied.

Riding through a kvstore outage (a failover to a standby, a restart): a call that failed
because no kvstore took it is retried in place, with backoff, for up to ``retry_s``, so the FIFO
order holds and the engine sees an answer, not the outage. Which failures are retried depends on
the verb: the worker's verbs are safe to resend on any UNAVAILABLE (Extend and Trim name a target
capacity, Abort is idempotent, Publish says how many tokens the kvstore held before it, a
resent Release that had landed finds the reservation ended); other calls only when they
provably changed nothing — no kvstore accepted the connection, or the kvstore answered that it
lost its Redis lease before the change was durable.

Not thread-safe except ``send``/``call`` internals: the engine thread alone sends, calls and
drains.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from services.common.errors import FailedPrecondition, NotFound, Unavailable
from services.gpuworker.engine.fence import COMPLETE, StepFence

log = logging.getLogger(__name__)

Done = Callable[[Any], None]  # receives the result, or the exception the call raised

# "call" = the step's Extend. Publish carries known_tokens (a resend that landed appends nothing);
# a resent Release that had landed is answered FAILED_PRECONDITION (ended), which is harmless.
IDEMPOTENT_KINDS = frozenset({"extend", "trim", "abort", "call", "publish", "release"})
# gRPC / kvstore texts of UNAVAILABLE answers where the call certainly changed nothing.
_NOT_DELIVERED = ("failed to connect", "connection refused", "connections to all backends failing",
                  "lost its redis lease", "redis lease was taken over", "unreachable past the lease")


class LateAnswer(Unavailable):
    """``call`` stopped waiting; the answer goes to its ``on_late`` when it comes."""


def retryable(kind: str, exc: BaseException) -> bool:
    """Whether a failed call of ``kind`` may be sent again (pure; see the module docstring)."""
    if not isinstance(exc, Unavailable):
        return False
    if kind in IDEMPOTENT_KINDS:
        return True
    text = exc.message.lower()
    return any(marker in text for marker in _NOT_DELIVERED)


class KVStoreCourier:
    """A FIFO of kvstore calls run by one daemon thread; ``on_done`` callbacks run on the thread
    that calls :meth:`drain` (the engine thread). Mutates only its own queues."""

    def __init__(self, name: str = "kvstore-courier", *, retry_s: float = 10.0):
        self.retry_s = retry_s  # how long one call is retried through a kvstore outage
        self.retries = 0  # calls sent again (a counter for tests and logs)
        self._cond = threading.Condition()
        self._todo: collections.deque = collections.deque()  # (fn, on_done, kind, after)
        self._done: collections.deque = collections.deque()  # (result, on_done, kind), FIFO
        self._in_flight: collections.Counter = collections.Counter()  # kind -> sent, not drained
        self._closed = False
        self.on_answer: Callable[[], None] | None = None  # called (courier thread) when an answer is ready to drain
        self._resending = False
        # Set by the owner of the kvstore link: (generation) -> whether a reservation verb that
        # failed NOT_FOUND / FAILED_PRECONDITION failed only because the kvstore forgot this
        # worker (a memory kvstore restarted): it is then resent, once the worker re-registered
        # with what it holds (``EngineRunner.reregister``), under the new incarnation.
        self.forgot_us: Callable[[int], bool] | None = None
        self.generation: Callable[[], int] = lambda: 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- engine thread ----------------------------------------------------------------------------

    def send(self, fn: Callable[[], Any], on_done: Done | None = None, kind: str = "other",
             after: StepFence = COMPLETE) -> None:
        """Queue ``fn`` (a blocking kvstore call), to run once ``after`` completed (the fence of
        the step that last wrote blocks ``fn`` frees: the courier thread waits, not the engine).
        Its result (or exception) reaches ``on_done`` at a later :meth:`drain`."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the kvstore courier is closed")
            self._todo.append((fn, on_done, kind, after))
            self._in_flight[kind] += 1
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any], *, wait_s: float | None = None, on_late: Done | None = None) -> Any:
        """Run ``fn`` after everything sent before it, wait for it, apply every earlier answer
        (``drain``), and return its result or raise its exception.

        With ``wait_s``, wait at most that long (0 while the courier is resending a call through
        an outage makes sense: it would wait behind it): if no answer came, raise ``Unavailable``
        (``LateAnswer``) at once and hand the answer, when it comes, to ``on_late`` at a later ``drain`` — the
        call still happens, in order; only the caller stops waiting for it."""
        box: list = []
        late = [False]

        def on_done(result) -> None:
            if not late[0]:
                box.append(result)
            elif on_late is not None:
                on_late(result)

        self.send(fn, on_done, kind="call")
        with self._cond:
            answered = self._cond.wait_for(lambda: any(d[1] is on_done for d in self._done), wait_s)
            late[0] = not answered  # on_done runs only in drain (this thread): no race
        self.drain()
        if not box:
            raise LateAnswer(f"kvstore did not answer within {wait_s:.2f} s; the call goes on without us")
        result = box[0]
        if isinstance(result, BaseException):
            raise result
        return result

    @property
    def resending(self) -> bool:
        """A call is being resent through a kvstore outage right now (read-only, racy by design:
        a hint for callers deciding whether to wait)."""
        return self._resending

    def wait_answer(self, timeout_s: float) -> None:
        """Wait until some answer is ready to drain, or ``timeout_s`` passed (an engine with
        nothing it can run waits here instead of spinning)."""
        with self._cond:
            self._cond.wait_for(lambda: self._done or self._closed, timeout_s)

    def drain(self) -> int:
        """Apply the answers that arrived, in the order their calls were sent. Returns how many."""
        applied = 0
        while True:
            with self._cond:
                if not self._done:
                    return applied
                result, on_done, kind = self._done.popleft()
                self._in_flight[kind] -= 1
            if on_done is not None:
                on_done(result)
            applied += 1

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every sent call has answered, then drain. False on timeout."""
        with self._cond:
            idle = self._cond.wait_for(lambda: not self._todo and sum(self._in_flight.values()) == len(self._done), timeout_s)
        self.drain()
        return idle

    def in_flight(self, kind: str) -> int:
        """Calls of ``kind`` sent whose answers have not been drained yet."""
        with self._cond:
            return self._in_flight[kind]

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish what was sent (answers are drained by the caller if it wants them) and stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # -- courier thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._todo or self._closed)
                if not self._todo:
                    return
                fn, on_done, kind, after = self._todo.popleft()
            try:
                after.wait()
                result = self._attempt(fn, kind)
            except Exception as exc:  # noqa: BLE001 - handed to on_done, which decides
                result = exc
            self._resending = False
            with self._cond:
                self._done.append((result, on_done, kind))
                self._cond.notify_all()
            if self.on_answer is not None:
                self.on_answer()

    def _forgotten(self, kind: str, exc: BaseException, generation: int) -> bool:
        return (kind in IDEMPOTENT_KINDS and isinstance(exc, (NotFound, FailedPrecondition))
                and self.forgot_us is not None and self.forgot_us(generation))

    def _attempt(self, fn: Callable[[], Any], kind: str) -> Any:
        """``fn()``, sent again with backoff (20 ms doubling to 0.1 s: a kvstore that is back is
        used within 0.1 s, and a refused connection costs nothing) while it fails in a way
        ``retryable`` allows, for up to ``retry_s``; then its last error is raised."""
        deadline = time.monotonic() + self.retry_s
        delay = 0.02
        while True:
            generation = self.generation()
            try:
                return fn()
            except Exception as exc:
                if not (retryable(kind, exc) or self._forgotten(kind, exc, generation)):
                    raise
                if time.monotonic() + delay > deadline or self._closed:
                    raise
                if self.retries % 50 == 0:
                    log.warning("kvstore %s failed (%s); retrying for up to %.0f s", kind, exc, self.retry_s)
                self.retries += 1
                self._resending = True
                time.sleep(delay)
                delay = min(delay * 2, 0.1)

