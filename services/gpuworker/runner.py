"""The engine thread: continuous batching between asyncio handlers and the synchronous engine.

    Generate handler ──submit(job)──▶ commands ──▶ [engine thread] step(); sync; kvstore verbs
         ▲                                                │
         └───────── job.events (asyncio.Queue) ◀──────────┘  tokens / done / error

The engine is not thread-safe, so exactly one thread owns it. Between two steps that thread admits
new requests, applies aborts, and hands kvstore verbs to the courier (``kvstore_courier.py``),
whose carrier (a thread, or on CUDA a process of its own) sends them in order while the engine
keeps stepping: Publish as soon as blocks become final (so concurrent requests can reuse them
early), Extend ahead of need (a watermark of headroom, in chunks), Release when a request ends,
Abort on failure or cancellation. A step waits for the kvstore only when a request has truly run
out of capacity. Every verb that frees blocks is sent after the step that last wrote them has
completed on the device, as DESIGN §2 requires: the courier holds it until that step's fence
(``engine/fence.py``) reports done, which it asks without waiting, so the engine thread never
waits for the device except for a step's accept/reject verdict; answers are applied on this
thread, in the order the verbs were sent.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait as wait_for_any

import torch

from services.common import path_trace
from services.common.wire import pack_tokens
from services.common.errors import AlreadyExists, Cancelled, FailedPrecondition, ResourceExhausted, TandemError, Unavailable
from services.gpuworker.engine.engine import Engine
from services.gpuworker.engine.report import StepReport
from services.gpuworker.engine.request import DecodeCounts, FinishReason, RequestSpec
from services.gpuworker.cache_ledger import CacheLedger
from services.gpuworker.kvstore_courier import KVStoreCourier
from services.gpuworker.kvstore_link import KVStoreLink, ReservationBlockSource, capacity_answers, table_digest
from tandem.kvstore.v1 import kvstore_pb2 as kv

log = logging.getLogger(__name__)
# an idle engine thread looks at its stop flag this often (a command wakes it at once)
IDLE_WAIT_S = 0.5


class AbortRequested(Cancelled):
    """``cancel`` reason of Worker.Abort: the stream ends with finish reason ABORT, not an error."""


@dataclass
class Job:
    """One Generate call as the engine thread sees it. ``loop``/``events`` are where the default
    :class:`Outbox` delivers its events; an engine in its own process has neither (its outbox
    ships events by request id, see ``engine_process.py``)."""

    spec: RequestSpec
    reservation_id: str
    incarnation: int
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    arrived: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)  # prompt + generated, as streamed
    known_tokens: int = 0  # tokens sent to the kvstore for this reservation (prompt at Reserve)
    published_blocks: int = 0  # what the kvstore confirmed
    publish_sent_blocks: int = 0  # what Publishes already sent will publish
    admitted_at: float | None = None  # when the engine thread gave it to the engine (monotonic)
    first_token_at: float | None = None
    cache_salt: bytes = b""  # the reservation's (re-announced after a kvstore restart)
    kv_request_id: str = ""  # the kvstore's request id of the reservation ("" = spec.request_id)

@dataclass(slots=True)
class _Publish:
    """One request's Publish of a step, waiting to go out in that step's PublishMany."""

    job: Job  # its reservation id and incarnation are read when the call is sent
    new_tokens: list[int]
    final: int
    known: int
    # the table's blocks it publishes, as they were when it was made: its answer carries the
    # kvstore's table only if the kvstore's differ (KVStoreLink.publish_many's ``expected``)
    published: list[int]
    at_risk: list[int]  # the blocks it may deduplicate (free): published, not yet confirmed


class Outbox:
    """Events for the asyncio handlers, delivered once per engine-loop turn (``flush``): one
    ``call_soon_threadsafe`` per event loop instead of one per request and step (each wakes the
    loop; at 64 requests a step that is 64 wake-ups competing with the engine for the GIL)."""

    def __init__(self):
        self._events: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, tuple]]] = {}

    def post(self, job: Job, *event) -> None:
        self._events.setdefault(job.loop, []).append((job.events, event))

    def flush(self) -> None:
        events, self._events = self._events, {}
        for loop, batch in events.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the loop closed (server shut down): nobody is listening
                pass


def _deliver(batch: list[tuple[asyncio.Queue, tuple]]) -> None:
    for queue_, event in batch:
        queue_.put_nowait(event)


class BlocksInFlight:
    """Block ids named by kvstore calls still in flight (a multiset: one block may be in two).

    Admission waits for Publish answers only when the new request's table holds one of these:
    only a block a Publish publishes can be freed by it (deduplicated against another request's
    copy), and only a freed block can reach a new reservation. Waiting for every Publish in
    flight instead stalled the engine at each admission (at 64 streams, ~16 Publishes a step)."""

    def __init__(self):
        # block -> count > 0 (a plain dict: Counter's update/subtract cost 3x this for the one or
        # two blocks of a Publish, 16 of them a step at c 64 k 3)
        self._count: dict[int, int] = {}

    def add(self, blocks) -> None:
        count = self._count
        for b in blocks:
            count[b] = count.get(b, 0) + 1

    def discard(self, blocks) -> None:
        count = self._count
        for b in blocks:
            n = count.get(b, 0) - 1
            if n > 0:
                count[b] = n
            else:
                count.pop(b, None)

    def touches(self, table) -> bool:
        """Whether ``table`` holds a block in flight (pure)."""
        return bool(self._count) and any(b in self._count for b in table)

    def __len__(self) -> int:
        return len(self._count)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    mean_acceptance_length: float
    decode_steps: int
    time_to_first_token_s: float
    # arrival at the worker to admission into the engine (the gRPC process, the pipe, the engine
    # thread's next turn, a wait for Publish answers); the rest of the TTFT is prefill
    queue_time_s: float = 0.0


class EngineRunner:
    """Owns the engine on a dedicated thread; ``submit``/``cancel`` are safe from any thread.

    ``on_step(report, elapsed_s, between_s)``, if given, is called on the engine thread after every
    step that completed (``elapsed_s`` includes the device sync; ``between_s`` is the engine
    thread's own work since the previous step ended, its blocking waits left out: see ``_blocked``);
    ``on_idle(seconds)`` after every blocking wait with no request to step, admitted or waiting
    for admission (the served path not feeding the engine, as opposed to a stall on the
    kvstore), as it happens: a worker with nothing to do shows it at once, not at its next step.
    Metrics use both. Neither may block.
    """

    def __init__(
        self,
        engine: Engine,
        link: KVStoreLink,
        source: ReservationBlockSource,
        courier: KVStoreCourier,
        *,
        max_running: int = 256,
        extend_watermark_blocks: int = 2,
        extend_chunk_blocks: int = 4,
        on_step: Callable[[StepReport, float, float], None] | None = None,
        on_idle: Callable[[float], None] | None = None,
        outbox: Outbox | None = None,
        on_disown: Callable[[str], None] | None = None,
        inbox: Connection | None = None,
    ):
        self.engine = engine
        self.link = link
        self.source = source
        self.courier = courier
        self.max_running = max_running
        self.extend_watermark_blocks = extend_watermark_blocks
        self.extend_chunk_blocks = extend_chunk_blocks
        self._extending: set[str] = set()  # request ids with an ahead-of-need Extend in flight
        self._publishing = BlocksInFlight()  # blocks that Publishes in flight may deduplicate
        self._step_publishes: list[_Publish] = []  # gathered during a step's results, sent as one call
        self._outbox = outbox if outbox is not None else Outbox()
        self._on_disown = on_disown  # told when a request's reservation has been ended
        self._commands: queue.Queue = queue.Queue()
        # An engine process's requests ("add", "abort"), read by the engine thread itself between
        # steps: a thread blocked on the pipe needed the GIL several times per request (each
        # read, the unpickling, the queue), each time waiting for the busy engine thread.
        self._inbox = inbox
        # ...and a wake-up for the queue while the thread waits on that pipe (stop, reregister)
        self._wake_r, self._wake_w = os.pipe() if inbox is not None else (-1, -1)
        if inbox is not None:
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
        self._jobs: dict[str, Job] = {}  # engine thread only: admitted, running requests
        # Any thread: every request from submit() until its reservation has been ended, so that
        # Worker.Abort finds a request that the engine thread has not picked up yet.
        self._owned: set[str] = set()
        self._owned_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stop = threading.Event()
        self.steps = 0
        self._on_step = on_step
        self._on_idle = on_idle
        self._waited_s = 0.0  # blocked since the last step ended (see _blocked)
        self._last_step_end: float | None = None
        # Re-announced to a kvstore that forgot us (see reregister): what our pages hold, the
        # requests whose end the kvstore has not confirmed, and admissions waiting for Publishes.
        self.ledger = CacheLedger()
        self.restore_max_tokens = 1 << 20  # bounds one re-registration message (~4 MiB of tokens)
        self._ending_jobs: dict[str, Job] = {}
        self._waiting: collections.deque[Job] = collections.deque()
        self._stale_below = 0  # jobs of incarnations below this were not re-announced
        source.on_table = self._on_table
        source.on_late = self._extended
        courier.registration = lambda: (link.incarnation, link.generation)  # see KVStoreCourier

    # -- any thread ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Fail what is still running (aborting its reservations) and join the thread."""
        self._stop.set()
        self._put(("wake",))
        self._thread.join(timeout_s)

    def submit(self, job: Job) -> None:
        """Queue a request for the engine thread; ``AlreadyExists`` if its id is still owned."""
        rid = job.spec.request_id
        if not self._claim(rid):
            raise AlreadyExists(f"request {rid!r} is already running on this worker")
        self._put(("add", job))

    def _put(self, command: tuple) -> None:
        self._commands.put(command)
        if self._wake_w >= 0:  # the engine thread may be idle, waiting on its inbox
            try:
                os.write(self._wake_w, b"w")
            except BlockingIOError:  # full: it has 64 KiB of wake-ups to read already
                pass

    def _claim(self, rid: str) -> bool:
        """Own ``rid`` from now on; False (nothing changed) if it still is owned."""
        with self._owned_lock:
            if rid in self._owned:
                return False
            self._owned.add(rid)
        return True

    def _own(self, job: Job) -> bool:
        """A request read from the inbox: claimed, or logged and ignored if its id still is
        owned (which cannot happen: the gRPC side owns ids until we disown them)."""
        if self._claim(job.spec.request_id):
            return True
        log.error("request %r submitted twice; the second is ignored", job.spec.request_id)
        return False

    def cancel(self, request_id: str, reason: TandemError) -> None:
        self._put(("abort", request_id, reason))

    def adopt_registration(self, incarnation: int, worker_id: str) -> None:
        """Another link registered this worker (the gRPC process's, when this runner is in an
        engine process): this runner's link adopts the incarnation it got."""
        self.link.adopt(worker_id, incarnation)

    def reregister(self, registration: dict, timeout_s: float = 30.0) -> int:
        """Register again with a kvstore that forgot this worker (a memory kvstore restarted, or
        the lease lapsed), re-announcing what this worker still holds: the reservations of the
        requests it runs, which keep running under the new incarnation, and the published blocks
        its pages still hold, which go back into the shared cache. A request the kvstore cannot
        take back ends with UNAVAILABLE. ``registration``: the keyword arguments of
        ``KVStoreLink.register`` (plain values). Returns the new incarnation; raises the
        kvstore's error (nothing changed here) if it refused. Any thread: the engine thread does
        it between two steps."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("reregister", registration, done))
        return done.result(timeout_s)

    @property
    def running(self) -> int:
        return len(self._jobs)

    def running_ids(self) -> frozenset[str]:
        """Request ids submitted whose reservation has not been ended yet."""
        with self._owned_lock:
            return frozenset(self._owned)

    def _disown(self, rid: str) -> None:
        with self._owned_lock:
            self._owned.discard(rid)
        if self._on_disown is not None:
            self._on_disown(rid)

    # -- engine thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._outbox.flush()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._outbox.flush()
            idle = not self.engine.has_work() and not self._waiting
            if idle and self.courier.busy:
                # answers (a Release that lets a request id go) come from the courier, requests
                # through the commands: wait on the first briefly, then look at the second
                self._blocked(self.courier.wait_answer, 0.002)
                self._drain_commands(block=False)
            else:
                self._drain_commands(block=idle)
            if self._stop.is_set():
                break
            self.courier.drain()
            for _ in range(len(self._waiting)):
                self._admit(self._waiting.popleft())
            if not self.engine.has_work():
                if self._waiting:  # only requests waiting for Publish answers: wait for one
                    self._blocked(self.courier.wait_answer, 0.05)
                continue
            try:
                started = time.perf_counter()
                between_s = self._between_steps(started)
                report = self.engine.step()  # its device tail is fenced, not waited for (fence.py)
                self._last_step_end = time.perf_counter()
                elapsed_s = self._last_step_end - started
            except Exception as exc:  # a bug or a device failure: fail every request, keep serving
                log.exception("engine step failed")
                self._sync()
                for rid in list(self._jobs):
                    self._fail(rid, exc)
                continue
            self.steps += 1
            if not report.target_tokens and self.engine.has_work():
                # every request waits for capacity the kvstore has not answered yet: wait for
                # an answer instead of spinning
                self._blocked(self.courier.wait_answer, 0.05)
            if self._on_step is not None:
                self._on_step(report, elapsed_s, between_s)
            for rid, result in report.results.items():
                job = self._jobs.get(rid)
                if job is not None:
                    self._on_result(job, result)
            self._send_publishes()
            self._extend_ahead()
        for rid in list(self._jobs):
            self._fail(rid, Cancelled("worker is shutting down"))
        self.courier.wait_idle(timeout_s=5.0)
        self.courier.close()

    def _blocked(self, wait: Callable, *args):
        """Run a blocking wait (for a command or a kvstore answer), counting its time as waited:
        ``between_s`` of the next step is the thread's own work between two steps, not its idling;
        a wait with no request to step is also reported to ``on_idle``."""
        idle = self._on_idle is not None and not self.engine.has_work() and not self._waiting
        started = time.perf_counter()
        try:
            return wait(*args)
        finally:
            waited = time.perf_counter() - started
            self._waited_s += waited
            if idle:
                self._on_idle(waited)

    def _between_steps(self, now: float) -> float:
        """The engine thread's work since the last step ended, waits left out (mutates the waits)."""
        waited, self._waited_s = self._waited_s, 0.0
        if self._last_step_end is None:
            return 0.0
        return max(0.0, now - self._last_step_end - waited)

    def _next_command(self, *, block: bool):
        """The next command (None if there is none): from the inbox pipe first (an engine
        process's requests, read here so that no other thread of the process wakes for them),
        then from the queue. ``block``: wait for one, at most ``IDLE_WAIT_S``."""
        inbox = self._inbox
        while inbox is not None:
            try:
                if not inbox.poll():
                    break
                command = inbox.recv()
            except (EOFError, OSError):  # the gRPC process is gone: its control pipe stops us
                self._inbox = inbox = None
                break
            except Exception:  # noqa: BLE001 - a message that does not unpickle: its frame was read whole
                log.exception("engine: an unreadable request was dropped")
                continue
            if command[0] != "add" or self._own(command[1]):
                return command
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            if not block:
                return None
        if inbox is None:
            try:
                return self._blocked(self._commands.get, True, IDLE_WAIT_S)
            except queue.Empty:
                return None
        # idle in an engine process: wait on the pipe and on the queue's wake-up
        self._blocked(wait_for_any, [inbox, self._wake_r], IDLE_WAIT_S)
        try:
            os.read(self._wake_r, 65536)
        except BlockingIOError:
            pass
        return self._next_command(block=False)

    def _drain_commands(self, *, block: bool) -> None:
        command = self._next_command(block=block)
        while command is not None:
            kind = command[0]
            if kind == "add":
                self._admit(command[1])
            elif kind == "abort":
                _, rid, reason = command
                if rid in self._jobs:  # a request not admitted yet: its add ran first
                    if isinstance(reason, AbortRequested):
                        self._end_aborted(rid)
                    else:
                        self._fail(rid, reason)
                for job in [j for j in self._waiting if j.spec.request_id == rid]:
                    self._waiting.remove(job)
                    self._send_abort(job)
                    self._outbox.post(job, "error", reason)
            elif kind == "reregister":
                _, registration, done = command
                try:
                    done.set_result(self._reregister(registration))
                except Exception as exc:  # noqa: BLE001 - the caller sees it
                    done.set_exception(exc)
            command = self._next_command(block=False)

    def _admit(self, job: Job) -> None:
        rid = job.spec.request_id
        if self._publishing.touches(job.spec.block_table):
            # a Publish in flight may have freed (deduplicated) one of its blocks that a running
            # request still reads, and the kvstore then handed it to this one: it may write
            # nothing before that Publish's answer is applied. It waits for it in ``_waiting``
            # (tried again after every drain), not the engine: blocking the engine thread on
            # the courier here cost ~8 % of the step loop at c = 64 (a shared prompt's last
            # partial block is deduplicated by every request that publishes it).
            self._waiting.append(job)
            return
        try:
            if len(self._jobs) >= self.max_running:
                raise ResourceExhausted(f"worker runs {self.max_running} requests already")
            if job.incarnation < self._stale_below:
                job.incarnation = 0  # its reservation died with the kvstore's memory: nothing to end
                # FAILED_PRECONDITION: the router reserves again (this worker is not broken)
                raise FailedPrecondition("the kvstore restarted after this request was reserved; reserve again")
            self.source.bind(rid, job)
            self.engine.add_request(job.spec)
        except Exception as exc:
            self.source.unbind(rid)
            self._send_abort(job)
            self._outbox.post(job, "error", exc)
            return
        job.tokens = list(job.spec.prompt_ids)
        job.known_tokens = len(job.tokens)
        job.publish_sent_blocks = job.spec.reused_positions // self.engine.block_size
        # The reused prefix is published already (the kvstore starts the reservation's published
        # count there): no Publish of ours can deduplicate, i.e. free, those blocks, so they are
        # never at risk. Counting from 0 put the shared prefix in every request's first Publish's
        # at-risk set, and every new request (whose table holds that prefix) then waited for it.
        job.published_blocks = max(job.published_blocks, job.publish_sent_blocks)
        self.ledger.overwritten(job.spec.block_table[job.publish_sent_blocks:])  # a step writes these
        job.admitted_at = time.monotonic()
        path_trace.stamp("engine.admitted", rid)
        self._jobs[rid] = job

    def _on_result(self, job: Job, result) -> None:
        rid = job.spec.request_id
        if result.new_token_ids:
            if job.first_token_at is None:
                job.first_token_at = time.monotonic()
                path_trace.stamp("engine.first", rid)
            job.tokens.extend(result.new_token_ids)
            counts = result.counts  # two plain ints: an engine process pickles one per request and step
            self._outbox.post(job, "tokens", list(result.new_token_ids), result.new_logprobs,
                              (counts.decode_steps, counts.accepted_drafts))
        if result.finish_reason is FinishReason.CAPACITY:
            self._fail(rid, result.error or ResourceExhausted("no KV capacity left for this request"))
            return
        if result.finish_reason is FinishReason.ERROR:  # its first step failed; neighbours run on
            self._fail(rid, result.error)  # not a TandemError: the client sees INTERNAL, no details
            return
        try:
            if result.finished:
                self._finish(job, result)
            else:
                self._publish(job, result)
        except Exception as exc:
            log.warning("kvstore verb for %s failed: %s", rid, exc)
            if rid in self._jobs:
                self._fail(rid, exc)

    def _publish(self, job: Job, result) -> None:
        blocks = result.publishable_positions // result.block_size
        if blocks <= job.publish_sent_blocks:
            return
        known = job.known_tokens  # what the kvstore holds: lets the courier resend it safely
        new_tokens = job.tokens[known:]
        job.known_tokens = len(job.tokens)
        job.publish_sent_blocks = blocks
        table = self.engine.state(job.spec.request_id).block_table
        published = table[:blocks]
        self.ledger.published(job.cache_salt, job.tokens, published)  # (it copies the list)
        # the blocks this Publish may free (deduplicate): those it publishes that the kvstore
        # has not confirmed yet
        at_risk = table[job.published_blocks : blocks]
        self._publishing.add(at_risk)
        self._step_publishes.append(_Publish(job, new_tokens, result.publishable_positions, known, published, at_risk))

    def _send_publishes(self) -> None:
        """One PublishMany for the Publishes of the step just run (before its ahead-of-need
        Extends in the courier's FIFO); each answer goes to ``_published``. A Publish may free
        our copy of a deduplicated block: sent after the step that wrote it (its fence)."""
        batch, self._step_publishes = self._step_publishes, []
        if not batch:
            return

        def args():  # built when it is shipped: a kvstore restart may have renewed incarnations
            return ([(p.job.reservation_id, p.job.incarnation, p.new_tokens, p.final, p.known) for p in batch],
                    [(len(p.published), table_digest(p.published)) for p in batch])

        def done(answers) -> None:
            for i, p in enumerate(batch):
                answer = answers if isinstance(answers, Exception) else answers[i]
                self._published(p.job.spec.request_id, answer, p.at_risk, p.published)

        self.courier.send("publish", "publish_many", args, done, after=self.engine.last_fence)

    def _published(self, rid: str, response, at_risk: list[int], published: list[int]) -> None:
        """A Publish answered (engine thread; possibly inside a step's blocking Extend, so
        failures go through ``cancel``, which takes effect between steps). ``response`` None:
        not sent (its reservation died with a kvstore restart). ``published``: the blocks it
        published as the request held them when it was made; an answer without a table says
        the kvstore holds those."""
        self._publishing.discard(at_risk)
        job = self._jobs.get(rid)
        if job is None or response is None:
            return  # ended meanwhile: its Release or Abort follows in the queue
        if isinstance(response, Exception):
            log.warning("publish for %s failed: %s", rid, response)
            self.cancel(rid, response if isinstance(response, TandemError) else Unavailable(str(response)))
            return
        job.published_blocks = response.published_blocks
        if response.block_table is None:  # the kvstore holds the blocks it published: the usual answer
            held = self.engine.state(rid).block_table
            if held[: len(published)] != published:
                # An answer applied since moved some of them, and the kvstore's table does not
                # show it: only a kvstore that lost acknowledged writes (a Redis crash within
                # appendfsync everysec) gets here. Which copy holds the KV is unknown: end it.
                log.error("publish for %s: the kvstore's table lost a remap this worker applied", rid)
                self.cancel(rid, Unavailable("the kvstore lost part of this request's state; retry it"))
            return
        # dedup: another request published the same blocks first; the kvstore freed our copy and
        # pinned theirs (identical KV by the publish invariant), so read theirs from now on
        try:
            self.engine.remap_blocks(rid, response.block_table)
        except TandemError as exc:
            self.cancel(rid, exc)

    def _extend_ahead(self) -> None:
        """One Extend for every running request short of headroom (not waited for)."""
        wants = self.engine.capacity_wants(self.extend_watermark_blocks, self.extend_chunk_blocks, skip=self._extending)
        wants = {rid: n for rid, n in wants.items() if rid in self._jobs and rid not in self.source.pending}
        if not wants:
            return
        rids, items = self.source.extend_request(wants)
        self._extending.update(rids)
        self.courier.send("extend", "extend", items, lambda results: self._extended(rids, results))

    def _extended(self, rids: list[str], results) -> None:
        self._extending.difference_update(rids)
        if isinstance(results, Exception):
            log.info("ahead-of-need extend failed: %s", results)
            return
        for rid, answer in capacity_answers(rids, results).items():
            if isinstance(answer, Exception):
                continue  # no headroom now; the step extends (or ends the request) when it must
            self._on_table(rid, answer)
            try:
                self.engine.adopt_table(rid, answer)
            except TandemError as exc:
                self.cancel(rid, exc)

    def _finish(self, job: Job, result) -> None:
        rid = job.spec.request_id
        self._jobs.pop(rid, None)
        self.source.unbind(rid)
        new_tokens, final = job.tokens[job.known_tokens :], result.publishable_positions

        def released(response) -> None:
            if isinstance(response, Exception):
                # Every token was already streamed; the reservation dies with the lease if the
                # kvstore never hears of it (it cannot be reused by another request meanwhile).
                log.warning("release of %s failed: %s", job.reservation_id, response)
            self._ending_jobs.pop(rid, None)
            self._disown(rid)

        self._ending_jobs[rid] = job
        self.courier.send("release", "release", lambda: (job.reservation_id, job.incarnation, new_tokens, final),
                          released, after=self.engine.last_fence)
        self._outbox.post(job, "done", result.finish_reason, self._usage(job, result.counts))

    def _fail(self, rid: str, exc: Exception) -> None:
        job = self._jobs.pop(rid)
        if self.engine_has(rid):
            self.engine.abort(rid)
        self.source.unbind(rid)
        self._send_abort(job)
        self._outbox.post(job, "error", exc)

    def _end_aborted(self, rid: str) -> None:
        """Worker.Abort: stop the request between steps and end its stream normally, finish reason
        ABORT (the tokens sent so far stay valid); the reservation is aborted, not published."""
        job = self._jobs.pop(rid)
        counts = self.engine.state(rid).counts if self.engine_has(rid) else DecodeCounts()
        if self.engine_has(rid):
            self.engine.abort(rid)
        self.source.unbind(rid)
        self._send_abort(job)
        self._outbox.post(job, "done", FinishReason.ABORT, self._usage(job, counts))

    def _send_abort(self, job: Job) -> None:
        rid = job.spec.request_id

        def aborted(response) -> None:
            if isinstance(response, Exception):
                log.warning("abort of %s failed: %s", job.reservation_id, response)
            self._ending_jobs.pop(rid, None)
            self._disown(rid)

        # freed only once the last step that may have written these blocks completed
        self._ending_jobs[rid] = job
        self.courier.send("abort", "abort", lambda: (job.reservation_id, job.incarnation), aborted,
                          after=self.engine.last_fence)

    def _on_table(self, rid: str, table) -> None:
        """The kvstore handed this table out: its blocks past the published ones are the
        request's own, which steps will write, so no cached sequence holds them any more."""
        job = self._jobs.get(rid)
        if job is not None:
            self.ledger.overwritten(table[job.publish_sent_blocks:])

    def _reregister(self, registration: dict) -> int:
        """See ``reregister`` (engine thread, between steps)."""
        self._drain_commands(block=False)  # requests that arrived are announced with the rest
        # adopt every answer that came (a dedup remap, an Extend); the held verbs stay held, to
        # be shipped under the incarnation this re-registration renews
        self.courier.drain(ship=False)
        self.engine.last_fence.wait()  # what the kvstore is told is what the pages hold
        bs = self.engine.block_size
        waiting = [  # admitted once no Publish is in flight: nothing ran yet
            kv.HeldReservation(
                reservation_id=job.reservation_id, request_id=job.kv_request_id or job.spec.request_id,
                tokens_packed=pack_tokens(job.spec.prompt_ids), cache_salt=job.cache_salt,
                block_table=job.spec.block_table, published_blocks=job.spec.reused_positions // bs)
            for job in self._waiting
        ]
        held = [
            kv.HeldReservation(
                reservation_id=job.reservation_id,
                request_id=job.kv_request_id or rid,
                # the sequence as the kvstore held it if every call sent had landed; a resent
                # Publish then finds its tokens there and appends nothing (known_tokens)
                tokens_packed=pack_tokens(job.tokens[: job.known_tokens]),
                cache_salt=job.cache_salt,
                block_table=self.engine.state(rid).block_table,
                published_blocks=job.publish_sent_blocks,
            )
            for rid, job in self._jobs.items()
        ]
        sequences = [
            kv.HeldSequence(tokens_packed=pack_tokens(seq.tokens), cache_salt=seq.cache_salt,
                            block_ids=seq.block_ids)
            # the kvstore takes at most 4,096 of each kind per call (its max_items default)
            for seq in self.ledger.sequences(self.restore_max_tokens, max_count=4096)
        ]
        response = self.link.restore(registration, held + waiting, sequences)
        incarnation = response.worker.incarnation
        self._stale_below = incarnation
        for job in self._ending_jobs.values():
            job.incarnation = 0  # not re-announced: its Release or Abort has nothing left to end
        for dropped in response.dropped:
            log.warning("the kvstore did not take back reservation %s: %s", dropped.reservation_id, dropped.reason)
        back = {r.reservation_id: r for r in response.restored}
        for rid, job in list(self._jobs.items()):
            r = back.get(job.reservation_id)
            if r is None:
                job.incarnation = 0
                self._fail(rid, Unavailable("the kvstore restarted and could not take this request back"))
                continue
            job.incarnation = incarnation  # the block source reads it from the job: calls queued now name it
            job.published_blocks = r.published_blocks
            try:  # the kvstore may have deduplicated final blocks, as a Publish does
                self.engine.remap_blocks(rid, list(r.block_table))
            except TandemError as exc:
                self._fail(rid, exc)
        for job in list(self._waiting):
            r = back.get(job.reservation_id)
            if r is None:
                self._waiting.remove(job)
                self._disown(job.spec.request_id)
                self._outbox.post(job, "error", FailedPrecondition("the kvstore restarted and could not take this "
                                                                   "request back; reserve again"))
                continue
            job.incarnation = incarnation
            job.spec = dataclasses.replace(job.spec, block_table=list(r.block_table))  # only reused blocks may move
        log.warning("re-registered as incarnation %d: %d of %d requests taken back, %d cached blocks",
                    incarnation, len(back), len(held) + len(waiting), response.restored_cached_blocks)
        return incarnation

    def engine_has(self, rid: str) -> bool:
        return rid in self.engine.request_ids()

    def _usage(self, job: Job, counts: DecodeCounts) -> Usage:
        generated = len(job.tokens) - len(job.spec.prompt_ids)
        # counts: the engine's totals, one owner, one formula
        return Usage(
            prompt_tokens=len(job.spec.prompt_ids),
            cached_tokens=job.spec.reused_positions,
            completion_tokens=generated,
            mean_acceptance_length=counts.acceptance_length,
            decode_steps=counts.decode_steps,
            time_to_first_token_s=(job.first_token_at - job.arrived) if job.first_token_at else 0.0,
            queue_time_s=(job.admitted_at - job.arrived) if job.admitted_at else 0.0,
        )

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
