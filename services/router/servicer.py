"""gRPC adapter of the router: proto → validated job → :class:`Dispatcher` → proto.

Status codes of ``Router.Generate``: UNAUTHENTICATED (bearer token; by the auth interceptor, or
here if none is installed), INVALID_ARGUMENT (see ``jobs.build_job``; nothing reaches the kvstore),
RESOURCE_EXHAUSTED (no capacity before the deadline, or the wait queue is full), UNAVAILABLE (no
worker; a worker failed after tokens were streamed; retries used up), ALREADY_EXISTS (the request
id is already running here), DEADLINE_EXCEEDED / CANCELLED (client), INTERNAL.
"""

from __future__ import annotations

import time

from services.common import path_trace
from services.common.auth import current_principal
from services.common.errors import InvalidArgument, Unavailable
from services.common.tokenizer import Tokenizer
from services.common.wire import FINISH_REASONS, logprobs_to_proto, tokens_from_proto
from services.router.dispatcher import Completion, Dispatcher
from services.router.front_trace import FrontTrace, prompt_key
from services.router.jobs import RequestLimits, build_job, sample_jobs
from services.router.samples import first_events, merged
from services.router.tenants import Tenant, TenantRegistry
from tandem.common.v1 import common_pb2 as common_pb
from tandem.router.v1 import router_pb2 as pb
from tandem.router.v1 import router_pb2_grpc


_FINISH_ENUM = {name: value for value, name in FINISH_REASONS.items()}


def _deadline(context, now: float) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else now + remaining


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Thin adapter over one :class:`Dispatcher`."""

    def __init__(self, dispatcher: Dispatcher, tenants: TenantRegistry, tokenizer: Tokenizer | None, limits: RequestLimits | None,
                 *, trace: FrontTrace | None = None):
        # tokenizer and limits are None until ``--model auto`` learned the model from a worker
        self.dispatcher = dispatcher
        self.trace = trace  # debug: per-request timestamps (front_trace); None = off
        self.tenants = tenants
        self.tokenizer = tokenizer
        self.limits = limits

    def _tenant(self) -> Tenant:
        principal = current_principal()
        if isinstance(principal, Tenant):
            return principal
        # No auth interceptor in front of us: fail closed (public only in demo mode).
        return self.tenants.authenticate(None)

    async def Generate(self, request, context):
        arrival = time.monotonic()
        path_trace.stamp("router.entry", request.request_id)
        stamps = self.trace.start("grpc") if self.trace is not None else None
        tenant = self._tenant()
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidArgument("prompt is empty: set text or token_ids")
        if self.tokenizer is None or self.limits is None:
            raise Unavailable("no worker is registered yet, so the router does not know its model (or start it with --model)")
        token_ids = tokens_from_proto(request.token_ids, field="token_ids") if which == "token_ids" else None
        jobs = sample_jobs(request.n or 1, lambda *, seed, request_id: build_job(
            text=request.text if which == "text" else None,
            token_ids=token_ids,
            max_new_tokens=request.max_new_tokens,
            temperature=request.temperature if request.HasField("temperature") else 1.0,  # OpenAI's default
            top_p=request.top_p if request.HasField("top_p") else 1.0,
            top_k=request.top_k,
            seed=seed,
            num_draft_tokens=request.num_draft_tokens if request.HasField("num_draft_tokens") else None,
            stop_token_ids=request.stop_token_ids,
            stop_strings=request.stop,
            ignore_eos=request.ignore_eos,
            min_p=request.min_p,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty if request.HasField("repetition_penalty") else 1.0,
            logprobs=request.logprobs if request.HasField("logprobs") else None,
            request_id=request_id,
            limits=self.limits,
            tokenizer=self.tokenizer,
        ), seed=request.seed if request.HasField("seed") else None, request_id=request.request_id)
        deadline = _deadline(context, arrival)
        if stamps is not None:
            stamps.key = prompt_key(jobs[0].prompt)
            stamps.mark("dispatch")
        streams = [self.dispatcher.generate(job, tenant, deadline=deadline, arrival=arrival) for job in jobs]
        # one sample: its stream as it is (no generator in between: one step less per message)
        events = streams[0] if len(streams) == 1 else merged(await first_events(streams), streams)
        async for item in events:
            index, event = (0, item) if len(streams) == 1 else item
            if stamps is not None:
                stamps.mark("first_event")
            logprobs = logprobs_to_proto(event.logprobs) if event.logprobs else None  # per token: skip when not asked
            if isinstance(event, Completion):
                u = event.usage
                response = pb.GenerateResponse(
                    text=event.text,
                    token_ids=event.token_ids,
                    logprobs=logprobs,
                    index=index,
                    usage=common_pb.Usage(
                        prompt_tokens=u.prompt_tokens,
                        cached_tokens=u.cached_tokens,
                        completion_tokens=u.completion_tokens,
                        mean_acceptance_length=u.mean_acceptance_length,
                        decode_steps=u.decode_steps,
                        worker_id=u.worker_id,
                        time_to_first_token_s=u.time_to_first_token_s,
                    ),
                    finish_reason=_FINISH_ENUM[u.finish_reason],
                )
            else:
                response = pb.GenerateResponse(text=event.text, token_ids=event.token_ids, logprobs=logprobs, index=index)
            if stamps is not None:
                stamps.mark("first_write")
            yield response

    async def ListWorkers(self, request, context):
        self._tenant()  # same authentication as Generate
        views = await self.dispatcher.list_workers(deadline=_deadline(context, time.monotonic()))
        return pb.ListWorkersResponse(
            workers=[
                pb.WorkerStatus(
                    worker_id=v.entry.worker_id,
                    address=v.entry.address,
                    model_id=v.entry.model_id,
                    spec_mode=v.entry.spec_mode,
                    span=v.entry.span,
                    block_size=v.entry.block_size,
                    num_blocks=v.entry.num_blocks,
                    used_blocks=v.entry.used_blocks,
                    health=v.health,
                    in_flight=v.in_flight,
                )
                for v in views
            ]
        )
