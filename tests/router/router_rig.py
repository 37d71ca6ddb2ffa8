"""Router test rig (used by tests/router/conftest.py): a real kvstore, scripted test workers and the router, all on loopback.

``ScriptedWorker`` stands in for the gpuworker: a real ``tandem.worker.v1.Worker`` gRPC server that
streams deterministic tokens (the UTF-8 bytes of ``Script.text``, cycled) and ends its
reservation in the kvstore like the real worker must — Release (publishing the prompt's full
blocks) on success, Abort on failure or cancellation, and only then forgets the request id (so a
router's ``Worker.Abort`` probe finds it while it still owns the reservation). It fails on demand:
before the first token, after some tokens, or slowly (for deadlines and cancellation)::

    test ──blocking stub──▶ router ──▶ kvstore (real)
                              └──────▶ ScriptedWorker ──Release/Abort──▶ kvstore
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field

import grpc

from services.common.channels import open_channel
from services.common.server import GrpcServer, ServiceBinding
from services.common.telemetry import ServerTracingInterceptor
from services.common.tokenizer import ByteTokenizer
from services.common.wire import tokens_from_proto, tokens_to_proto
from tandem.common.v1 import common_pb2
from tandem.kvstore.v1 import kvstore_pb2 as kv_pb
from tandem.kvstore.v1 import kvstore_pb2_grpc
from tandem.router.v1 import router_pb2, router_pb2_grpc
from tandem.worker.v1 import worker_pb2 as wpb
from tandem.worker.v1 import worker_pb2_grpc

TIMEOUT = 10.0
SALT_SECRET = b"router-rig-salt-secret"  # every router of the rig: one cache namespace per tenant
WORKER_SERVICE = wpb.DESCRIPTOR.services_by_name["Worker"].full_name


@dataclass
class Script:
    """How a ScriptedWorker behaves (may be changed between requests)."""

    text: str = "Tandem streams ünïcode text. "
    fail_before_first: bool = False
    fail_after: int | None = None  # UNAVAILABLE after this many tokens
    delay_s: float = 0.0  # before each token
    delay_before: dict[int, float] = field(default_factory=dict)  # token index -> seconds before it (besides delay_s)
    stall_after: int | None = None  # after this many tokens, send nothing more (a frozen worker)
    max_draft_tokens: int = 8  # what Info says the worker accepts
    num_draft_tokens: int | None = None  # the default k Info advertises (None: unset, as from an older worker)

    def token(self, i: int) -> int:
        data = self.text.encode("utf-8")
        return data[i % len(data)]

    def expected_text(self, n: int) -> str:
        data = self.text.encode("utf-8")
        return bytes(data[i % len(data)] for i in range(n)).decode("utf-8", errors="replace")


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """A Worker service over a script (see the module docstring). Runs on the service loop."""

    def __init__(self, worker_id: str, kv_address: str, script: Script, tracer_provider=None):
        self.worker_id = worker_id
        self.script = script
        self._kv_address = kv_address
        self._kv: kvstore_pb2_grpc.KVStoreStub | None = None
        self.requests: list[wpb.GenerateRequest] = []
        self.reservations: list[kv_pb.Reservation] = []  # as read from the kvstore, per request
        self.ended: dict[str, str] = {}  # worker request id -> "released" / "aborted"
        self.running: dict[str, asyncio.Event] = {}
        self.abort_probes: list[str] = []

    def kv(self) -> kvstore_pb2_grpc.KVStoreStub:
        if self._kv is None:  # opened lazily, on the loop
            self._kv = kvstore_pb2_grpc.KVStoreStub(open_channel(self._kv_address, default_timeout_s=5.0))
        return self._kv

    async def Generate(self, request, context):
        rid = request.request_id
        self.requests.append(request)
        stop = self.running[rid] = asyncio.Event()
        ref = request.reservation
        prompt = tokens_from_proto(request.prompt)
        generated: list[int] = []
        released = False
        reused = 0
        try:
            got = await self.kv().GetReservation(  # like the real worker: blocks from the kvstore
                kv_pb.GetReservationRequest(reservation_id=ref.reservation_id, incarnation=ref.incarnation), timeout=5)
            reused = got.reservation.reused_positions
            self.reservations.append(got.reservation)
            if self.script.fail_before_first:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted failure before the first token")
            n = request.sampling.max_new_tokens
            for i in range(n):
                delay_s = self.script.delay_s + self.script.delay_before.get(i, 0.0)
                if delay_s:
                    try:
                        await asyncio.wait_for(stop.wait(), delay_s)
                    except asyncio.TimeoutError:
                        pass
                if stop.is_set():
                    await context.abort(grpc.StatusCode.CANCELLED, "aborted by Worker.Abort")
                if self.script.stall_after is not None and i == self.script.stall_after:
                    await stop.wait()  # until Worker.Abort or the router cancels the call
                if self.script.fail_after is not None and i == self.script.fail_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"scripted failure after {i} tokens")
                generated.append(self.script.token(i))
                if i < n - 1:
                    yield wpb.GenerateResponse(token_ids=[generated[-1]])
                    continue
                await self.kv().Release(
                    kv_pb.ReleaseRequest(
                        reservation_id=ref.reservation_id,
                        incarnation=ref.incarnation,
                        new_tokens=tokens_to_proto(generated),
                        final_positions=len(prompt),
                    ),
                    timeout=5,
                )
                released = True
                self.ended[rid] = "released"
                yield wpb.GenerateResponse(
                    token_ids=[generated[-1]],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH,
                    usage=common_pb2.Usage(
                        prompt_tokens=len(prompt),
                        cached_tokens=reused,
                        completion_tokens=len(generated),
                        mean_acceptance_length=1.0,
                        decode_steps=len(generated),
                    ),
                )
        finally:
            if not released:
                try:
                    await self.kv().Abort(
                        kv_pb.AbortRequest(reservation_id=ref.reservation_id, incarnation=ref.incarnation,
                                           worker_id=self.worker_id), timeout=5
                    )
                finally:
                    self.ended[rid] = "aborted"
            self.running.pop(rid, None)  # only once the reservation has ended

    async def Abort(self, request, context):
        self.abort_probes.append(request.request_id)
        stop = self.running.get(request.request_id)
        if stop is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown request {request.request_id!r}")
        stop.set()
        return wpb.AbortResponse()

    async def Info(self, request, context):
        return wpb.InfoResponse(worker_id=self.worker_id, running=len(self.running),
                                max_draft_tokens=self.script.max_draft_tokens,
                                num_draft_tokens=self.script.num_draft_tokens)  # None leaves it unset


@dataclass
class Rig:
    """Handles to the services of one test."""

    kv: object  # RunningService with .stub (blocking KVStoreStub)
    start_service: object
    service_loop: object
    workers: dict[str, tuple[object, ScriptedWorker]] = field(default_factory=dict)
    tracer_provider: object = None

    # --- kvstore views
    def stats(self) -> kv_pb.StatsResponse:
        return self.kv.stub.Stats(kv_pb.StatsRequest(), timeout=TIMEOUT)

    def live(self) -> int:
        return self.stats().live_reservations

    def wait_no_live_reservations(self, timeout: float = 5.0) -> None:
        """Poll until every reservation ended (settling runs in the background), then audit."""
        end = time.monotonic() + timeout
        while self.live() and time.monotonic() < end:
            time.sleep(0.02)
        assert self.live() == 0, f"reservations leaked: {self.stats()}"
        audit = self.kv.stub.CheckInvariants(kv_pb.CheckInvariantsRequest(), timeout=TIMEOUT)
        assert audit.ok, audit.violations

    def incarnation(self, worker_id: str) -> int:
        workers = self.kv.stub.ListWorkers(kv_pb.ListWorkersRequest(), timeout=TIMEOUT).workers
        return next(w.incarnation for w in workers if w.worker_id == worker_id)

    def occupy(self, worker_id: str, blocks: int, block_size: int = 16, tag: str = "occupier") -> kv_pb.Reservation:
        """Hold ``blocks`` blocks of a worker with a reservation made directly in the kvstore."""
        tokens = [(7 * i + len(tag)) % 250 for i in range(blocks * block_size)]
        return self.kv.stub.Reserve(
            kv_pb.ReserveRequest(worker_id=worker_id, incarnation=self.incarnation(worker_id),
                                 request_id=f"{tag}-{worker_id}", tokens=tokens_to_proto(tokens)),
            timeout=TIMEOUT,
        ).reservation

    def free(self, reservation: kv_pb.Reservation) -> None:
        self.kv.stub.Abort(kv_pb.AbortRequest(reservation_id=reservation.reservation_id, incarnation=reservation.incarnation,
                                              worker_id=reservation.worker_id), timeout=TIMEOUT)

    # --- workers
    def register(self, worker_id: str, address: str, *, num_blocks: int = 64, block_size: int = 16,
                 max_seq_len: int = 4096, vocab_size: int | None = None) -> None:
        self.kv.stub.RegisterWorker(
            kv_pb.RegisterWorkerRequest(
                worker_id=worker_id, address=address, model_id="tiny",
                spec_mode=common_pb2.SPEC_MODE_NONE, block_size=block_size, num_blocks=num_blocks,
                vocab_size=vocab_size or ByteTokenizer().vocab_size, max_seq_len=max_seq_len,
            ),
            timeout=TIMEOUT,
        )

    def worker(self, worker_id: str, script: Script | None = None, *, serving: bool = True, **register) -> ScriptedWorker:
        """Start a ScriptedWorker, register it, return its servicer."""
        servicer = ScriptedWorker(worker_id, self.kv.address, script or Script(), self.tracer_provider)
        provider = self.tracer_provider

        async def start():
            interceptors = [ServerTracingInterceptor(provider)] if provider is not None else []
            server = GrpcServer([ServiceBinding(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, WORKER_SERVICE)],
                                port=0, grace_s=0, interceptors=interceptors)
            await server.start()
            if serving:
                await server.set_serving()
            return server, servicer

        svc = self.start_service(start)
        self.workers[worker_id] = (svc, servicer)
        self.register(worker_id, svc.address, **register)
        return servicer

    def dead_worker(self, worker_id: str, **register) -> str:
        """Register a worker at an address where nothing listens."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        address = f"127.0.0.1:{port}"
        self.register(worker_id, address, **register)
        return address

    # --- router
    def router(self, *, wait: bool = True, **overrides):
        from services.router.server import start_router
        from services.router.settings import RouterSettings

        settings = RouterSettings(**{
            "host": "127.0.0.1", "port": 0, "kvstore": self.kv.address, "grace_s": 0.0, "policy_seed": 0, "model": "tiny",
            "registry_ttl_s": 0.0, "queue_retry_s": 0.02, "queue_retry_max_s": 0.05,
            "worker_probe_timeout_s": 1.0, "salt_secret": SALT_SECRET.decode(), "kvstore_outage_wait_s": 0.3,
            **overrides,
        })
        provider = self.tracer_provider
        svc = self.start_service(lambda: start_router(settings, tracer_provider=provider))
        if wait:
            wait_serving(svc.channel)
        svc.stub = router_pb2_grpc.RouterStub(svc.channel)
        return svc


def wait_serving(channel, timeout: float = TIMEOUT) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    end = time.monotonic() + timeout
    while True:
        status = stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status
        if status == health_pb2.HealthCheckResponse.SERVING:
            return
        assert time.monotonic() < end, "router never became SERVING"
        time.sleep(0.02)


def collect(router_svc, *, metadata=None, timeout: float = TIMEOUT, **request):
    """Run Router.Generate to the end; return (messages, error or None). Greedy unless the request
    names a temperature (the API's unset temperature is OpenAI's 1.0)."""
    request.setdefault("temperature", 0.0)
    messages = []
    try:
        for msg in router_svc.stub.Generate(router_pb2.GenerateRequest(**request), timeout=timeout, metadata=metadata):
            messages.append(msg)
    except grpc.RpcError as err:
        return messages, err
    return messages, None
