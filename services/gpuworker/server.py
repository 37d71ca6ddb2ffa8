"""Assemble a running gpuworker: the engine side (``runtime.py``: model, pools, engine, runner; in
an engine process of its own or on a thread) + gRPC server, registered with the kvstore and kept
alive by heartbeats (re-registering with a new incarnation if the kvstore forgot it)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import trace

from services.common.errors import FailedPrecondition, NotFound, TandemError
from services.common.auth import suite_credentials, warn_if_insecure
from services.common.channels import open_channel
from services.common.metrics import ServiceMetrics
from services.common.peers import PeerRoleInterceptor
from services.common.server import GrpcServer, ServiceBinding
from services.common.spec import SpecMode
from services.common.startup import wait_for
from services.common.telemetry import ServerTracingInterceptor
from services.gpuworker.engine_process import EngineProcess
from services.gpuworker.kvstore_link import KVStoreLink
from services.gpuworker.metrics import WorkerMetrics
from services.gpuworker.reservation_reader import ReservationReader
from services.gpuworker.runner import EngineRunner
from services.gpuworker.runtime import build_runtime
from services.gpuworker.servicer import ROLE_RULES, WorkerServicer
from services.gpuworker.settings import WorkerSettings
from tandem.worker.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


@dataclass
class WorkerIdentity:
    """What this worker is; reported by Info and registered with the kvstore."""

    worker_id: str
    address: str
    model_id: str
    spec_mode: SpecMode
    mtp_depth: int
    block_size: int
    num_blocks: int
    vocab_size: int
    max_seq_len: int
    max_draft_tokens: int  # 0 without a draft
    backend: str
    device: str
    link: KVStoreLink
    model_name: str = ""  # the --model it was started with (Info reports it to routers)
    num_draft_tokens: int = 0  # the k routers ask for when the request and their settings do not say

    @property
    def has_draft(self) -> bool:
        return self.max_draft_tokens > 0

    def register(self) -> None:
        self.link.register(**self.registration())

    def registration(self) -> dict:
        """``KVStoreLink.register``'s keyword arguments (plain values)."""
        return dict(
            worker_id=self.worker_id,
            address=self.address,
            model_id=self.model_id,
            spec_mode=self.spec_mode,
            mtp_depth=self.mtp_depth,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
        )


