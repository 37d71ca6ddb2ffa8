"""Serving one request end to end over the network: the router's orchestration.

    Match ──▶ rank (policy) ──▶ Reserve(candidates in rank order) ──▶ Worker.Generate(reservation) ──▶ deltas
      ▲         the kvstore takes the first with room; all full:           │
      │         wait in the bounded queue and plan again                   │ fails before the first message
      └──────────────────────────────────────────────────────────────┘ (retry.AttemptState decides)

Who ends a reservation (DESIGN §4 "nothing leaks"):

* The worker, once it has the request: Release on success, Abort on failure or cancellation, each
  after the GPU step that last wrote the blocks completed. The first message the router receives
  proves the worker has it; from then on the router never touches the reservation.
* Before that message, the router cannot tell whether the request arrived. It then *settles*:
  it asks the worker to ``Abort(request_id)``; if the worker has the request it answers OK and
  ends the reservation itself; if the worker answers NOT_FOUND, or cannot be reached (gone: its
  lease would drop the blocks anyway), the router aborts the reservation in the kvstore (Abort is
  idempotent, so a reservation the worker already ended is a no-op). Settling runs in the
  background so a retry elsewhere or the client's error is not delayed.
* A cancelled or expired client cancels the worker stream (the worker then aborts).
* A Reserve whose answer was lost (cancelled, timed out, connection dropped) may still have
  happened: the router re-sends the identical Reserve — idempotent per request id, so it returns
  that reservation if it exists — and aborts what it gets back.

Decisions live in pure modules (``policy``, ``retry``, ``directory``, ``jobs``); this one only
sequences calls, and every call carries a deadline derived from the client's remaining time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from services.common import path_trace
from services.common.channels import ChannelPool, call_timeout
from services.common.errors import AlreadyExists, InvalidArgument, ResourceExhausted, Unavailable
from services.common.telemetry import get_tracer, trace_metadata
from services.common.tokenizer import StreamDecoder, Tokenizer
from services.common.logprobs import TokenLogprob
from services.common.spec import DEFAULT_DRAFT_TOKENS
from services.common.wire import FINISH_REASONS, logprobs_from_proto, tokens_to_proto
from services.router.directory import WorkerDirectory, WorkerEntry
from services.router.jobs import GenerateJob, headroom_positions
from services.router.policy import PolicyWeights, RoutingPolicy, WorkerCandidate, rank_workers, rotate_workers
from services.router.retry import AttemptState, WaitQueue, backoff_delays, error_for
from services.router.stops import StopScanner
from services.router.tenants import Tenant
from tandem.common.v1 import common_pb2 as common_pb
from tandem.kvstore.v1 import kvstore_pb2 as kv_pb
from tandem.kvstore.v1 import kvstore_pb2_grpc
from tandem.worker.v1 import worker_pb2 as worker_pb
from tandem.worker.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)

# Codes after which a Reserve may or may not have happened in the kvstore.
_NO_ANSWER = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN})
# Stop waiting for capacity this long before the client's deadline, so it gets
# RESOURCE_EXHAUSTED ("no capacity before the deadline") rather than a bare DEADLINE_EXCEEDED.
_QUEUE_DEADLINE_MARGIN_S = 0.05


@dataclass(frozen=True, slots=True)
class DispatchConfig:
    """The dispatcher's knobs (from ``RouterSettings``)."""

    model_id: str = ""
    policy: RoutingPolicy = "kv_aware"
    weights: PolicyWeights = PolicyWeights()
    max_attempts: int = 3
    queue_retry_s: float = 0.05
    queue_retry_max_s: float = 0.5
    max_queue_wait_s: float = 30.0
    kvstore_timeout_s: float = 2.0
    kvstore_outage_wait_s: float = 10.0  # a new request waits this long for an unreachable kvstore
    worker_probe_timeout_s: float = 1.0
    max_request_s: float = 600.0
    idle_timeout_s: float = 60.0  # a worker stream silent this long fails UNAVAILABLE


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New text and token ids of a request (and their logprobs, when asked for)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    """Accounting of a finished request (see ``tandem.common.v1.Usage``)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    mean_acceptance_length: float
    worker_id: str
    time_to_first_token_s: float
    finish_reason: str  # "stop", "length" or "abort" (FINISH_REASONS' values)
    decode_steps: int = 0


@dataclass(frozen=True, slots=True)
class Completion:
    """The last message of a request: remaining text and ids, and the usage."""

    text: str
    token_ids: tuple[int, ...]
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A worker for ``Router.ListWorkers``."""

    entry: WorkerEntry
    health: str  # SERVING / NOT_SERVING / UNREACHABLE
    in_flight: int


class _WorkerFailed(Exception):
    """The worker stream ended in an error (code name + details)."""

    def __init__(self, code_name: str, message: str):
        super().__init__(f"{code_name}: {message}")
        self.code_name = code_name
        self.message = message


