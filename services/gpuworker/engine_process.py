"""The engine in an OS process of its own, so that it does not share a GIL with gRPC streaming.

    gRPC process (asyncio: Generate handlers)            engine process
    EngineProcess.submit/cancel ──("add"|"abort")──────────────▶ EngineRunner's thread (its inbox,
    EngineProcess._call/stop ────("call"|"stop")──▶ command thread    read between two steps)
          ▲                                          (runs the runner method, answers)
          │                                                               │ steps, kvstore verbs
          └── reader thread ◀── ("events", [(request id, event)], disowned, running, tallies, idle s)
                            ◀── ("answer", call id, ok, value)
              one "events" message per engine-loop turn; delivered once per asyncio loop

Requests go on a pipe of their own that the engine thread polls itself: a command thread woken by
each of them needed the GIL three times or more (each read, the unpickling, the queue), each
time waiting for the engine thread, which holds it for nearly all of a host-bound step; at c 64
k 3 that is two requests a step. Since that pipe is read only between steps, its sends never
block the event loop: what does not fit waits in a backlog (``_RequestSender``).

With the engine thread and the gRPC event loop in one process, the engine held the GIL 57 % of
the time at 64 concurrent streams and gRPC 36 % (py-spy, H200): the served path ran at 0.62 of
the engine alone. vLLM (``EngineCore`` over ZMQ) and SGLang (scheduler process) split the same
way. Here the split is one-way ``multiprocessing`` pipes and pickled plain values: a turn's
events, tokens as int lists, typed errors (anything else travels as a ``RuntimeError``, which
clients see as a bare INTERNAL).

The engine process builds and warms up the engine (``runtime.build_runtime``), holds its own
kvstore link for the reservation verbs (Publish, Extend, Trim, Release, Abort) and answers with
:class:`~services.gpuworker.runtime.EngineFacts` once it is ready. The gRPC process keeps
registration, heartbeats and ``GetReservation``. If either side dies the other notices the
closed pipe: the engine process stops (aborting its reservations) when the gRPC process is gone;
the gRPC process fails every running request with UNAVAILABLE and ``on_exit`` stops the worker,
so a supervisor restarts it as a new incarnation.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import multiprocessing
import os
import select
import struct
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from services.common.errors import AlreadyExists, TandemError, Unavailable
from services.common.startup import StartupError
from services.gpuworker.metrics import StepTally
from services.gpuworker.runner import Job, Outbox, _deliver
from services.gpuworker.runtime import EngineFacts
from services.gpuworker.settings import WorkerSettings

log = logging.getLogger(__name__)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Sender:
    """One end of a pipe that several threads send on (``Connection.send`` is not thread-safe).
    A send to a process that is gone is dropped: its reader or supervisor notices the EOF."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple) -> None:
        with self._lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                pass


class _RequestSender:
    """The request pipe's sending end, which never blocks its caller (the gRPC process's event
    loop). The engine thread reads that pipe only between steps, so a long prompt, or several at
    once, can fill the pipe's buffer (64 KiB) while a step runs: what does not fit waits in a
    backlog that a thread of its own writes, in order, as the reader makes room; later messages
    queue behind it. Frames are ``multiprocessing.Connection``'s (a 4-byte big-endian length, or
    -1 and 8 bytes beyond 2 GiB), so the reader is a plain ``Connection``. A message to a process
    that is gone is dropped: its reader or supervisor notices the EOF."""

    def __init__(self, conn: Connection):
        self._conn = conn  # owns the fd
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self._lock = threading.Lock()
        self._has_backlog = threading.Condition(self._lock)
        self._backlog: collections.deque[memoryview] = collections.deque()
        self._closed = False
        self._writer: threading.Thread | None = None

    def send(self, message: tuple) -> None:
        payload = ForkingPickler.dumps(message)
        n = len(payload)
        header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
        frame: memoryview | None = memoryview(header + payload)
        with self._lock:
            if self._closed:
                return
            if not self._backlog:  # the usual case: it fits now, written by the caller
                frame = self._write(frame)
                if frame is None:
                    return
            self._backlog.append(frame)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_backlog, name="engine-requests", daemon=True)
                self._writer.start()
            self._has_backlog.notify()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._backlog.clear()
            self._has_backlog.notify()
        self._conn.close()

    def _write(self, frame: memoryview) -> memoryview | None:
        """Write what fits now (lock held): the rest, or None when all of it went (or the
        reader is gone, which drops the backlog)."""
        try:
            n = os.write(self._fd, frame)
        except BlockingIOError:
            return frame
        except OSError:
            self._closed = True
            self._backlog.clear()
            return None
        return frame[n:] if n < len(frame) else None

    def _write_backlog(self) -> None:
        room = select.poll()  # not select(): it fails for an fd numbered 1024 or more
        room.register(self._fd, select.POLLOUT)
        while True:
            with self._lock:
                while not self._backlog and not self._closed:
                    self._has_backlog.wait()
                if self._closed:
                    return
            try:
                room.poll(1000)  # room, or a second gone: look at _closed again
            except OSError:  # closed meanwhile
                return
            with self._lock:
                if self._closed or not self._backlog:
                    continue
                rest = self._write(self._backlog[0])
                if self._closed:
                    return
                if rest is None:
                    self._backlog.popleft()
                else:
                    self._backlog[0] = rest