async def start_worker(
    settings: WorkerSettings,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    metrics: ServiceMetrics | None = None,
    before_register: Callable[[], object] | None = None,
) -> tuple[GrpcServer, EngineRunner | EngineProcess, WorkerIdentity]:
    """Load the model, build pools and engine, warm it up (kernels compiled, CUDA graphs
    captured), serve, register; health SERVING only after all of that.

    The engine runs in a process of its own (``engine_process.py``) or on a thread of this one
    (``settings.separate_engine_process``); the runner returned has the same public surface.
    With ``settings.metrics_port`` set, metrics are recorded into ``metrics`` (a new
    :class:`ServiceMetrics` if None; pass one to read its port) and served on that port.
    ``before_register()`` runs once the engine is warm and this server listens, before the kvstore
    (and so any router) learns of the worker: ``tandem worker`` freezes its start-up heap there.
    """
    server_credentials, channel_credentials = suite_credentials(settings)
    warn_if_insecure(settings, log)
    link = KVStoreLink(settings.kvstore, timeout_s=settings.rpc_timeout_s, credentials=channel_credentials)
    interceptors: list = [ServerTracingInterceptor(tracer_provider)]
    worker_metrics: WorkerMetrics | None = None
    if settings.metrics_port is not None:
        metrics = metrics or ServiceMetrics("gpuworker")
        interceptors.append(metrics.interceptor())
        worker_metrics = WorkerMetrics(metrics, running=lambda: runner.running,  # read at scrape time
                                       model_name=settings.model, kv_usage=_kv_usage_probe(settings, channel_credentials))
        interceptors.append(worker_metrics.interceptor())
    if server_credentials is not None:
        interceptors.append(PeerRoleInterceptor(ROLE_RULES))
    server = GrpcServer(
        [],  # the servicer needs the identity, which needs the bound port: added below
        host=settings.host,
        port=settings.port,
        max_receive_bytes=settings.max_receive_bytes,
        grace_s=settings.grace_s,
        interceptors=interceptors,
        server_credentials=server_credentials,
    )
    runner: EngineRunner | EngineProcess
    if settings.separate_engine_process:
        loop = asyncio.get_running_loop()
        runner = EngineProcess(settings, metrics=worker_metrics is not None,
                               on_tally=worker_metrics.record if worker_metrics is not None else None,
                               on_idle=worker_metrics.on_idle if worker_metrics is not None else None,
                               # a worker without its engine stops; its supervisor starts a new incarnation
                               on_exit=lambda: loop.call_soon_threadsafe(lambda: loop.create_task(server.stop())))
        facts = await runner.start()
    else:
        runner, facts = await asyncio.to_thread(
            build_runtime, settings, link, on_step=worker_metrics.on_step if worker_metrics is not None else None,
            on_idle=worker_metrics.on_idle if worker_metrics is not None else None)
    identity = WorkerIdentity(
        worker_id=settings.worker_id,
        address="",
        model_id=facts.model_id,
        spec_mode=facts.spec_mode,
        mtp_depth=settings.mtp_depth if facts.spec_mode is SpecMode.MTP else 1,
        block_size=settings.block_size,
        num_blocks=facts.num_blocks,
        vocab_size=facts.vocab_size,
        max_seq_len=facts.max_seq_len,
        max_draft_tokens=facts.max_draft_tokens,
        num_draft_tokens=facts.num_draft_tokens,
        backend=settings.backend,
        device=facts.device,
        link=link,
        model_name=settings.model,
    )
    # on this loop: a thread's blocking read would wait for the GIL behind the event loop
    reservations = ReservationReader(open_channel(settings.kvstore, credentials=channel_credentials, trace=False),
                                     timeout_s=settings.rpc_timeout_s)
    servicer = WorkerServicer(runner, identity, reservations, tracer_provider=tracer_provider,
                              on_usage=worker_metrics.observe_usage if worker_metrics is not None else None,
                              stream_interval=settings.stream_interval)
    server.add_binding(ServiceBinding(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, SERVICE_NAME))
    if settings.metrics_port is not None:
        metrics.ready = lambda: server.serving  # /ready follows gRPC health
        metrics.serve(settings.host, settings.metrics_port)  # a taken port fails before gRPC binds
        server.on_stop(metrics.stop)
    try:
        port = await server.start()
    except BaseException:
        await reservations.close()
        await asyncio.to_thread(runner.stop)
        raise
    server.on_stop(reservations.close)
    identity.address = settings.advertise or f"{settings.host}:{port}"
    if isinstance(runner, EngineRunner):
        runner.start()
    server.on_stop(lambda: runner.stop())
    if before_register is not None:
        before_register()
    log.info("worker %s: registering with the kvstore at %s", settings.worker_id, settings.kvstore)
    # The kvstore may come up after us (compose, Kubernetes): wait with bounded backoff, NOT_SERVING.
    await wait_for(lambda: asyncio.to_thread(identity.register), what=f"the kvstore at {settings.kvstore}", logger=log)
    # an engine in its own process has a link of its own: it must name the same incarnation
    await asyncio.to_thread(runner.adopt_registration, link.incarnation, settings.worker_id)
    server.run_in_background(_heartbeat(identity, runner, servicer, settings.heartbeat_s))
    await server.set_serving()
    log.info("worker %s serving on %s (incarnation %d, %d blocks, default k %d, engine %s)", identity.worker_id,
             identity.address, link.incarnation, facts.num_blocks, facts.num_draft_tokens,
             "in its own process" if settings.separate_engine_process else "on a thread")
    return server, runner, identity


def _kv_usage_probe(settings: WorkerSettings, credentials=None) -> Callable[[], float]:
    """``in_use / total`` of this worker's blocks as the kvstore counts them (called at scrape
    time from the metrics thread, on a channel of its own); NaN when the kvstore does not answer."""
    import grpc

    from services.common.channels import open_sync_channel
    from tandem.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

    stub = kvstore_pb2_grpc.KVStoreStub(open_sync_channel(settings.kvstore, credentials=credentials))

    def usage() -> float:
        try:
            stats = stub.Stats(kvstore_pb2.StatsRequest(worker_id=settings.worker_id), timeout=1.0)
        except grpc.RpcError:
            return float("nan")
        pools = [w.pool for w in stats.workers if w.worker_id == settings.worker_id and w.pool.total]
        return pools[0].in_use / pools[0].total if pools else float("nan")

    return usage


async def _heartbeat(identity: WorkerIdentity, runner: EngineRunner | EngineProcess, servicer: WorkerServicer, period_s: float) -> None:
    while True:
        await asyncio.sleep(period_s)
        try:
            beat = await asyncio.to_thread(identity.link.heartbeat, identity.worker_id)
            # the router ended these: stop what runs in them; confirm the rest (no step writes
            # them). Called on every beat: it also forgets the claims of finished requests.
            incarnation = identity.link.incarnation
            for rid in servicer.on_ending(list(beat.ending_reservation_ids)):
                await asyncio.to_thread(identity.link.abort, rid, incarnation)
        except (FailedPrecondition, NotFound):
            # The kvstore dropped us (a memory kvstore restarted, or the lease lapsed): come back
            # as a new incarnation with what we hold — the running requests keep running, and the
            # blocks our pages still hold go back into the shared cache.
            log.warning("kvstore forgot worker %s; re-registering with what it holds", identity.worker_id)
            try:
                incarnation = await asyncio.to_thread(runner.reregister, identity.registration())
                if isinstance(runner, EngineProcess):  # the engine process re-registered on its own link
                    identity.link.adopt(identity.worker_id, incarnation, restored=True)
            except TandemError as exc:
                log.warning("re-register failed: %s", exc.message)
        except TandemError as exc:
            log.warning("heartbeat failed: %s", exc.message)
