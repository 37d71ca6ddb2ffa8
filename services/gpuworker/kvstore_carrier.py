"""Carriers: where the worker's kvstore verbs are actually sent, one at a time, in the order they came.

The engine thread's :class:`~services.gpuworker.kvstore_courier.KVStoreCourier` decides what is
sent and when (after the step fence of the blocks a verb frees) and applies the answers; a carrier
only runs ``link.<method>(*args)`` for each verb and answers it by sequence number::

    engine thread (courier)                    carrier loop (own KVStoreLink)                kvstore
    put ("verbs", [(seq, kind, method, args), …]) ▶ FIFO ── link.<method>(*args) ────────────▶
    get ◀── ("answer", seq, result or typed error)
        ◀── ("retrying", seq)          an outage: resent in place, with backoff (``retryable``)
        ◀── ("stuck", seq, error)      NOT_FOUND / FAILED_PRECONDITION on a worker verb: did the
    put ("resend", seq, args) ───────▶ kvstore forget us? Only the engine thread knows (it
     or ("give_up", seq)               re-registers and renews incarnations), so it answers with
                                       the verb's arguments built again, or lets the error stand

Two carriers run the same loop: :class:`ThreadCarrier`, a thread of the engine's process (an
engine that shares its process with gRPC anyway, and tests), and :class:`ProcessCarrier`, an OS
process of its own. The second exists because of the GIL: a Python thread that wakes beside the
engine thread on every step (building a PublishMany, gRPC's own wake-ups, applying a fence) cost
the engine thread about twice its own GIL time — 35 % of a served turn at 64 requests and k 3
(``bench/runner_host_bench.py``, docs/benchmarks.md, session 32). Over a pipe the engine thread
pays one pickled message per verb and one per answer, and nothing else competes for its GIL.

This module imports neither torch nor the engine: a spawned carrier process starts in well under
a second.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

from services.common.errors import FailedPrecondition, NotFound, TandemError, Unavailable

log = logging.getLogger(__name__)

# "call" = the step's Extend. Publish carries known_tokens (a resend that landed appends nothing);
# a resent Release that had landed is answered FAILED_PRECONDITION (ended), which is harmless.
IDEMPOTENT_KINDS = frozenset({"extend", "trim", "abort", "call", "publish", "release"})
# gRPC / kvstore texts of UNAVAILABLE answers where the call certainly changed nothing.
_NOT_DELIVERED = ("failed to connect", "connection refused", "connections to all backends failing",
                  "lost its redis lease", "redis lease was taken over", "unreachable past the lease")


def retryable(kind: str, exc: BaseException) -> bool:
    """Whether a failed call of ``kind`` may be sent again as it is (pure). The worker's verbs are
    safe to resend on any UNAVAILABLE (Extend and Trim name a target capacity, Abort is
    idempotent, Publish says how many tokens the kvstore held before it, a resent Release that had
    landed finds the reservation ended); other calls only when they provably changed nothing: no
    kvstore accepted the connection, or the kvstore lost its Redis lease before the change was
    durable."""
    if not isinstance(exc, Unavailable):
        return False
    if kind in IDEMPOTENT_KINDS:
        return True
    text = exc.message.lower()
    return any(marker in text for marker in _NOT_DELIVERED)


def maybe_forgotten(kind: str, exc: BaseException) -> bool:
    """Whether a failed call of ``kind`` may have failed only because the kvstore forgot this
    worker (pure): a worker verb answered NOT_FOUND or FAILED_PRECONDITION."""
    return kind in IDEMPOTENT_KINDS and isinstance(exc, (NotFound, FailedPrecondition))


def portable(exc: BaseException) -> BaseException:
    """``exc`` as it may cross a pipe: typed errors as they are (they pickle), anything else (a
    bug) as a ``RuntimeError`` naming it, which clients see as a bare INTERNAL."""
    return exc if isinstance(exc, TandemError) else RuntimeError(f"{type(exc).__name__}: {exc}")


class LateAnswer(Unavailable):
    """``KVStoreCourier.call`` stopped waiting; the answer goes to its ``on_late`` when it comes."""


class CarrierGone(Unavailable):
    """The carrier stopped answering (its process exited): nothing sent to it will be answered."""


class Carrier(Protocol):
    """The engine thread's end of a carrier. ``put`` never blocks; ``get`` returns the next
    message, or None once ``timeout_s`` passed (0: only what is there); raises
    :class:`CarrierGone` if the carrier is gone."""

    def put(self, message: tuple) -> None: ...

    def get(self, timeout_s: float) -> tuple | None: ...

    def close(self, timeout_s: float = 5.0) -> None: ...


class _CarrierLoop:
    """The loop every carrier runs: take verbs, run them in order, answer each (blocking).

    ``follows``: the link is the carrier's own (a process), so it takes the engine link's
    registration (incarnation, re-registration count) from each message, for ``forgot_us``; a
    thread carrier shares the engine's link and must not."""

    def __init__(self, link, retry_s: float, receive: Callable[[], tuple], answer: Callable[[tuple], None],
                 abandoned: Callable[[], bool] = lambda: False, *, follows: bool = True):
        self.link = link
        self.retry_s = retry_s
        self.stopping = threading.Event()  # close was asked: no more retries (set as soon as it is known)
        self._receive = receive  # blocks until the next message from the engine thread
        self._answer = answer
        self._abandoned = abandoned  # nobody will read our answers any more: stop, even mid-retry
        self._follows = follows
        self._todo: collections.deque = collections.deque()  # [seq, kind, method, args, generation]
        self._closed = False  # the close message was taken: stop once the verbs before it are done
        self._retries = 0

    def run(self) -> None:
        while True:
            while not self._todo:
                if self._closed or self._abandoned():
                    return
                self._take(self._receive())
            if self._abandoned():
                return
            verb = self._todo.popleft()
            self._answer(("answer", verb[0], self._attempt(verb)))

    def _take(self, message: tuple) -> tuple | None:
        """File one message; a resend / give-up is returned to the caller waiting for it."""
        kind = message[0]
        if kind == "verbs":
            _, batch, registration = message
            self._follow(registration)
            self._todo.extend([*verb, registration[1]] for verb in batch)
        elif kind == "close":
            self._closed = True
            self.stopping.set()
        else:
            return message
        return None

    def _follow(self, registration: tuple[int, int]) -> None:
        if self._follows:
            self.link.follow(*registration)

    def _reply_to(self, seq: int) -> tuple | None:
        """Wait for the engine thread's word on a stuck verb (None if we are told to close)."""
        while not self._closed and not self._abandoned():
            reply = self._take(self._receive())
            if reply is not None and reply[1] == seq:
                return reply
        return None

    def _attempt(self, verb: list) -> Any:
        """``link.<method>(*args)``, sent again with backoff (20 ms doubling to 0.1 s: a kvstore
        that is back is used within 0.1 s, and a refused connection costs nothing) while it
        fails in a way that allows it, for up to ``retry_s``; then its last error is the answer.

        A worker verb answered NOT_FOUND / FAILED_PRECONDITION by a kvstore that forgot this
        worker (``KVStoreLink.forgot_us``: one Heartbeat, here, off the engine thread) is
        "stuck": the engine thread builds its arguments again, and those of every verb queued
        behind it from before its re-registration, under the incarnation it holds now."""
        seq, kind, method, args, generation = verb
        deadline = time.monotonic() + self.retry_s
        delay = 0.02
        while True:
            try:
                return getattr(self.link, method)(*args)
            except Exception as exc:  # noqa: BLE001 - the answer, typed
                if self.stopping.is_set() or self._abandoned() or time.monotonic() + delay > deadline:
                    return portable(exc)
                if retryable(kind, exc):
                    if self._retries % 50 == 0:
                        log.warning("kvstore %s failed (%s); retrying for up to %.0f s", kind, exc, self.retry_s)
                    self._answer(("retrying", seq))
                elif maybe_forgotten(kind, exc) and self.link.forgot_us(generation):
                    self._answer(("stuck", seq, portable(exc)))
                    reply = self._reply_to(seq)
                    if reply is None or reply[0] == "give_up":
                        return portable(exc)
                    _, _, rebuilt, registration = reply  # ("resend", seq, {seq: args}, registration)
                    self._follow(registration)
                    for queued in self._todo:
                        if queued[0] in rebuilt:
                            queued[3], queued[4] = rebuilt[queued[0]], registration[1]
                    args = rebuilt[seq]
                    if registration[1] != generation:  # re-registered: the new arguments should land now
                        generation = registration[1]
                        continue
                else:
                    return portable(exc)
                self._retries += 1
                time.sleep(delay)
                delay = min(delay * 2, 0.1)


