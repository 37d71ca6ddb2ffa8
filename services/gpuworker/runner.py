"""The engine thread: continuous batching between asyncio handlers and the synchronous engine.

    Generate handler ──submit(job)──▶ commands ──▶ [engine thread] step(); sync; kvstore verbs
         ▲                                                │
         └───────── job.events (asyncio.Queue) ◀──────────┘  tokens / done / error

The engine is not thread-safe, so exactly one thread owns it. Between two steps that thread admits
new requests, applies aborts, and calls the kvstore: Publish as soon as blocks become final (so
concurrent requests can reuse them early), Release when a request ends, Abort on failure or
cancellation. Every kvstore verb that frees blocks runs after the step that last wrote them has
completed on the device (``_sync``), as DESIGN §2 requires.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.common.errors import AlreadyExists, Cancelled, ResourceExhausted, TandemError
from services.gpuworker.engine.engine import Engine
from services.gpuworker.engine.report import StepReport
from services.gpuworker.engine.request import FinishReason, RequestSpec
from services.gpuworker.kvstore_link import KVStoreLink, ReservationBlockSource

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One Generate call as the engine thread sees it."""

    spec: RequestSpec
    reservation_id: str
    incarnation: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)  # prompt + generated, as streamed
    known_tokens: int = 0  # tokens the kvstore has for this reservation (prompt at Reserve)
    published_blocks: int = 0
    first_token_at: float | None = None
    decode_steps: int = 0
    accepted_drafts: int = 0

    def post(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    mean_acceptance_length: float
    decode_steps: int
    time_to_first_token_s: float


class EngineRunner:
    """Owns the engine on a dedicated thread; ``submit``/``cancel`` are safe from any thread.

    ``on_step(report, elapsed_s)``, if given, is called on the engine thread after every step that
    completed (``elapsed_s`` includes the device sync); metrics use it. It must not block.
    """

    def __init__(
        self,
        engine: Engine,
        link: KVStoreLink,
        source: ReservationBlockSource,
        *,
        max_running: int = 256,
        on_step: Callable[[StepReport, float], None] | None = None,
    ):
        self.engine = engine
        self.link = link
        self.source = source
        self.max_running = max_running
        self._commands: queue.Queue = queue.Queue()
        self._jobs: dict[str, Job] = {}  # engine thread only: admitted, running requests
        # Any thread: every request from submit() until its reservation has been ended, so that
        # Worker.Abort finds a request that the engine thread has not picked up yet.
        self._owned: set[str] = set()
        self._owned_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stop = threading.Event()
        self.steps = 0
        self._on_step = on_step

    # -- any thread ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Fail what is still running (aborting its reservations) and join the thread."""
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout_s)

    def submit(self, job: Job) -> None:
        """Queue a request for the engine thread; ``AlreadyExists`` if its id is still owned."""
        rid = job.spec.request_id
        with self._owned_lock:
            if rid in self._owned:
                raise AlreadyExists(f"request {rid!r} is already running on this worker")
            self._owned.add(rid)
        self._commands.put(("add", job))

    def cancel(self, request_id: str, reason: TandemError) -> None:
        self._commands.put(("abort", request_id, reason))

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

    # -- engine thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands(block=not self.engine.has_work())
            if self._stop.is_set():
                break
            if not self.engine.has_work():
                continue
            try:
                started = time.perf_counter()
                report = self.engine.step()
                self._sync()
                elapsed_s = time.perf_counter() - started
            except Exception as exc:  # a bug or a device failure: fail every request, keep serving
                log.exception("engine step failed")
                self._sync()
                for rid in list(self._jobs):
                    self._fail(rid, exc)
                continue
            self.steps += 1
            if self._on_step is not None:
                self._on_step(report, elapsed_s)
            for rid, result in report.results.items():
                job = self._jobs.get(rid)
                if job is not None:
                    self._on_result(job, result)
        for rid in list(self._jobs):
            self._fail(rid, Cancelled("worker is shutting down"))

    def _drain_commands(self, *, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = command[0]
            if kind == "add":
                self._admit(command[1])
            elif kind == "abort":
                _, rid, reason = command
                if rid in self._jobs:
                    self._fail(rid, reason)  # a request not admitted yet: its add ran first
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _admit(self, job: Job) -> None:
        rid = job.spec.request_id
        try:
            if len(self._jobs) >= self.max_running:
                raise ResourceExhausted(f"worker runs {self.max_running} requests already")
            self.source.bind(rid, job.reservation_id, job.incarnation)
            self.engine.add_request(job.spec)
        except Exception as exc:
            self.source.unbind(rid)
            try:
                self.link.abort(job.reservation_id, job.incarnation)
            finally:
                self._disown(rid)
            job.post("error", exc)
            return
        job.tokens = list(job.spec.prompt_ids)
        job.known_tokens = len(job.tokens)
        self._jobs[rid] = job

    def _on_result(self, job: Job, result) -> None:
        rid = job.spec.request_id
        if result.new_token_ids:
            if job.first_token_at is None:
                job.first_token_at = time.monotonic()
            job.tokens.extend(result.new_token_ids)
            job.post("tokens", list(result.new_token_ids))
        if result.verified:  # a decode step: 1 target token + accepted drafts
            job.decode_steps += 1
            job.accepted_drafts += result.accepted_drafts
        if result.finish_reason is FinishReason.CAPACITY:
            self._fail(rid, result.error or ResourceExhausted("no KV capacity left for this request"))
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
        if blocks <= job.published_blocks:
            return
        response = self.link.publish(
            job.reservation_id, job.incarnation, job.tokens[job.known_tokens :], result.publishable_positions
        )
        job.known_tokens = len(job.tokens)
        job.published_blocks = response.reservation.published_blocks
        table = list(response.reservation.block_table)
        if table != list(result.block_table):
            # dedup: another request published the same blocks first; the kvstore freed our copy
            # and pinned theirs (identical KV by the publish invariant), so read theirs from now on
            self.engine.remap_blocks(job.spec.request_id, table)

    def _finish(self, job: Job, result) -> None:
        rid = job.spec.request_id
        self._jobs.pop(rid, None)
        self.source.unbind(rid)
        try:
            self.link.release(job.reservation_id, job.incarnation, job.tokens[job.known_tokens :], result.publishable_positions)
        except TandemError as exc:
            # Every token was already streamed; the reservation dies with the lease if the
            # kvstore never hears of it (it cannot be reused by another request meanwhile).
            log.warning("release of %s failed: %s", job.reservation_id, exc.message)
        self._disown(rid)
        job.post("done", result.finish_reason, self._usage(job))

    def _fail(self, rid: str, exc: Exception) -> None:
        job = self._jobs.pop(rid)
        if self.engine_has(rid):
            self.engine.abort(rid)
        self.source.unbind(rid)
        self._sync()  # the last step that wrote these blocks must be complete before they are freed
        try:
            self.link.abort(job.reservation_id, job.incarnation)
        except TandemError as err:
            log.warning("abort of %s failed: %s", job.reservation_id, err.message)
        self._disown(rid)
        job.post("error", exc)

    def engine_has(self, rid: str) -> bool:
        return rid in self.engine.request_ids()

    def _usage(self, job: Job) -> Usage:
        generated = len(job.tokens) - len(job.spec.prompt_ids)
        return Usage(
            prompt_tokens=len(job.spec.prompt_ids),
            cached_tokens=job.spec.reused_positions,
            completion_tokens=generated,
            # tokens produced per decode step: 1 + accepted drafts on average
            mean_acceptance_length=(1.0 + job.accepted_drafts / job.decode_steps) if job.decode_steps else 1.0,
            decode_steps=job.decode_steps,
            time_to_first_token_s=(job.first_token_at - job.arrived) if job.first_token_at else 0.0,
        )

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