class EngineProcess:
    """The gRPC side's handle on an engine process: the public surface of
    :class:`~services.gpuworker.runner.EngineRunner` (``submit``, ``cancel``, ``running``,
    ``running_ids``, ``stop``). ``submit``/``cancel`` may be called from any thread."""

    def __init__(self, settings: WorkerSettings, *, metrics: bool = False,
                 on_tally: Callable[[StepTally], None] | None = None,
                 on_idle: Callable[[float], None] | None = None, on_exit: Callable[[], None] | None = None):
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        self._cmd = _Sender(cmd_send)
        jobs_recv, jobs_send = ctx.Pipe(duplex=False)
        self._requests = _RequestSender(jobs_send)  # "add" / "abort": read by the engine thread itself
        self._events, evt_send = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=_engine_main, name=f"engine-{settings.worker_id}", daemon=True,
            args=(settings.model_dump(), metrics, cmd_recv, jobs_recv, evt_send, logging.getLogger().getEffectiveLevel()),
        )
        self._child_ends = (cmd_recv, jobs_recv, evt_send)
        self._on_tally = on_tally
        self._on_idle = on_idle
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}  # submitted, reservation not ended yet (the engine says when)
        self._running = 0
        self._stopping = False
        self.exited = False  # the engine process ended without being asked to
        self._reader: threading.Thread | None = None
        self._calls: dict[int, concurrent.futures.Future] = {}  # call id -> its answer, from the reader
        self._next_call = 0
        self.facts: EngineFacts | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> EngineFacts:
        """Start the process and wait until its engine is built and warmed up (which may take
        minutes: the model loads, kernels compile, graphs are captured). ``StartupError`` if it
        cannot."""
        self._process.start()
        for end in self._child_ends:
            end.close()  # only the child holds them now: its exit closes the pipe for us
        try:
            message = await asyncio.to_thread(self._events.recv)
        except (EOFError, OSError):
            await asyncio.to_thread(self._process.join, 5.0)
            raise StartupError(f"the engine process exited during start-up (exit code {self._process.exitcode})") from None
        if message[0] == "failed":
            await asyncio.to_thread(self._process.join, 5.0)
            raise StartupError(message[1], message[2])
        self.facts = message[1]
        self._reader = threading.Thread(target=self._read, name="engine-events", daemon=True)
        self._reader.start()
        return self.facts

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the engine to fail what still runs (aborting its reservations) and exit; kill it
        if it does not within ``timeout_s``. Blocking."""
        self._stopping = True
        if not self._process.is_alive():  # never started, or already gone (see _gone)
            self._requests.close()
            return
        self._send(("stop",))
        self._process.join(timeout_s)
        if self._process.is_alive():
            log.warning("engine process did not stop within %.0f s; killing it", timeout_s)
            self._process.kill()
            self._process.join(5.0)
        self._requests.close()
        if self._reader is not None:
            self._reader.join(timeout_s)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # -- the runner's surface ---------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a request for the engine; ``AlreadyExists`` if its id is still owned."""
        rid = job.spec.request_id
        with self._lock:
            if self.exited:
                raise Unavailable("the worker's engine process has exited")
            if rid in self._jobs:
                raise AlreadyExists(f"request {rid!r} is already running on this worker")
            self._jobs[rid] = job
        # the job without its event loop and queue, which stay here (its other fields are plain)
        self._requests.send(("add", dataclasses.replace(job, loop=None, events=None)))

    def cancel(self, request_id: str, reason: TandemError) -> None:
        self._requests.send(("abort", request_id, reason))

    def adopt_registration(self, incarnation: int, worker_id: str, timeout_s: float = 30.0) -> None:
        """The gRPC process registered the worker: the engine's own kvstore link adopts the
        incarnation (its verbs carry it, and ``KVStoreLink.forgot_us`` heartbeats with it)."""
        self._call("adopt_registration", incarnation, worker_id, timeout_s=timeout_s)

    def reregister(self, registration: dict, timeout_s: float = 30.0) -> int:
        """``EngineRunner.reregister`` in the engine process (blocking; any thread)."""
        return self._call("reregister", registration, timeout_s=timeout_s)

    def _call(self, method: str, *args, timeout_s: float):
        """Run ``runner.<method>(*args)`` in the engine process and return its answer (or raise
        its exception); ``Unavailable`` if the process is gone."""
        answer: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.exited:
                raise Unavailable("the worker's engine process has exited")
            self._next_call += 1
            call_id = self._next_call
            self._calls[call_id] = answer
        self._send(("call", call_id, method, args))
        try:
            return answer.result(timeout_s)
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    @property
    def running(self) -> int:
        return self._running

    def running_ids(self) -> frozenset[str]:
        """Request ids submitted whose reservation has not been ended yet."""
        with self._lock:
            return frozenset(self._jobs)

    def _send(self, message: tuple) -> None:
        self._cmd.send(message)  # dropped if the engine process is gone: the reader fails its jobs

    # -- reader thread ----------------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                message = self._events.recv()
            except (EOFError, OSError):
                break
            if message[0] == "answer":
                _, call_id, ok, value = message
                with self._lock:
                    answer = self._calls.get(call_id)
                if answer is not None:
                    answer.set_result(value) if ok else answer.set_exception(value)
                continue
            _, events, disowned, running, tallies, idle_s = message
            self._running = running
            if self._on_tally is not None:
                for tally in tallies:
                    self._on_tally(tally)
            if idle_s and self._on_idle is not None:
                self._on_idle(idle_s)
            batches: dict[asyncio.AbstractEventLoop, list] = {}
            with self._lock:
                for rid, event in events:
                    job = self._jobs.get(rid)
                    if job is not None:
                        batches.setdefault(job.loop, []).append((job.events, event))
                for rid in disowned:
                    self._jobs.pop(rid, None)
            _post(batches)
        self._gone()

    def _gone(self) -> None:
        """The pipe closed: fail whatever still waits on the engine."""
        with self._lock:
            jobs, self._jobs = self._jobs, {}
            calls, self._calls = self._calls, {}
            self.exited = not self._stopping
        for answer in calls.values():
            answer.set_exception(Unavailable("the worker's engine process exited"))
        self._running = 0
        if jobs:
            error = Unavailable("the worker's engine process exited")
            batches: dict[asyncio.AbstractEventLoop, list] = {}
            for job in jobs.values():
                batches.setdefault(job.loop, []).append((job.events, ("error", error)))
            _post(batches)
        if self.exited:
            self._process.join(1.0)  # reap it, for its exit code
            log.error("the engine process exited unexpectedly (exit code %s)", self._process.exitcode)
            if self._on_exit is not None:
                self._on_exit()


