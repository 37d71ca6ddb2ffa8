"""``tandem kvstore``: run the kvstore gRPC service until SIGTERM/SIGINT."""

from __future__ import annotations

import logging

from services.common.settings import service_command
from services.kvstore.settings import KVStoreSettings

log = logging.getLogger(__name__)


async def serve(settings: KVStoreSettings) -> None:
    from services.common.telemetry import setup_tracing
    from services.kvstore.server import start_kvstore, tune_gc

    setup_tracing("tandem-kvstore")
    server, _store = await start_kvstore(settings)
    tune_gc()
    server.install_signal_handlers()
    log.info("kvstore serving on %s", server.address)
    await server.wait_for_termination()


add_arguments, run = service_command(KVStoreSettings, serve)
