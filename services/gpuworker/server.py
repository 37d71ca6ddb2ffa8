"""Assemble a running gpuworker: model + pools + engine + engine thread + gRPC server, registered
with the kvstore and kept alive by heartbeats (re-registering with a new incarnation if the
kvstore forgot it)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from opentelemetry import trace

from services.common.errors import FailedPrecondition, NotFound, TandemError
from services.common.metrics import ServiceMetrics
from services.common.server import GrpcServer, ServiceBinding
from services.common.spec import SpecMode
from services.common.startup import StartupError, wait_for
from services.common.telemetry import ServerTracingInterceptor
from services.gpuworker.attention.base import AttentionGeometry, get_backend
from services.gpuworker.engine.engine import Engine, EngineConfig
from services.gpuworker.kvstore_link import KVStoreLink, ReservationBlockSource
from services.gpuworker.metrics import WorkerMetrics
from services.gpuworker.model.loader import load_model
from services.gpuworker.runner import EngineRunner
from services.gpuworker.servicer import WorkerServicer
from services.gpuworker.settings import WorkerSettings
from tandem.worker.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
_SPEC_MODES = {"none": SpecMode.NONE, "eagle3": SpecMode.EAGLE3, "mtp": SpecMode.MTP}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    max_draft_tokens: int
    backend: str
    device: str
    draft: object
    link: KVStoreLink
    model_name: str = ""  # the --model it was started with (Info reports it to routers)

    def register(self) -> None:
        self.link.register(
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


DEFAULT_CUDA_KV_FRACTION = 0.9  # of the memory left free after the model loaded (vLLM, SGLang: ~0.9)


def free_device_bytes(device: torch.device) -> int:
    """Memory free on ``device`` now: CUDA's own count, or the machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budget_bytes(settings: WorkerSettings, device_type: str, free_bytes: Callable[[], int]) -> int:
    """Bytes for the target + draft KV pools: ``kv_memory_fraction`` of ``free_bytes()`` (0.9 by
    default on CUDA), else ``kv_memory_mb``."""
    fraction = settings.kv_memory_fraction
    if fraction is None and device_type == "cuda":
        fraction = DEFAULT_CUDA_KV_FRACTION
    if fraction is None:
        return int(settings.kv_memory_mb * 2**20)
    return int(free_bytes() * fraction)