# A stream of a worker that left the registry is cut once the worker has been absent from it, and
# quiet, this long (a frozen worker). A worker back under a new incarnation keeps its streams.
_DEPARTED_QUIET_S = 5.0

class _Progress:
    """What one attempt has seen from its worker (mutated while streaming)."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: tuple[str, ...] = ()):
        self.acknowledged = False  # any message received: the worker owns the reservation
        self.left_registry = False  # its worker incarnation left the kvstore registry mid-stream
        self.idle_expired = False  # the worker sent nothing for idle_timeout_s (see Dispatcher._sweep_idle)
        self.at_consumer = False  # a delta is with the consumer: the worker is not being read
        self.tokens: list[int] = []
        self.first_token_at: float | None = None
        # the worker's totals as of its last message (decode steps, accepted drafts)
        self.decode_steps = 0
        self.accepted_drafts = 0
        # the last message from the worker, or the consumer's return from the last delta: when
        # the router's current wait on the worker began
        self.last_heard_at: float | None = None
        self.decoder = StreamDecoder(tokenizer)
        self.stops = StopScanner(stop_strings, tokenizer) if stop_strings else None

    def silent_s(self, now: float) -> float:
        """How long the worker has sent nothing while the router waited on it: 0 while a delta is
        with the consumer (the router is not reading the worker, whose stream window then stops
        it) or before the stream began."""
        if self.at_consumer or self.last_heard_at is None:
            return 0.0
        return now - self.last_heard_at

    def text(self, ids: tuple[int, ...]) -> tuple[str, int | None]:
        """Text of new ids, and how many of them count if a stop string completed (see ``stops``)."""
        if self.stops is not None:
            return self.stops.push(ids)
        return self.decoder.push(list(ids)), None

    def flush(self) -> tuple[str, bool]:
        """The held-back text at the end, and whether it ended on a stop string."""
        return self.stops.flush() if self.stops is not None else (self.decoder.flush(), False)


def _entry(w: kv_pb.WorkerInfo) -> WorkerEntry:
    return WorkerEntry(
        worker_id=w.worker_id,
        incarnation=w.incarnation,
        address=w.address,
        model_id=w.model_id,
        spec_mode=w.spec_mode,
        span=w.span,
        block_size=w.block_size,
        num_blocks=w.pool.total,
        used_blocks=w.pool.in_use,
        vocab_size=w.vocab_size,
        max_seq_len=w.max_seq_len,
    )


class KVStoreUnavailable(Unavailable):
    """The kvstore did not answer (down, failing over to a standby, slow): worth waiting for."""


class NoWorkerRegistered(Unavailable):
    """The kvstore lists no worker (it just restarted empty, or every worker is re-registering):
    worth waiting for as briefly as an outage."""


class AllCoolingDown(Unavailable):
    """Every compatible worker is in its failure cooldown (other requests failed on it, none of
    this request's attempts did): waited for like an outage, not answered at once."""


def _kv_error(verb: str, err: grpc.aio.AioRpcError) -> Exception:
    code = err.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return KVStoreUnavailable(f"kvstore {verb} failed: {code.name}: {err.details()}")
    return error_for(code.name, f"kvstore {verb}: {err.details()}")


class _Outage:
    """How long one request waits for an unreachable kvstore: up to ``kvstore_outage_wait_s``
    from its first failed call, and never past its own deadline; then UNAVAILABLE with a hint."""

    def __init__(self, dispatcher: Dispatcher, deadline: float | None):
        self._d = dispatcher
        self._deadline = deadline
        self._until: float | None = None
        self._delays = backoff_delays(0.02, 0.1)  # a kvstore back is used within 0.1 s

    async def wait(self, exc: Exception) -> None:
        clock, config = self._d._clock, self._d.config
        now = clock()
        if self._until is None:
            self._until = now + config.kvstore_outage_wait_s
        limit = self._until if self._deadline is None else min(self._until, self._deadline - _QUEUE_DEADLINE_MARGIN_S)
        delay = next(self._delays)
        if now + delay > limit:
            raise Unavailable(f"{exc} (waited {now - self._until + config.kvstore_outage_wait_s:.1f} s); "
                              "retry in a few seconds") from None
        await asyncio.sleep(delay)


class Dispatcher:
    """Routes and streams requests; holds the router's shared state (directory, queue, RNG).

    Single event loop; the only concurrency is between requests' coroutines.
    """

    def __init__(
        self,
        *,
        kvstore: grpc.aio.Channel,
        channels: ChannelPool,
        tokenizer: Tokenizer,
        directory: WorkerDirectory,
        queue: WaitQueue,
        config: DispatchConfig = DispatchConfig(),
        rng: random.Random | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._kv = kvstore_pb2_grpc.KVStoreStub(kvstore)
        self._channels = channels
        self._tokenizer = tokenizer
        self.directory = directory
        self.queue = queue
        self.config = config
        self._rng = rng or random.Random()
        self._turn = 0  # round_robin: advanced by every plan
        self._tracer = get_tracer(__name__, tracer_provider)
        self._clock = clock
        self._live: set[str] = set()
        self._cleanup: set[asyncio.Task] = set()
        # (worker id, incarnation) -> the streams running there: ended when it leaves the registry
        self._streams: dict[tuple[str, int], dict[int, tuple[object, _Progress]]] = {}
        self._absent_since: dict[str, float] = {}  # worker id -> first registry read without it
        self._idle_timer: asyncio.TimerHandle | None = None  # armed while streams run
        # worker id -> (incarnation, most draft tokens it accepts, its default k or None), from its Info answer
        self._draft_limits: dict[str, tuple[int, int, int | None]] = {}

    # --------------------------------------------------------------------------------- helpers
    def _timeout(self, deadline: float | None, cap_s: float) -> float:
        remaining = None if deadline is None else deadline - self._clock()
        return call_timeout(remaining, cap_s)

    def use_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Set the tokenizer once the model is known (``--model auto``; mutates)."""
        self._tokenizer = tokenizer

    async def worker_model(self, entry: WorkerEntry) -> str:
        """The model a worker says it serves (``Info.model_name``; "" when it names none). This
        is the probe before a worker gets requests: Unavailable unless its health is SERVING
        and it answers Info (then it is asked again on the next review)."""
        health = await self._health(entry.address)
        if health != "SERVING":
            raise Unavailable(f"worker {entry.worker_id} is {health}")
        try:
            info = await self._worker_stub(entry.address).Info(
                worker_pb.InfoRequest(), timeout=self.config.worker_probe_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise Unavailable(f"worker {entry.worker_id} Info: {err.code().name}") from None
        if len(self._draft_limits) > 4096:  # bounded: drop workers that left, keep the registered
            # (clearing all would leave routable workers with no known limit: an unchecked k)
            self._draft_limits = {
                w: v for w, v in self._draft_limits.items()
                if (e := self.directory.get(w)) is not None and e.incarnation == v[0]}
        default = info.num_draft_tokens if info.HasField("num_draft_tokens") else None
        self._draft_limits[entry.worker_id] = (entry.incarnation, info.max_draft_tokens, default)
        return info.model_name

    def draft_tokens_for(self, entry: WorkerEntry, wanted: int | None) -> int:
        """The k a request runs with on ``entry`` (read-only): ``wanted`` (the request's own, or
        the router's setting), or when None the worker's advertised default (only the worker knows
        which k its model, draft and device run best at; ``DEFAULT_DRAFT_TOKENS`` if it
        advertises none); capped by what the worker said it accepts: the router's own limit may
        be larger than a worker's, and such a request must not fail."""
        info = self._draft_limits.get(entry.worker_id)
        if info is None or info[0] != entry.incarnation:
            return DEFAULT_DRAFT_TOKENS if wanted is None else wanted
        _incarnation, limit, default = info
        if wanted is None:
            wanted = DEFAULT_DRAFT_TOKENS if default is None else default
        return min(wanted, limit)

    def _worker_stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self._channels.get(address))

    async def refresh_directory(self, deadline: float | None = None) -> list[WorkerEntry]:
        """Reload the registry from kvstore ListWorkers (mutates the directory)."""
        try:
            resp = await self._kv.ListWorkers(
                kv_pb.ListWorkersRequest(), timeout=self._timeout(deadline, self.config.kvstore_timeout_s)
            )
        except grpc.aio.AioRpcError as err:
            raise _kv_error("ListWorkers", err) from None
        entries = [_entry(w) for w in resp.workers]
        self.directory.replace(entries)
        self._end_streams_of_departed({(e.worker_id, e.incarnation) for e in entries}, {e.worker_id for e in entries})
        return entries

    def _end_streams_of_departed(self, registered: set[tuple[str, int]], present: set[str]) -> None:
        """Cancel the streams of worker incarnations that left the registry (lease lapsed) when
        the worker has been absent from it, and quiet, for ``_DEPARTED_QUIET_S``: a frozen
        worker would hold them forever. A worker registered again under a new incarnation is
        alive (it heartbeats): after a kvstore restart it re-registers with the reservations it
        runs and carries on, so its streams are left alone (one it could not take back, it ends
        itself). The client of a cancelled stream sees UNAVAILABLE (mutates the calls)."""
        now = self._clock()
        for wid in present:
            self._absent_since.pop(wid, None)
        for key in [k for k in self._streams if k not in registered]:
            if key[0] in present:
                continue
            absent_since = self._absent_since.setdefault(key[0], now)
            streams = self._streams[key]
            for cid, (_call, progress) in list(streams.items()):
                if now - absent_since < _DEPARTED_QUIET_S or progress.silent_s(now) < _DEPARTED_QUIET_S:
                    continue
                progress.left_registry = True
                self._end_stream(key, cid)
        if self._absent_since:  # forget workers with no stream left to time (a worker gone for good)
            streaming = {wid for wid, _ in self._streams}
            self._absent_since = {w: t for w, t in self._absent_since.items() if w in streaming}

    def _arm_idle_sweep(self) -> None:
        """Arm the idle watchdog if it is not: one timer for every worker stream (a timeout scope
        per message cost ~5 % of the router's CPU at 64 streams), firing every quarter of the idle
        timeout while streams run, so a silent stream ends within 1.25 x the timeout."""
        if self._idle_timer is None:
            period = max(0.01, self.config.idle_timeout_s / 4)
            self._idle_timer = asyncio.get_running_loop().call_later(period, self._sweep_idle)

    def _sweep_idle(self) -> None:
        """Cancel the streams whose worker sent nothing for ``idle_timeout_s`` while the router
        was reading it — a frozen worker (SIGSTOP) keeps its connection open, keepalive may not
        notice, and the client's deadline can be minutes away; its reader fails UNAVAILABLE. A
        stream whose client is slow to take the last delta is not timed (mutates the calls)."""
        self._idle_timer = None
        now, idle_s = self._clock(), self.config.idle_timeout_s
        for key, streams in list(self._streams.items()):
            for cid, (_call, progress) in list(streams.items()):
                if progress.silent_s(now) >= idle_s:
                    progress.idle_expired = True
                    self._end_stream(key, cid)
        if self._streams:
            self._arm_idle_sweep()

    def _end_stream(self, key: tuple[str, int], cid: int) -> None:
        """Forget stream ``cid`` of worker incarnation ``key`` and cancel its call (its reader
        then fails with what its progress flags say: see ``_ended_early``). Mutates."""
        streams = self._streams[key]
        call, _progress = streams.pop(cid)
        if not streams:
            del self._streams[key]
        call.cancel()

    def _ended_early(self, entry: WorkerEntry, progress: _Progress) -> _WorkerFailed | None:
        """Why the router itself cancelled a stream (the worker left the registry, or went
        silent), or None when it did not."""
        if progress.idle_expired:
            return _WorkerFailed("UNAVAILABLE", f"the worker sent nothing for {self.config.idle_timeout_s:g} s (idle timeout)")
        if progress.left_registry:
            return _WorkerFailed("UNAVAILABLE", f"worker {entry.worker_id} left the registry")
        return None

    # ---------------------------------------------------------------------------------- planning
    async def _match(self, tenant: Tenant, prompt_pb, deadline: float | None) -> list:
        try:
            resp = await self._kv.Match(
                kv_pb.MatchRequest(tokens=prompt_pb, cache_salt=tenant.cache_salt, model_id=self.config.model_id),
                timeout=self._timeout(deadline, self.config.kvstore_timeout_s),
            )
        except grpc.aio.AioRpcError as err:
            raise _kv_error("Match", err) from None
        return list(resp.workers)

    async def _plan(self, job: GenerateJob, tenant: Tenant, prompt_pb, state: AttemptState,
                    deadline: float | None) -> list[WorkerEntry]:
        """Match + rank: the workers in preference order (read-only for the kvstore). Raises
        when no worker could ever take the request."""
        matches = await self._match(tenant, prompt_pb, deadline)
        path_trace.stamp("router.matched", job.request_id)
        if not matches:
            # none at all: the registry may have been empty for a moment (a kvstore restarted,
            # its workers re-registering). Read it again, then ask again: only a Match after the
            # refresh tells "no worker yet" from "no compatible worker".
            await self.refresh_directory(deadline)
            matches = await self._match(tenant, prompt_pb, deadline)
        if not self.directory.is_fresh_for((m.worker_id, m.incarnation) for m in matches):
            await self.refresh_directory(deadline)
        if not matches:
            raise self._why_no_match(job)

        n = job.prompt_tokens
        candidates, entries, too_small = [], {}, []
        for m in matches:
            entry = self.directory.get(m.worker_id)
            if entry is None or entry.incarnation != m.incarnation:
                continue  # re-registered since the Match: the next plan sees it
            headroom = headroom_positions(self.draft_tokens_for(entry, job.num_draft_tokens))
            need = -(-min(n + headroom, entry.max_seq_len) // entry.block_size)
            if need > entry.num_blocks:
                too_small.append(f"{entry.worker_id} has {entry.num_blocks} blocks, needs {need}")
                continue
            entries[m.worker_id] = entry
            candidates.append(
                WorkerCandidate(
                    worker_id=m.worker_id,
                    model_id=entry.model_id,
                    block_size=entry.block_size,
                    reusable_blocks=m.reusable_blocks,
                    active_blocks=m.pool.in_use,
                    queued=max(m.live_reservations, self.directory.in_flight(m.worker_id)),
                    healthy=self.directory.is_healthy(m.worker_id),
                )
            )
        if not candidates and too_small:
            raise ResourceExhausted(f"the prompt can never fit: {'; '.join(too_small)}")
        exclude = state.excluded_now({m.worker_id: m.incarnation for m in matches})
        if self.config.policy == "round_robin":
            ranked = rotate_workers(candidates, prompt_tokens=n, turn=self._turn,
                                    model_id=self.config.model_id, exclude=exclude)
            self._turn += 1
        else:
            ranked = rank_workers(
                candidates, prompt_tokens=n, weights=self.config.weights, rng=self._rng,
                model_id=self.config.model_id, exclude=exclude,
            )
        if not ranked:
            if any(not c.healthy and c.worker_id not in exclude for c in candidates):
                # Every worker this request may still use is cooling down after failures (e.g. a
                # kvstore restart ended streams, or sent this request back to reserve again). Waitable.
                raise AllCoolingDown(state.no_worker_left().message)
            if candidates:
                raise state.no_worker_left()
            raise Unavailable("the workers changed while routing; try again")
        return [entries[r.worker_id] for r in ranked]

    def _why_no_match(self, job: GenerateJob) -> Exception:
        """Why Match found no compatible worker (registry read-only)."""
        model = self.config.model_id
        workers = [e for e in self.directory.entries() if not model or e.model_id == model]
        if not workers:
            return NoWorkerRegistered("no worker is registered" + (f" for model {model!r}" if model else ""))
        longest = max(e.max_seq_len for e in workers)
        if job.prompt_tokens > longest:
            return InvalidArgument(
                f"prompt of {job.prompt_tokens} tokens exceeds the longest sequence any worker serves ({longest})"
            )
        return InvalidArgument("no worker's vocabulary covers every prompt token id")

    async def _reserve(self, job: GenerateJob, tenant: Tenant, prompt_pb, state: AttemptState,
                       deadline: float | None) -> tuple[WorkerEntry, kv_pb.Reservation, int]:
        """Reserve on the best worker that has room; wait in the queue while none has (mutates
        the kvstore: one reservation on success, nothing otherwise). Returns the worker, the
        reservation and the k to ask that worker for, which the reservation's headroom covers."""
        delays = backoff_delays(self.config.queue_retry_s, self.config.queue_retry_max_s)
        queued_until: float | None = None
        outage = _Outage(self, deadline)
        # Once a Reserve's answer was lost it may have happened, and its retry must be identical
        # (the kvstore refuses another headroom under a live request id): the headroom is then
        # pinned, and later candidates' k capped by it, even if the ranking changed meanwhile.
        pinned_headroom: int | None = None
        try:
            while True:
                try:
                    ranked = await self._plan(job, tenant, prompt_pb, state, deadline)
                except (KVStoreUnavailable, NoWorkerRegistered, AllCoolingDown) as exc:
                    await outage.wait(exc)
                    continue
                # One Reserve for the whole preference order: the kvstore takes the first worker
                # with room, so a full first choice costs no extra round trip. Each candidate's k
                # is fixed here, before it, and the one headroom covers the largest of them (a few
                # positions more on a worker that drafts less): the k sent to whichever worker
                # took it can never exceed what was reserved, even if its Info changes meanwhile.
                ks = {e.worker_id: self.draft_tokens_for(e, job.num_draft_tokens) for e in ranked}
                headroom = pinned_headroom if pinned_headroom is not None else headroom_positions(max(ks.values()))
                ks = {w: min(k, headroom - 1) for w, k in ks.items()}
                request = kv_pb.ReserveRequest(
                    candidates=[kv_pb.WorkerRef(worker_id=e.worker_id, incarnation=e.incarnation) for e in ranked],
                    request_id=state.reservation_request_id(),
                    tokens=prompt_pb,
                    cache_salt=tenant.cache_salt,
                    headroom_positions=headroom,
                )
                try:
                    resp = await self._kv.Reserve(request, timeout=self._timeout(deadline, self.config.kvstore_timeout_s))
                    path_trace.stamp("router.reserved", job.request_id)
                    entry = next(e for e in ranked if e.worker_id == resp.reservation.worker_id)
                    return entry, resp.reservation, ks[entry.worker_id]
                except asyncio.CancelledError:
                    self._reclaim_later(request)  # the kvstore may have reserved all the same
                    raise
                except grpc.aio.AioRpcError as err:
                    if err.code() in _NO_ANSWER:
                        pinned_headroom = headroom
                    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        # The kvstore is down or failing over. The identical Reserve is sent again
                        # (idempotent per request id: a lost one that happened comes back); only
                        # when we stop waiting is the id reclaimed in the background.
                        try:
                            await outage.wait(_kv_error("Reserve", err))
                        except Unavailable:
                            self._reclaim_later(request)
                            raise
                        continue
                    if err.code() in _NO_ANSWER:
                        self._reclaim_later(request)
                    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        last = err.details() or ""
                    elif err.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                        self.directory.invalidate()  # a worker re-registered or left
                        last = f"the workers changed: {err.details()}"
                    else:
                        raise _kv_error("Reserve", err) from None
                # nothing fits right now: wait (bounded queue) and plan again
                now = self._clock()
                if queued_until is None:
                    self.queue.enter()
                    queued_until = now + self.config.max_queue_wait_s
                limit = queued_until if deadline is None else min(queued_until, deadline - _QUEUE_DEADLINE_MARGIN_S)
                delay = next(delays)
                if now + delay > limit:
                    raise ResourceExhausted(f"no worker had capacity before the deadline ({last})")
                await asyncio.sleep(delay)
        finally:
            if queued_until is not None:
                self.queue.leave()

    # --------------------------------------------------------------------------------- streaming
    async def _stream(self, job: GenerateJob, entry: WorkerEntry, reservation: kv_pb.Reservation, num_draft_tokens: int,
                      worker_request_id: str, deadline: float | None, arrival: float,
                      progress: _Progress) -> AsyncIterator[TextDelta | Completion]:
        """Run Worker.Generate with ``num_draft_tokens`` (resolved by ``_reserve``) and translate its
        messages; raises _WorkerFailed on a worker error. The call is cancelled whenever this
        generator stops early."""
        request = worker_pb.GenerateRequest(
            request_id=worker_request_id,
            prompt=tokens_to_proto(job.prompt),
            sampling=worker_pb.SamplingParams(
                temperature=job.sampling.temperature,
                top_p=job.sampling.top_p,
                top_k=job.sampling.top_k,
                seed=job.sampling.seed,  # None = unset (unseeded)
                max_new_tokens=job.sampling.max_new_tokens,
                stop_token_ids=job.sampling.stop_token_ids,
                min_p=job.sampling.min_p,
                presence_penalty=job.sampling.presence_penalty,
                frequency_penalty=job.sampling.frequency_penalty,
                repetition_penalty=job.sampling.repetition_penalty,
                logprobs=job.sampling.logprobs,  # None = unset
            ),
            spec=worker_pb.SpecParams(num_draft_tokens=num_draft_tokens),
            # only its name: the worker reads blocks and reused prefix from the kvstore
            reservation=worker_pb.ReservationRef(
                reservation_id=reservation.reservation_id,
                incarnation=reservation.incarnation,
            ),
        )
        span = self._tracer.start_span(
            "worker.generate", attributes={"tandem.worker_id": entry.worker_id, "tandem.request_id": worker_request_id}
        )
        # The span only needs to be current while the call is created: that is when the trace
        # context is copied into the call (and its metadata). No span stays current across yields.
        with trace.use_span(span, end_on_exit=False):
            call = self._worker_stub(entry.address).Generate(  # on a channel without stream interceptors
                request, timeout=self._timeout(deadline, self.config.max_request_s), metadata=trace_metadata()
            )
        path_trace.stamp("router.called", job.request_id)
        key = (entry.worker_id, entry.incarnation)
        self._streams.setdefault(key, {})[id(call)] = (call, progress)
        self._arm_idle_sweep()
        try:
            async for msg in call:
                progress.acknowledged = True
                now = progress.last_heard_at = self._clock()
                ids = tuple(msg.token_ids)
                if ids and max(ids) >= self._tokenizer.vocab_size:
                    raise _WorkerFailed("INTERNAL", f"token id {max(ids)} is outside the router's vocabulary "
                                                    f"({self._tokenizer.vocab_size}): model/tokenizer mismatch")
                logprobs = ()
                if msg.logprobs:  # per token: skipped when not asked for
                    try:
                        logprobs = logprobs_from_proto(ids, msg.logprobs)
                    except InvalidArgument as exc:
                        raise _WorkerFailed("INTERNAL", f"the worker sent {exc}") from None
                if msg.decode_steps:
                    progress.decode_steps, progress.accepted_drafts = msg.decode_steps, msg.accepted_drafts
                text, cut = progress.text(ids) if ids else ("", None)
                if ids:
                    if progress.first_token_at is None:
                        progress.first_token_at = now
                        path_trace.stamp("router.first", job.request_id)
                    progress.tokens.extend(ids if cut is None else ids[:cut])
                if cut is not None:  # a stop string: the tokens after it are never sent; closing the call aborts the rest
                    yield self._stopped(job, entry, reservation, ids[:cut], text, arrival, progress, logprobs[:cut])
                    return
                if msg.finish_reason != common_pb.FINISH_REASON_UNSPECIFIED or msg.HasField("usage"):
                    yield self._completion(job, entry, reservation, msg, ids, text, arrival, progress, logprobs)
                    return
                if ids:
                    # While the consumer holds the delta (a client reading slowly), the router
                    # does not read the worker, whose stream window then stops it: its silence
                    # is ours, and the idle clock restarts once the consumer asks for more.
                    progress.at_consumer = True
                    yield TextDelta(text, ids, logprobs)
                    progress.at_consumer = False
                    progress.last_heard_at = self._clock()
            raise _WorkerFailed("UNAVAILABLE", "the worker ended the stream without a final message")
        except grpc.aio.AioRpcError as err:
            span.set_attribute("rpc.grpc.status_code", err.code().value[0])
            raise self._ended_early(entry, progress) or _WorkerFailed(err.code().name, err.details() or "") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            failure = self._ended_early(entry, progress)
            if failure is not None and not (task is not None and task.cancelling()):
                raise failure from None
            raise
        finally:
            streams = self._streams.get(key)
            if streams is not None:
                streams.pop(id(call), None)
                if not streams:
                    del self._streams[key]
            if not call.done():
                call.cancel()
            span.end()

    def _stopped(self, job, entry, reservation, ids, text, arrival, progress: _Progress, logprobs) -> Completion:
        """The Completion of a request ended here on a stop string (the worker's final usage never
        comes: decode steps and acceptance are the worker's totals as of the message that carried
        the stop — the steps that produced the tokens kept)."""
        steps = progress.decode_steps
        return Completion(text=text, token_ids=tuple(ids), logprobs=tuple(logprobs), usage=Usage(
            prompt_tokens=job.prompt_tokens, cached_tokens=reservation.reused_positions,
            completion_tokens=len(progress.tokens),
            mean_acceptance_length=1.0 + progress.accepted_drafts / steps if steps else 1.0,
            worker_id=entry.worker_id, time_to_first_token_s=max(0.0, progress.first_token_at - arrival),
            finish_reason="stop", decode_steps=steps,
        ))

    def _completion(self, job, entry, reservation, msg, ids, text, arrival, progress: _Progress,
                    logprobs=()) -> Completion:
        # The stream decoder holds back an incomplete character; the end flushes it.
        rest, stopped = progress.flush()
        tail = text + rest
        first = progress.first_token_at if progress.first_token_at is not None else self._clock()
        usage = msg.usage
        acceptance = usage.mean_acceptance_length
        return Completion(
            text=tail,
            token_ids=ids,
            logprobs=tuple(logprobs),
            usage=Usage(
                prompt_tokens=job.prompt_tokens,
                cached_tokens=usage.cached_tokens if msg.HasField("usage") else reservation.reused_positions,
                completion_tokens=usage.completion_tokens or len(progress.tokens),
                mean_acceptance_length=acceptance if math.isfinite(acceptance) else 0.0,
                worker_id=entry.worker_id,
                time_to_first_token_s=max(0.0, first - arrival),
                finish_reason="stop" if stopped else FINISH_REASONS.get(msg.finish_reason, "length"),
                decode_steps=usage.decode_steps,
            ),
        )

    # ----------------------------------------------------------------------------------- settle
    def _background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    def _reclaim_later(self, request: kv_pb.ReserveRequest) -> None:
        """A Reserve whose answer never came may have reserved: find out and abort (background)."""
        self._background(self._reclaim(request))

    async def _reclaim(self, request: kv_pb.ReserveRequest) -> bool:
        """Re-send the identical Reserve (idempotent per request id: it returns the live
        reservation if the lost one happened, or makes one) and abort what it returns. Returns
        whether a reservation was aborted. A generous deadline: the kvstore was slow a moment ago."""
        timeout = 4 * self.config.kvstore_timeout_s
        try:
            resp = await self._kv.Reserve(request, timeout=timeout)
            r = resp.reservation
            await self._kv.Abort(kv_pb.AbortRequest(reservation_id=r.reservation_id, incarnation=r.incarnation),
                                 timeout=timeout)
            return True
        except grpc.aio.AioRpcError as err:
            # RESOURCE_EXHAUSTED / FAILED_PRECONDITION / NOT_FOUND: nothing is live under this id
            # (a live reservation would have been returned first); otherwise the kvstore is gone.
            log.debug("reclaim of %s: %s %s", request.request_id, err.code().name, err.details())
            return False

    def _settle_later(self, entry: WorkerEntry, reservation: kv_pb.Reservation, worker_request_id: str) -> None:
        """Settle a reservation the worker never acknowledged, in the background (see module doc)."""
        self._background(self._settle(entry, reservation, worker_request_id))

    async def _settle(self, entry: WorkerEntry, reservation: kv_pb.Reservation, worker_request_id: str) -> str:
        """Returns who ends the reservation: "worker", "router" or "gone" (already ended)."""
        timeout = self.config.worker_probe_timeout_s
        try:
            await self._worker_stub(entry.address).Abort(
                worker_pb.AbortRequest(request_id=worker_request_id), timeout=timeout
            )
            return "worker"  # it had the request; it aborts after its GPU step completed
        except grpc.aio.AioRpcError as err:
            log.debug("worker %s abort probe for %s: %s", entry.worker_id, worker_request_id, err.code().name)
        try:
            await self._kv.Abort(
                kv_pb.AbortRequest(reservation_id=reservation.reservation_id, incarnation=reservation.incarnation),
                timeout=self.config.kvstore_timeout_s,
            )
            return "router"
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                return "gone"  # ended, or the worker re-registered (its blocks were dropped)
            log.warning("could not abort reservation %s on %s: %s %s", reservation.reservation_id,
                        entry.worker_id, err.code().name, err.details())
            return "unknown"

    # -------------------------------------------------------------------------------- generate
    async def generate(self, job: GenerateJob, tenant: Tenant, *, deadline: float | None,
                       arrival: float) -> AsyncIterator[TextDelta | Completion]:
        """Serve ``job`` for ``tenant``: yields deltas, then one Completion. ``deadline`` is the
        client's (monotonic seconds, None = none). Raises typed errors (see ``retry``)."""
        # request ids are the tenant's: scoped by it here and in every id sent on
        scoped = f"{tenant.scope}/{job.request_id}"
        if scoped in self._live:
            raise AlreadyExists(f"request {job.request_id[:64]!r} is already running on this router")
        self._live.add(scoped)
        try:
            prompt_pb = tokens_to_proto(job.prompt)
            state = AttemptState(scoped, self.config.max_attempts)
            while True:
                with self._tracer.start_as_current_span("reserve") as span:
                    entry, reservation, num_draft_tokens = await self._reserve(job, tenant, prompt_pb, state, deadline)
                    span.set_attribute("tandem.worker_id", entry.worker_id)
                    span.set_attribute("tandem.reused_positions", reservation.reused_positions)
                    span.set_attribute("tandem.num_draft_tokens", num_draft_tokens)
                worker_request_id = state.reservation_request_id()
                progress = _Progress(self._tokenizer, job.sampling.stop_strings)
                progress.last_heard_at = self._clock()  # a stream that just began counts as heard
                finished = False
                stream = self._stream(job, entry, reservation, num_draft_tokens, worker_request_id, deadline, arrival, progress)
                self.directory.begin(entry.worker_id)
                try:
                    try:
                        async for event in stream:
                            if isinstance(event, Completion):
                                finished = True
                            yield event
                    finally:
                        await stream.aclose()  # cancels the worker call at once if we stop early
                    return
                except _WorkerFailed as failure:
                    if not progress.acknowledged:
                        self._settle_later(entry, reservation, worker_request_id)
                    if state.worker_is_broken(failure.code_name):
                        self.directory.mark_failed(entry.worker_id)
                    log.info("request %s: worker %s failed (%s)", job.request_id, entry.worker_id, failure)
                    state.worker_failed(entry.worker_id, failure.code_name, failure.message,
                                        streamed_tokens=len(progress.tokens), incarnation=entry.incarnation)
                except BaseException:
                    # cancelled, expired, or the consumer stopped early
                    if not finished and not progress.acknowledged:
                        self._settle_later(entry, reservation, worker_request_id)
                    raise
                finally:
                    self.directory.end(entry.worker_id)
        finally:
            self._live.discard(scoped)

    # ----------------------------------------------------------------------------- list workers
    async def _health(self, address: str) -> str:
        try:
            resp = await health_pb2_grpc.HealthStub(self._channels.get(address)).Check(
                health_pb2.HealthCheckRequest(), timeout=self.config.worker_probe_timeout_s
            )
        except grpc.aio.AioRpcError:
            return "UNREACHABLE"
        return "SERVING" if resp.status == health_pb2.HealthCheckResponse.SERVING else "NOT_SERVING"

    async def list_workers(self, *, deadline: float | None) -> list[WorkerView]:
        """Every registered worker with its health as seen from here (refreshes the directory)."""
        entries = await self.refresh_directory(deadline)
        healths = await asyncio.gather(*(self._health(e.address) for e in entries))
        return [WorkerView(e, h, self.directory.in_flight(e.worker_id)) for e, h in zip(entries, healths)]

    async def close(self, timeout_s: float = 2.0) -> None:
        """Let pending settle tasks finish (bounded), then cancel the rest."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        pending = list(self._cleanup)
        if pending:
            _done, still = await asyncio.wait(pending, timeout=timeout_s)
            for task in still:
                task.cancel()