def _post(batches: dict) -> None:
    for loop, batch in batches.items():
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the loop closed (server shut down): nobody is listening
            pass


# -- engine process -------------------------------------------------------------------------------


IDLE_SHIP_S = 0.1  # idle time shipped on its own once this much has gathered (see PipeOutbox.flush)


class PipeOutbox(Outbox):
    """The engine's outbox in an engine process: a turn's events, the requests whose reservation
    ended, the running count and step tallies go to the gRPC process as ONE message."""

    def __init__(self, conn: Connection):
        super().__init__()
        self._sender = _Sender(conn)  # the engine thread flushes; the command thread answers calls
        self._batch: list[tuple[str, tuple]] = []
        self.disowned: list[str] = []
        self.tallies: list[StepTally] = []
        self.idle_s = 0.0  # engine-thread waits with no request to step, since the last flush
        self.running: Callable[[], int] = lambda: 0

    def disown(self, request_id: str) -> None:
        self.disowned.append(request_id)

    def tally(self, report, elapsed_s: float, between_s: float = 0.0) -> None:
        self.tallies.append(StepTally.of(report, elapsed_s, between_s))

    def idle(self, seconds: float) -> None:
        self.idle_s += seconds  # shipped with the next message, or alone from IDLE_SHIP_S on (flush)

    def post(self, job: Job, *event) -> None:
        if event[0] == "error" and not isinstance(event[1], TandemError):
            # only typed errors are sure to unpickle; the client sees INTERNAL either way
            event = ("error", RuntimeError(f"{type(event[1]).__name__}: {event[1]}"))
        self._batch.append((job.spec.request_id, event))

    def flush(self) -> None:
        # idle time alone waits for 0.1 s of it: an idle loop waiting 2 ms at a time on kvstore
        # answers (a Release resent through an outage) would otherwise send 500 messages a second
        if not (self._batch or self.disowned or self.tallies or self.idle_s >= IDLE_SHIP_S):
            return
        message = ("events", self._batch, self.disowned, self.running(), self.tallies, self.idle_s)
        self._batch, self.disowned, self.tallies, self.idle_s = [], [], [], 0.0
        self.send(message)

    def send(self, message: tuple) -> None:
        self._sender.send(message)  # dropped if the gRPC process is gone: the command thread stops us


