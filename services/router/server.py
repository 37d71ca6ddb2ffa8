"""Assemble a running router: tokenizer, tenants, channels, dispatcher, servicer, gRPC server.

Health turns SERVING once the kvstore answers and lists a registered worker (the router can do
nothing useful before), and NOT_SERVING again while no worker is registered; the
server's interceptors are, outermost first: tracing (a span per RPC), metrics (when enabled),
bearer-token auth, then the common error mapping.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from opentelemetry import trace

from services.common.auth import (
    BearerAuthInterceptor,
    load_channel_credentials,
    load_server_credentials,
    suite_credentials,
    warn_if_insecure,
)
from services.common.channels import ChannelPool, open_channel, stream_window_options
from services.common.errors import TandemError, Unavailable
from services.common.metrics import ServiceMetrics
from services.common.server import GrpcServer, ServiceBinding
from services.common.startup import RETRYABLE, StartupError, wait_for
from services.common.telemetry import ServerTracingInterceptor
from services.common.tokenizer import Tokenizer, load_tokenizer
from services.router.directory import WorkerDirectory
from services.router.dispatcher import DispatchConfig, Dispatcher
from services.router.front_trace import FrontTrace
from services.router.jobs import RequestLimits
from services.router.metrics import RouterMetrics
from services.router.model_binding import AUTO, ModelBinding
from services.router.policy import PolicyWeights
from services.router.retry import WaitQueue
from services.router.servicer import RouterServicer
from services.router.settings import RouterSettings
from services.router.tenants import TenantRegistry, load_salt_secret
from tandem.router.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
WORKERS_PROBE_S = 1.0  # how often readiness re-reads the registry once the kvstore answered


@dataclass
class Router:
    """The parts of a running router (for the CLI and tests)."""

    servicer: RouterServicer
    dispatcher: Dispatcher
    tenants: TenantRegistry
    ready: asyncio.Event  # set once the kvstore answered and a compatible worker is registered (health SERVING)
    model: ModelBinding
    http_url: str | None = None  # the OpenAI-compatible HTTP front (settings.http_port), if served


def request_limits(settings: RouterSettings, tokenizer: Tokenizer) -> RequestLimits:
    """What requests may ask for, from the settings and the tokenizer (pure)."""
    return RequestLimits(
        vocab_size=tokenizer.vocab_size,
        max_new_tokens=settings.max_new_tokens,
        max_prompt_tokens=settings.max_prompt_tokens,
        default_draft_tokens=settings.num_draft_tokens,
        max_draft_tokens=settings.max_draft_tokens,
        eos_token_ids=frozenset(tokenizer.eos_token_ids),
    )


def dispatch_config(settings: RouterSettings) -> DispatchConfig:
    """The dispatcher's knobs from the settings (pure)."""
    return DispatchConfig(
        model_id=settings.model_id,
        policy=settings.policy,
        weights=PolicyWeights(settings.policy_alpha, settings.policy_beta, settings.policy_gamma),
        max_attempts=settings.max_attempts,
        queue_retry_s=settings.queue_retry_s,
        queue_retry_max_s=settings.queue_retry_max_s,
        max_queue_wait_s=settings.max_queue_wait_s,
        kvstore_timeout_s=settings.kvstore_timeout_s,
        kvstore_outage_wait_s=settings.kvstore_outage_wait_s,
        worker_probe_timeout_s=settings.worker_probe_timeout_s,
        max_request_s=settings.max_request_s,
        idle_timeout_s=settings.idle_timeout_s,
    )


