"""``tandem router --kvstore ADDR ...``: run the router gRPC service until SIGTERM/SIGINT
(``--procs N``: N router processes on one port under a supervising parent, services/router/procs.py)."""

from __future__ import annotations

import logging

from services.common.settings import service_command
from services.router.settings import RouterSettings

log = logging.getLogger(__name__)


async def serve(settings: RouterSettings) -> None:
    if settings.procs > 1:
        from services.router.procs import serve_procs

        await serve_procs(settings)
        return
    from services.common.gc_tuning import settle_heap
    from services.common.telemetry import setup_tracing
    from services.router.server import start_router

    setup_tracing("tandem-router")
    async def settle() -> None:  # once a worker is there, just before health says SERVING
        settle_heap(settings, "router")

    server, _router = await start_router(settings, before_serving=settle)
    server.install_signal_handlers()
    log.info("router serving on %s (kvstore %s, model %s)", server.address, settings.kvstore, settings.model)
    if _router.http_url:
        log.info("OpenAI-compatible HTTP API on %s/v1", _router.http_url)
    await server.wait_for_termination()


add_arguments, run = service_command(RouterSettings, serve)