def _engine_main(settings_data: dict, metrics: bool, commands: Connection, requests: Connection, events: Connection,
                 log_level: int) -> None:
    """Entry point of the engine process: build, report ready (or why not), run until told to
    stop or until the gRPC process goes away."""
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    from services.common.gc_tuning import settle_heap
    from services.gpuworker.kvstore_link import KVStoreLink
    from services.gpuworker.runtime import build_runtime
    from services.common.auth import suite_credentials

    settings = WorkerSettings(**settings_data)
    outbox = PipeOutbox(events)
    try:
        _server_credentials, channel_credentials = suite_credentials(settings)
        link = KVStoreLink(settings.kvstore, timeout_s=settings.rpc_timeout_s, credentials=channel_credentials)
        link.worker_id = settings.worker_id  # Abort names its owner (no registration here)
        runner, facts = build_runtime(settings, link, on_step=outbox.tally if metrics else None,
                                      on_idle=outbox.idle if metrics else None, outbox=outbox,
                                      on_disown=outbox.disown, inbox=requests)
    except StartupError as exc:
        events.send(("failed", exc.message, exc.exit_code))
        return
    except Exception as exc:  # noqa: BLE001 - reported to the gRPC process, which exits with it
        log.exception("engine start-up failed")
        events.send(("failed", f"engine start-up failed: {type(exc).__name__}: {exc}", 1))
        return
    settle_heap(settings, "engine process")  # warmed up: what is alive now lives as long as the process
    outbox.running = lambda: runner.running
    outbox.send(("ready", facts))  # before the engine thread may send anything
    runner.start()
    try:
        while True:
            try:
                command = commands.recv()
            except (EOFError, OSError):
                log.warning("the worker's gRPC process is gone; stopping the engine")
                break
            try:
                if not _handle(command, runner, outbox):
                    break
            except Exception:  # noqa: BLE001 - a bug in one command must not end every stream
                log.exception("engine process: command %r failed", command[0])
    finally:
        runner.stop()
        link.close()


def _handle(command: tuple, runner, outbox: PipeOutbox) -> bool:
    """Carry out one control command from the gRPC process; False for "stop". (Requests, "add"
    and "abort", come on a pipe of their own that the engine thread reads: ``EngineRunner``'s
    inbox.)"""
    kind = command[0]
    if kind == "call":
        _, call_id, method, args = command
        try:
            outbox.send(("answer", call_id, True, getattr(runner, method)(*args)))
        except Exception as exc:  # noqa: BLE001 - raised on the gRPC side
            if not isinstance(exc, TandemError):
                exc = RuntimeError(f"{type(exc).__name__}: {exc}")
            outbox.send(("answer", call_id, False, exc))
    elif kind == "stop":
        return False
    return True