def pool_blocks(settings: WorkerSettings, target, draft, dtype: torch.dtype, budget_bytes: int | None = None) -> int:
    """``num_blocks`` as given, or as many paired blocks as ``budget_bytes`` (default
    ``kv_memory_mb``) holds: one block is a page in every target layer plus a page in every draft layer."""
    if settings.num_blocks:
        return settings.num_blocks
    if budget_bytes is None:
        budget_bytes = int(settings.kv_memory_mb * 2**20)
    c = target.config
    layers = c.num_layers + (draft.num_kv_layers if draft is not None else 0)
    per_block = layers * 2 * settings.block_size * c.num_kv_heads * c.head_dim * torch.finfo(dtype).bits // 8
    blocks = int(budget_bytes // per_block)
    if blocks > settings.max_num_blocks:
        log.info("KV budget holds %d blocks; capped at max_num_blocks=%d", blocks, settings.max_num_blocks)
        blocks = settings.max_num_blocks
    if blocks < 1:
        raise StartupError(f"the KV memory budget ({budget_bytes} bytes) holds no block of {per_block} bytes; raise --kv-memory-mb or --kv-memory-fraction")
    return blocks


async def start_worker(
    settings: WorkerSettings,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    metrics: ServiceMetrics | None = None,
) -> tuple[GrpcServer, EngineRunner, WorkerIdentity]:
    """Load the model, build pools and engine, serve, register; health SERVING once registered.

    With ``settings.metrics_port`` set, metrics are recorded into ``metrics`` (a new
    :class:`ServiceMetrics` if None; pass one to read its port) and served on that port.
    """
    spec_mode = _SPEC_MODES[settings.spec_mode]
    dtype = _DTYPES[settings.dtype]
    device = torch.device(settings.device)
    try:
        target, draft, _tokenizer = await asyncio.to_thread(
            load_model, settings.model, spec_mode=spec_mode, mtp_depth=settings.mtp_depth, dtype=dtype, device=device,
            seed=settings.seed, draft_dir=settings.draft_model or None,
        )
    except TandemError as exc:  # a missing or unusable model folder: one line, not a traceback
        raise StartupError(f"cannot load model {settings.model!r}: {exc.message}") from None
    num_blocks = pool_blocks(settings, target, draft, dtype, kv_budget_bytes(settings, device.type, lambda: free_device_bytes(device)))
    c = target.config
    target_pool = target.new_kv_pool(num_blocks, settings.block_size)
    draft_pool = draft.new_kv_pool(num_blocks, settings.block_size) if draft is not None else None
    geometry = AttentionGeometry(c.num_heads, c.num_kv_heads, c.head_dim, settings.block_size, dtype)
    backend = get_backend(settings.backend, device, geometry)
    link = KVStoreLink(settings.kvstore, timeout_s=settings.rpc_timeout_s)
    source = ReservationBlockSource(link)
    engine = Engine(
        target,
        draft,
        backend,
        target_pool,
        draft_pool,
        source,
        EngineConfig(
            max_batch_tokens=settings.max_batch_tokens,
            chunk_size=settings.chunk_size,
            max_batch_size=settings.max_batch_size,
            max_draft_tokens=settings.max_draft_tokens,
        ),
    )
    interceptors: list = [ServerTracingInterceptor(tracer_provider)]
    worker_metrics: WorkerMetrics | None = None
    if settings.metrics_port is not None:
        metrics = metrics or ServiceMetrics("gpuworker")
        interceptors.append(metrics.interceptor())
        worker_metrics = WorkerMetrics(metrics, running=lambda: runner.running,  # read at scrape time
                                       model_name=settings.model, kv_usage=_kv_usage_probe(settings))
        interceptors.append(worker_metrics.interceptor())
    runner = EngineRunner(
        engine, link, source, max_running=settings.max_running,
        on_step=worker_metrics.on_step if worker_metrics is not None else None,
    )

    server = GrpcServer(
        [],  # the servicer needs the identity, which needs the bound port: added below
        host=settings.host,
        port=settings.port,
        max_receive_bytes=settings.max_receive_bytes,
        grace_s=settings.grace_s,
        interceptors=interceptors,
    )
    identity = WorkerIdentity(
        worker_id=settings.worker_id,
        address="",
        # the draft's weights shape the draft KV, so they are part of the cache namespace too
        model_id=target.fingerprint + (f"+{draft.fingerprint}" if draft is not None else ""),
        spec_mode=spec_mode,
        mtp_depth=settings.mtp_depth if spec_mode is SpecMode.MTP else 1,
        block_size=settings.block_size,
        num_blocks=num_blocks,
        vocab_size=c.vocab_size,
        max_seq_len=engine.max_seq_len,
        max_draft_tokens=settings.max_draft_tokens if draft is not None else 0,
        backend=settings.backend,
        device=str(device),
        draft=draft,
        link=link,
        model_name=settings.model,
    )
    server.add_binding(ServiceBinding(worker_pb2_grpc.add_WorkerServicer_to_server, WorkerServicer(runner, identity, tracer_provider=tracer_provider), SERVICE_NAME))
    if settings.metrics_port is not None:
        metrics.ready = lambda: server.serving  # /ready follows gRPC health
        metrics.serve(settings.host, settings.metrics_port)  # a taken port fails before gRPC binds
        server.on_stop(metrics.stop)
    port = await server.start()
    identity.address = settings.advertise or f"{settings.host}:{port}"
    runner.start()
    # The kvstore may come up after us (compose, Kubernetes): wait with bounded backoff, NOT_SERVING.
    await wait_for(lambda: asyncio.to_thread(identity.register), what=f"the kvstore at {settings.kvstore}", logger=log)
    server.run_in_background(_heartbeat(identity, runner, settings.heartbeat_s))
    server.on_stop(lambda: runner.stop())
    await server.set_serving()
    log.info("worker %s serving on %s (incarnation %d, %d blocks)", identity.worker_id, identity.address, link.incarnation, num_blocks)
    return server, runner, identity


def _kv_usage_probe(settings: WorkerSettings) -> Callable[[], float]:
    """``in_use / total`` of this worker's blocks as the kvstore counts them (called at scrape
    time from the metrics thread, on a channel of its own); NaN when the kvstore does not answer."""
    import grpc

    from tandem.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

    stub = kvstore_pb2_grpc.KVStoreStub(grpc.insecure_channel(settings.kvstore))

    def usage() -> float:
        try:
            stats = stub.Stats(kvstore_pb2.StatsRequest(worker_id=settings.worker_id), timeout=1.0)
        except grpc.RpcError:
            return float("nan")
        pools = [w.pool for w in stats.workers if w.worker_id == settings.worker_id and w.pool.total]
        return pools[0].in_use / pools[0].total if pools else float("nan")

    return usage


async def _heartbeat(identity: WorkerIdentity, runner: EngineRunner, period_s: float) -> None:
    while True:
        await asyncio.sleep(period_s)
        try:
            await asyncio.to_thread(identity.link.heartbeat, identity.worker_id)
        except (FailedPrecondition, NotFound):
            # The kvstore dropped us (lease lapsed or it restarted): our reservations are gone, so
            # fail what runs and come back as a new incarnation.
            log.warning("kvstore forgot worker %s; re-registering", identity.worker_id)
            for rid in runner.running_ids():
                runner.cancel(rid, FailedPrecondition("worker lease lapsed; request dropped"))
            try:
                await asyncio.to_thread(identity.register)
            except TandemError as exc:
                log.warning("re-register failed: %s", exc.message)
        except TandemError as exc:
            log.warning("heartbeat failed: %s", exc.message)