async def start_router(
    settings: RouterSettings,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    metrics: ServiceMetrics | None = None,
    reuse_port: bool = False,
    before_serving: Callable[[], Awaitable[None]] | None = None,
) -> tuple[GrpcServer, Router]:
    """Start serving (health SERVING once the kvstore answers); return (server, parts).

    Configuration errors (tenants, TLS files, tokenizer) raise before anything binds. With
    ``settings.metrics_port`` set, metrics are recorded into ``metrics`` (a new
    :class:`ServiceMetrics` if None; pass one to read its port) and served on that port.
    ``reuse_port`` and ``before_serving`` are for the processes of ``--procs N``
    (services/router/procs.py): bind the gRPC and HTTP ports with ``SO_REUSEPORT`` (the parent
    holds them), and await ``before_serving()`` once, when this process is first ready, before
    health says SERVING (there it waits until every process of the group is ready).
    """
    tokenizer = None  # --model auto: learned from the first worker (see ModelBinding)
    if settings.model != AUTO:
        try:
            tokenizer = load_tokenizer(settings.model, settings.revision or None)
        except TandemError as exc:
            raise StartupError(f"cannot load the tokenizer of model {settings.model!r}: {exc.message}") from None
    try:
        secret = load_salt_secret(settings.salt_secret_file, settings.salt_secret)
    except TandemError as exc:
        raise StartupError(exc.message) from None
    if not (settings.salt_secret_file or settings.salt_secret):
        log.info("no --salt-secret-file: tenant cache salts use a random secret of this process "
                 "(routers of one deployment need the same secret to share the cache)")
    tenants = TenantRegistry.from_settings(settings.tenants, settings.shared_tenants, secret=secret)
    if not settings.upstream_ca_file:
        warn_if_insecure(settings, log)
    # upstream (kvstore, workers): the explicit upstream_* files, else the suite's mTLS identity
    upstream = (
        load_channel_credentials(settings.upstream_ca_file, settings.upstream_cert_file, settings.upstream_key_file)
        if settings.upstream_ca_file
        else suite_credentials(settings)[1]
    )
    server_credentials = (
        load_server_credentials(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file or None)
        if settings.tls_cert_file
        else None
    )
    kv_channel = open_channel(
        settings.kvstore, credentials=upstream, max_message_bytes=settings.max_receive_bytes,
        default_timeout_s=settings.kvstore_timeout_s,
    )
    channels = ChannelPool(  # Worker.Generate passes its deadline and trace context itself
        credentials=upstream, max_message_bytes=settings.max_receive_bytes, default_timeout_s=settings.max_request_s,
        intercept_streams=False, options=stream_window_options(settings.worker_stream_window_bytes),
    )
    dispatcher = Dispatcher(
        kvstore=kv_channel,
        channels=channels,
        tokenizer=tokenizer,
        directory=WorkerDirectory(ttl_s=settings.registry_ttl_s, cooldown_s=settings.failed_worker_cooldown_s),
        queue=WaitQueue(settings.max_queued),
        config=dispatch_config(settings),
        rng=random.Random(settings.policy_seed),
        tracer_provider=tracer_provider,
    )
    front_trace = FrontTrace(settings.front_trace) if settings.front_trace else None
    servicer = RouterServicer(dispatcher, tenants, tokenizer, request_limits(settings, tokenizer) if tokenizer else None,
                              trace=front_trace)

    def bind(learned: Tokenizer) -> None:
        servicer.tokenizer, servicer.limits = learned, request_limits(settings, learned)
        dispatcher.use_tokenizer(learned)

    binding = ModelBinding(settings.model, tokenizer, dispatcher.worker_model, on_bound=bind, revision=settings.revision)
    dispatcher.directory.compatible = binding.is_compatible
    interceptors: list = [ServerTracingInterceptor(tracer_provider)]
    router_metrics = None
    if settings.metrics_port is not None:
        metrics = metrics or ServiceMetrics("router")
        router_metrics = RouterMetrics(metrics, lambda: binding.model or "")
        # before auth, so that rejected tokens are counted too
        interceptors += [metrics.interceptor(), router_metrics.interceptor()]
    interceptors.append(BearerAuthInterceptor(tenants.authenticate))
    server = GrpcServer(
        [ServiceBinding(router_pb2_grpc.add_RouterServicer_to_server, servicer, SERVICE_NAME)],
        host=settings.host,
        port=settings.port,
        max_receive_bytes=settings.max_receive_bytes,
        max_concurrent_rpcs=settings.max_concurrent_rpcs,
        grace_s=settings.grace_s,
        interceptors=interceptors,
        server_credentials=server_credentials,
        reuse_port=reuse_port,
    )
    router = Router(servicer, dispatcher, tenants, asyncio.Event(), binding)
    http = _http_front(settings, router, router_metrics, reuse_port) if settings.http_port is not None else None  # binds first
    if settings.metrics_port is not None:
        metrics.ready = lambda: server.serving  # /ready follows gRPC health
        metrics.serve(settings.host, settings.metrics_port)  # a taken port fails before gRPC binds
        server.on_stop(metrics.stop)
    if front_trace is not None:
        server.on_stop(front_trace.close)
    await server.start()
    if http is not None:
        await http.start()
        server.run_in_background(http.run())  # cancelled (then drained) when the gRPC server stops
        router.http_url = http.url
    server.run_in_background(_lifetime(server, router, kv_channel, channels, settings.kvstore, before_serving))
    return server, router


def _http_front(settings: RouterSettings, router: Router, metrics: RouterMetrics | None, reuse_port: bool = False):
    """The OpenAI HTTP front over this router's dispatcher, its socket bound (not serving yet)."""
    from services.router.http.app import OpenAIFront  # imported only when served
    from services.router.http.server import HttpFront, bind

    servicer = router.servicer
    front = OpenAIFront(router.dispatcher, router.tenants,
                        lambda: (servicer.tokenizer, servicer.limits, router.model.model), metrics=metrics,
                        trace=servicer.trace, max_body_bytes=settings.max_receive_bytes)
    return HttpFront(front.app(), bind(settings.host, settings.http_port, reuse_port=reuse_port), grace_s=settings.grace_s)


async def _lifetime(server: GrpcServer, router: Router, kv_channel, channels: ChannelPool, kvstore: str,
                    before_serving: Callable[[], Awaitable[None]] | None = None) -> None:
    """SERVING while the kvstore answers and lists at least one worker (a router without workers
    can only fail requests), the first time only after ``before_serving()``; on shutdown
    (cancelled) close every channel."""
    dispatcher = router.dispatcher

    async def compatible_workers() -> list:
        entries = await dispatcher.refresh_directory()
        if not entries:
            raise Unavailable("no worker is registered yet")
        compatible = await router.model.review(entries)
        if not compatible:
            raise Unavailable("no registered worker serves this router's model")
        return compatible

    try:
        while True:
            await wait_for(compatible_workers, what=f"a worker registered with the kvstore at {kvstore}", logger=log)
            if before_serving is not None:
                await before_serving()
                before_serving = None
            await server.set_serving()
            router.ready.set()
            while True:  # watch: NOT_SERVING again when the last worker is gone
                await asyncio.sleep(WORKERS_PROBE_S)
                try:
                    await compatible_workers()
                except TandemError as err:
                    if err.code not in RETRYABLE:
                        raise
                    break
            log.warning("no compatible worker registered with the kvstore at %s any more: NOT_SERVING", kvstore)
            await server.set_not_serving()
    finally:
        await router.dispatcher.close()
        await channels.close()
        await kv_channel.close()
