"""Assemble a running kvstore: core store + servicer + the common gRPC server."""

from __future__ import annotations

import asyncio
import logging

from opentelemetry import trace

from services.common.auth import suite_credentials, warn_if_insecure
from services.common.metrics import ServiceMetrics
from services.common.peers import PeerRoleInterceptor
from services.common.server import GrpcServer, ServiceBinding
from services.common.telemetry import ServerTracingInterceptor
from services.kvstore.metrics import KVStoreCollector
from services.kvstore.servicer import ROLE_RULES, KVStoreServicer
from services.kvstore.settings import KVStoreSettings
from services.kvstore.store import KVStore
from tandem.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name


async def start_kvstore(
    settings: KVStoreSettings,
    *,
    store: KVStore | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    metrics: ServiceMetrics | None = None,
) -> tuple[GrpcServer, KVStore]:
    """Start serving (health SERVING once bound) and a lease reaper; return (server, store).

    With ``settings.metrics_port`` set, metrics are recorded into ``metrics`` (a new
    :class:`ServiceMetrics` if None; pass one to read its port) and served on that port.
    """
    store = store or KVStore(**settings.store_args())
    server_credentials, _ = suite_credentials(settings)
    warn_if_insecure(settings, log)
    servicer = KVStoreServicer(store, event_queue=settings.event_queue)
    interceptors: list = []
    provider = tracer_provider or trace.get_tracer_provider()
    if not isinstance(provider, (trace.NoOpTracerProvider, trace.ProxyTracerProvider)):
        # Only a recording provider gets the interceptor: the kvstore calls nobody, so without
        # one a span and the carried trace context serve no one (30-60 µs of CPU per RPC).
        interceptors.append(ServerTracingInterceptor(provider))
    if settings.metrics_port is not None:
        metrics = metrics or ServiceMetrics("kvstore")
        metrics.registry.register(KVStoreCollector(store, asyncio.get_running_loop()))
        interceptors.append(metrics.interceptor())
    if server_credentials is not None:
        interceptors.append(PeerRoleInterceptor(ROLE_RULES))  # after metrics: denials are counted
    server = GrpcServer(
        [ServiceBinding(kvstore_pb2_grpc.add_KVStoreServicer_to_server, servicer, SERVICE_NAME)],
        host=settings.host,
        port=settings.port,
        max_receive_bytes=settings.max_receive_bytes,
        max_concurrent_rpcs=settings.max_concurrent_rpcs,
        grace_s=settings.grace_s,
        interceptors=interceptors,
        server_credentials=server_credentials,
    )
    if settings.metrics_port is not None:
        metrics.serve(settings.host, settings.metrics_port)  # a taken port fails before gRPC binds
        server.on_stop(metrics.stop)
    await server.start()
    server.run_in_background(_reap_leases(store, settings.lease_ttl_s / 4))
    await server.set_serving()
    return server, store


async def _reap_leases(store: KVStore, period_s: float) -> None:
    # Lapsed leases are also dropped at the start of every verb; this makes it happen (and emit
    # CLEARED events) even when no call arrives.
    while True:
        await asyncio.sleep(period_s)
        store.expire_leases()
