"""``tandem kvstore``: run the kvstore gRPC service until SIGTERM/SIGINT."""

from __future__ import annotations

import logging

from services.common.settings import service_command
from services.kvstore.settings import KVStoreSettings

log = logging.getLogger(__name__)


async def serve(settings: KVStoreSettings) -> None:
    from services.common.gc_tuning import settle_heap
    from services.common.telemetry import setup_tracing
    from services.kvstore.server import start_kvstore

    setup_tracing("tandem-kvstore")
    if settings.backend == "redis":
        await serve_redis(settings)
        return
    server, _store = await start_kvstore(settings)
    settle_heap(settings, "kvstore")
    server.install_signal_handlers()
    log.info("kvstore serving on %s", server.address)
    await server.wait_for_termination()


add_arguments, run = service_command(KVStoreSettings, serve)


async def serve_redis(settings: KVStoreSettings) -> None:
    """Stand by for the Redis lease, then serve the recovered store (``leader``)."""
    from services.common.gc_tuning import settle_heap
    from services.kvstore.leader import Leadership
    from services.kvstore.server import start_kvstore

    async def start(settings, store):
        server, _ = await start_kvstore(settings, store=store)
        settle_heap(settings, "kvstore")
        log.info("kvstore serving on %s (redis backend, %s)", server.address, settings.redis_url)
        return server

    leadership = Leadership(settings, start_server=start)
    leadership.install_signal_handlers()
    log.info("kvstore on %s: standing by for the lease", settings.redis_url)
    await leadership.run()