class ThreadCarrier:
    """A carrier on a daemon thread of this process, over ``link``."""

    def __init__(self, link, *, retry_s: float = 10.0, name: str = "kvstore-carrier"):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.loop = _CarrierLoop(link, retry_s, self._inbox.get, self._outbox.put, follows=False)
        self._thread = threading.Thread(target=self.loop.run, name=name, daemon=True)
        self._thread.start()

    def put(self, message: tuple) -> None:
        self._inbox.put(message)

    def get(self, timeout_s: float) -> tuple | None:
        try:
            return self._outbox.get(timeout=timeout_s) if timeout_s > 0 else self._outbox.get_nowait()
        except queue.Empty:
            return None

    def close(self, timeout_s: float = 5.0) -> None:
        self.loop.stopping.set()  # a verb retrying through an outage gives up now
        self._inbox.put(("close",))
        self._thread.join(timeout_s)


@dataclasses.dataclass(frozen=True)
class LinkRecipe:
    """How a carrier process builds its own kvstore link (plain values: it crosses a spawn)."""

    address: str
    timeout_s: float
    worker_id: str
    settings: dict | None = None  # WorkerSettings fields, for the suite's channel credentials

    def build(self):
        from services.gpuworker.kvstore_link import KVStoreLink

        credentials = None
        if self.settings is not None:
            from services.common.auth import suite_credentials
            from services.gpuworker.settings import WorkerSettings

            _server, credentials = suite_credentials(WorkerSettings(**self.settings))
        link = KVStoreLink(self.address, timeout_s=self.timeout_s, credentials=credentials)
        link.worker_id = self.worker_id  # Abort names its owner
        return link


