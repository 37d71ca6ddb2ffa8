"""gRPC adapter of the worker: ``Worker.Generate`` / ``Info`` / ``Abort`` over an
:class:`~services.gpuworker.runner.EngineRunner`.

Generate validates the request, reads its reservation from the kvstore (block table, reused
prefix and the prompt it was reserved for: never from the caller, who could name another
request's blocks), hands a job to the engine thread and relays its events as stream messages. If the client goes away (cancel, deadline), the handler is cancelled and tells
the runner, which aborts the request between steps and then aborts its reservation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING


from opentelemetry import trace

from services.common import path_trace
from services.common.telemetry import get_tracer
from services.common.errors import (
    AlreadyExists,
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    TandemError,
)
from services.common.spec import lookahead_span
from services.common.wire import logprobs_to_proto, pack_tokens, spec_mode_to_proto, tokens_from_proto
from services.gpuworker.engine.engine import MAX_LOGPROBS
from services.gpuworker.engine.request import FinishReason, RequestSpec
from services.gpuworker.engine.sampling import SamplingParams
from services.gpuworker.reservation_reader import ReservationReader
from services.gpuworker.runner import AbortRequested, EngineRunner, Job, Usage
from tandem.common.v1 import common_pb2 as common_pb
from tandem.worker.v1 import worker_pb2 as pb
from tandem.worker.v1 import worker_pb2_grpc

if TYPE_CHECKING:
    from services.gpuworker.engine_process import EngineProcess

log = logging.getLogger(__name__)
MAX_REQUEST_ID_BYTES = 128
# tokens merged into one Generate message, about at most: with top-20 logprobs a token is ~230
# bytes on the wire, so a client far behind would otherwise get one message past gRPC's 4 MiB limit
MAX_TOKENS_PER_MESSAGE = 1024
ROUTER = frozenset({"router"})
# With mTLS only routers call a worker (services.common.peers.PeerRoleInterceptor).
ROLE_RULES = {"Generate": ROUTER, "Abort": ROUTER, "Info": ROUTER}

_FINISH = {  # OpenAI's reasons: the worker's max_seq_len is a length limit too
    FinishReason.LENGTH: common_pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb.FINISH_REASON_STOP,
    FinishReason.MAX_SEQ_LEN: common_pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb.FINISH_REASON_ABORT,
}


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Thin adapter; ``identity`` carries what Info reports (see ``server.WorkerIdentity``)."""

    def __init__(self, runner: "EngineRunner | EngineProcess", identity, reservations: ReservationReader, *,
                 tracer_provider: trace.TracerProvider | None = None,
                 on_usage: Callable[[Usage], None] | None = None, stream_interval: int = 1):
        self.runner = runner
        self.identity = identity
        self.reservations = reservations  # GetReservation on this event loop
        self.stream_interval = stream_interval  # tokens a message waits for after the first (settings)
        self._on_usage = on_usage  # metrics: each completed request's usage
        self._tracer = get_tracer(__name__, tracer_provider)
        # reservation id -> request id, from Generate until the runner ended the reservation;
        # ``_pending`` are those claimed but not yet handed to the runner (see on_ending).
        self._claims: dict[str, str] = {}
        self._pending: set[str] = set()

    def on_ending(self, reservation_ids) -> list[str]:
        """The kvstore lists reservations the router ended (heartbeat). Stop the requests that
        run in them (the runner then confirms after their last step); return those that no
        request of ours can be writing, for the caller to confirm now (mutates the claims)."""
        owned = self.runner.running_ids()
        confirm = []
        for rid in reservation_ids:
            request_id = self._claims.get(rid)
            if rid in self._pending:
                continue  # Generate is reading it: the kvstore will refuse it (ended)
            if request_id is not None and request_id in owned:
                self.runner.cancel(request_id, Cancelled("its reservation was ended by the router"))
                continue
            self._claims.pop(rid, None)
            confirm.append(rid)
        for rid, request_id in list(self._claims.items()):
            if rid not in self._pending and request_id not in owned:
                del self._claims[rid]  # finished: its reservation was ended by the runner
        return confirm

    async def _reserved(self, request, context):
        """(block table, reused positions, GetReservation answer) of the named reservation, read
        from the kvstore (resent through a kvstore outage while the caller's deadline allows, at
        most 10 s); InvalidArgument if the prompt is not the one it was reserved for;
        FAILED_PRECONDITION if the kvstore restarted since it was reserved (reserve again)."""
        ref = request.reservation
        remaining = context.time_remaining()
        retry_s = 10.0 if remaining is None else max(0.0, min(10.0, remaining - 0.5))
        try:
            got = await self.reservations.get(ref.reservation_id, ref.incarnation, retry_s=retry_s)
        except NotFound as exc:
            link = self.identity.link
            if ref.incarnation != link.incarnation or link.forgot_us(link.generation):
                # reserved in a memory kvstore that restarted since: the router reserves again
                raise FailedPrecondition(f"reservation not usable, the kvstore restarted: {exc.message}") from None
            raise NotFound(f"reservation not usable: {exc.message}") from None
        except TandemError as exc:
            raise type(exc)(f"reservation not usable: {exc.message}") from None
        prompt = tokens_from_proto(request.prompt, field="prompt")
        if got.prompt_packed != pack_tokens(prompt):
            raise InvalidArgument("the prompt is not the one the reservation was made for")
        r = got.reservation
        return list(r.block_table), int(r.reused_positions), got

    def _spec_from(self, request) -> RequestSpec:
        ident = self.identity
        if not request.request_id:
            raise InvalidArgument("request_id is required")
        if len(request.request_id.encode()) > MAX_REQUEST_ID_BYTES:
            raise InvalidArgument(f"request_id is longer than {MAX_REQUEST_ID_BYTES} bytes")
        prompt = tokens_from_proto(request.prompt, field="prompt")
        if prompt.size == 0:
            raise InvalidArgument("prompt must not be empty")
        if int(prompt.max()) >= ident.vocab_size:
            raise InvalidArgument(f"token id {int(prompt.max())} is outside the vocabulary of {ident.vocab_size}")
        if not request.HasField("reservation") or not request.reservation.reservation_id:
            raise InvalidArgument("reservation is required (obtain one from kvstore Reserve)")
        if request.reservation.incarnation != ident.link.incarnation:
            raise FailedPrecondition(
                f"reservation is for incarnation {request.reservation.incarnation}, this worker is {ident.link.incarnation}"
            )
        s = request.sampling
        if s.max_new_tokens < 1:
            raise InvalidArgument("sampling.max_new_tokens must be >= 1")
        k = request.spec.num_draft_tokens
        if k > ident.max_draft_tokens:
            raise InvalidArgument(f"num_draft_tokens {k} exceeds this worker's maximum {ident.max_draft_tokens}")
        if not ident.has_draft:
            k = 0  # no draft: plain decoding, whatever the caller hoped for
        if s.HasField("logprobs") and s.logprobs > MAX_LOGPROBS:
            raise InvalidArgument(f"sampling.logprobs must be in 0..{MAX_LOGPROBS}, got {s.logprobs}")
        sampling = SamplingParams(  # validates (InvalidArgument)
            temperature=float(s.temperature),
            top_p=float(s.top_p) if s.top_p else 1.0,
            top_k=int(s.top_k),
            seed=int(s.seed) if s.HasField("seed") else None,
            min_p=float(s.min_p),
            presence_penalty=float(s.presence_penalty),
            frequency_penalty=float(s.frequency_penalty),
            repetition_penalty=float(s.repetition_penalty) if s.HasField("repetition_penalty") and s.repetition_penalty else 1.0,
        )
        return RequestSpec(
            request_id=request.request_id,
            prompt_ids=[int(t) for t in prompt],
            block_table=[],  # from the kvstore (see _reserved)
            reused_positions=0,
            max_new_tokens=int(s.max_new_tokens),
            stop_ids=tuple(int(t) for t in s.stop_token_ids),
            sampling=sampling,
            k=int(k),
            logprobs=int(s.logprobs) if s.HasField("logprobs") else None,
        )

    async def Generate(self, request, context):
        path_trace.stamp("worker.entry", request.request_id)
        spec = self._spec_from(request)
        rid = request.reservation.reservation_id
        if rid in self._claims:
            raise AlreadyExists("the reservation is already in use by a request on this worker")
        self._claims[rid] = spec.request_id
        self._pending.add(rid)
        try:
            table, reused, got = await self._reserved(request, context)
            path_trace.stamp("worker.reserved", request.request_id)
            spec = dataclasses.replace(spec, block_table=table, reused_positions=reused)
            loop = asyncio.get_running_loop()
            job = Job(spec, rid, request.reservation.incarnation, loop, asyncio.Queue(),
                      cache_salt=got.cache_salt, kv_request_id=got.reservation.request_id)
            try:
                self.runner.submit(job)
            except AlreadyExists:
                # Another live request owns this id; the reservation sent with this one is ours to end.
                await asyncio.to_thread(self.identity.link.abort, job.reservation_id, job.incarnation)
                raise
        except BaseException:
            self._claims.pop(rid, None)
            raise
        finally:
            self._pending.discard(rid)
        started = time.time_ns()
        prefill_span = self._tracer.start_span("prefill", start_time=started, attributes={
            "tandem.request_id": spec.request_id,
            "tandem.prompt_tokens": len(spec.prompt_ids),
            "tandem.cached_tokens": spec.reused_positions,
        })
        decode_span = None
        finished = False
        pending = None  # an event taken while coalescing tokens, handled next
        # tokens held for ``stream_interval`` (none before the first message): ids, logprobs, counts
        ids, logprobs, counts, sent = [], [], (0, 0), False

        def take() -> pb.GenerateResponse:
            """The held tokens as one message; holds none after it."""
            nonlocal ids, logprobs
            message = pb.GenerateResponse(token_ids=ids, logprobs=logprobs_to_proto(logprobs) if logprobs else None,
                                          decode_steps=counts[0], accepted_drafts=counts[1])
            ids, logprobs = [], []
            return message

        try:
            while True:
                event, pending = pending or await job.events.get(), None
                kind = event[0]
                if kind == "tokens":
                    if decode_span is None:
                        now = time.time_ns()
                        prefill_span.end(end_time=now)
                        decode_span = self._tracer.start_span("decode", start_time=now, attributes={"tandem.request_id": spec.request_id})
                    # tokens of several steps waiting here (the client or the network is slower
                    # than the engine) go out as one message: fewer writes, no added latency;
                    # then, after the first message, ``stream_interval`` holds them back on purpose
                    ids.extend(event[1])
                    logprobs.extend(event[2] or ())
                    counts = event[3]
                    while len(ids) < MAX_TOKENS_PER_MESSAGE and not job.events.empty():
                        nxt = job.events.get_nowait()
                        if nxt[0] != "tokens":
                            pending = nxt
                            break
                        ids.extend(nxt[1])
                        logprobs.extend(nxt[2] or ())
                        counts = nxt[3]
                    if sent and len(ids) < self.stream_interval:
                        continue  # held for the interval (the end flushes what is held)
                    if not sent:
                        path_trace.stamp("worker.first", spec.request_id)
                    sent = True
                    yield take()
                elif ids:  # the end or an error: the tokens held go out first
                    pending = event
                    yield take()
                elif kind == "done":
                    _, reason, usage = event
                    finished = True
                    if self._on_usage is not None:
                        self._on_usage(usage)
                    if decode_span is not None:
                        decode_span.set_attribute("tandem.completion_tokens", usage.completion_tokens)
                        decode_span.set_attribute("tandem.mean_acceptance_length", usage.mean_acceptance_length)
                    yield pb.GenerateResponse(
                        finish_reason=_FINISH.get(reason, common_pb.FINISH_REASON_UNSPECIFIED),
                        usage=common_pb.Usage(
                            prompt_tokens=usage.prompt_tokens,
                            cached_tokens=usage.cached_tokens,
                            completion_tokens=usage.completion_tokens,
                            mean_acceptance_length=usage.mean_acceptance_length,
                            decode_steps=usage.decode_steps,
                            time_to_first_token_s=usage.time_to_first_token_s,
                            worker_id=self.identity.worker_id,
                        ),
                    )
                    return
                else:  # "error"
                    finished = True
                    raise event[1]
        finally:
            if not finished:  # the client went away (cancel / deadline): stop and free it
                self.runner.cancel(spec.request_id, Cancelled("client cancelled"))
            if decode_span is None:
                prefill_span.end()
            else:
                decode_span.end()

    async def Info(self, request, context):
        i = self.identity
        return pb.InfoResponse(
            worker_id=i.worker_id,
            model_id=i.model_id,
            spec_mode=spec_mode_to_proto(i.spec_mode),
            span=lookahead_span(i.spec_mode, i.mtp_depth),
            block_size=i.block_size,
            num_blocks=i.num_blocks,
            backend=i.backend,
            device=i.device,
            incarnation=i.link.incarnation,
            max_seq_len=i.max_seq_len,
            max_draft_tokens=i.max_draft_tokens,
            num_draft_tokens=i.num_draft_tokens,
            running=self.runner.running,
            model_name=i.model_name,
        )

    async def Abort(self, request, context):
        if not request.request_id:
            raise InvalidArgument("request_id is required")
        if request.request_id not in self.runner.running_ids():
            raise NotFound(f"no running request {request.request_id[:64]!r}")
        # the stream, if its client still reads it, ends with finish reason ABORT (not an error)
        self.runner.cancel(request.request_id, AbortRequested("aborted by Worker.Abort"))
        return pb.AbortResponse()
