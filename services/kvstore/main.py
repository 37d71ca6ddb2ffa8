"""``tandem kvstore``: run the kvstore gRPC service until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.common.settings import add_settings_flags, settings_from_args
from services.kvstore.settings import KVStoreSettings

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, KVStoreSettings)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(KVStoreSettings, args)
    asyncio.run(serve(settings))
    return 0


async def serve(settings: KVStoreSettings) -> None:
    from services.common.telemetry import setup_tracing
    from services.kvstore.server import start_kvstore, tune_gc

    setup_tracing("tandem-kvstore")
    server, _store = await start_kvstore(settings)
    tune_gc()
    server.install_signal_handlers()
    log.info("kvstore serving on %s", server.address)
    await server.wait_for_termination()