class ProcessCarrier:
    """A carrier in an OS process of its own, with its own kvstore link built from ``recipe``.

    Started as a plain ``python -P -m services.gpuworker.kvstore_carrier`` over two pipes, not as
    a ``multiprocessing`` child: the engine process that owns it is a daemonic ``multiprocessing``
    child itself, which may not have children of its own that way (``-P``: a ``services`` folder
    in the working directory must not shadow ours). The constructor waits until it is up
    (``CarrierGone`` if it cannot start). It ignores SIGINT and SIGTERM (a Ctrl-C reaches the
    whole process group, and the engine still has Aborts to send while it stops) and exits when
    told to close, or when its parent died."""

    def __init__(self, recipe: LinkRecipe, *, retry_s: float = 10.0, name: str = "kvstore-carrier",
                 start_timeout_s: float = 60.0):
        verbs_in, verbs_out = os.pipe()
        answers_in, answers_out = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # what spawn hands a child
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-P", "-m", "services.gpuworker.kvstore_carrier", str(verbs_in), str(answers_out), name],
                pass_fds=(verbs_in, answers_out), env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            os.close(verbs_out)
            os.close(answers_in)
            raise
        finally:
            os.close(verbs_in)  # only the child holds these now: its exit closes the pipes for us
            os.close(answers_out)
        self._verbs = Connection(verbs_out, readable=False)
        self._answers = Connection(answers_in, writable=False)
        self._gone = False
        self.put(("start", recipe, retry_s, logging.getLogger().getEffectiveLevel()))
        try:
            ready = self.get(start_timeout_s)
        except CarrierGone:
            self.close(0.1)
            raise
        if ready != ("ready",):
            self.close(0.1)
            raise CarrierGone(f"the kvstore carrier process did not start within {start_timeout_s:.0f} s")

    @property
    def pid(self) -> int:
        return self._process.pid

    def put(self, message: tuple) -> None:
        try:
            self._verbs.send(message)
        except (OSError, ValueError):
            self._gone = True  # get() reports it

    def _lost(self) -> CarrierGone:
        self._gone = True
        try:
            code = self._process.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        return CarrierGone(f"the kvstore carrier process exited (exit code {code})")

    def get(self, timeout_s: float) -> tuple | None:
        if self._gone:
            raise self._lost()
        try:
            if not self._answers.poll(timeout_s):
                return None
            return self._answers.recv()
        except Exception:  # noqa: BLE001 - EOF, or a message we cannot read: either way it is lost to us
            raise self._lost() from None

    def close(self, timeout_s: float = 5.0) -> None:
        self.put(("close",))
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            try:
                self._process.wait(5.0)
            except subprocess.TimeoutExpired:
                log.error("the kvstore carrier process %d did not exit after SIGKILL", self._process.pid)
        self._verbs.close()
        self._answers.close()


def _carrier_main(verbs: Connection, answers: Connection) -> None:
    """The carrier process: its first message says how to reach the kvstore."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    _, recipe, retry_s, log_level = verbs.recv()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    link = recipe.build()
    gone = threading.Event()
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    loop: _CarrierLoop

    def abandoned() -> bool:
        return gone.is_set() or os.getppid() != parent  # reparented: the engine process died

    def read() -> None:
        """Empty the pipe as messages come, whatever the loop is doing (retrying through an
        outage, say): the engine thread's sends must never block on a full pipe."""
        while True:
            try:
                message = verbs.recv()
            except Exception:  # noqa: BLE001 - EOF (the engine process is gone) or unreadable: stop
                gone.set()
                inbox.put(("close",))
                return
            if message[0] == "close":
                loop.stopping.set()  # stop retrying now, not when the loop reaches the message
            inbox.put(message)

    def receive() -> tuple:
        while True:  # an idle carrier still notices its parent dying
            try:
                return inbox.get(timeout=1.0)
            except queue.Empty:
                if abandoned():
                    return ("close",)

    def answer(message: tuple) -> None:
        try:
            answers.send(message)
        except (OSError, ValueError):
            pass  # nobody is listening any more

    loop = _CarrierLoop(link, retry_s, receive, answer, abandoned)
    threading.Thread(target=read, name="verbs", daemon=True).start()
    answer(("ready",))
    try:
        loop.run()
    finally:
        link.close()


if __name__ == "__main__":
    _carrier_main(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
