"""``tandem router --kvstore ADDR ...``: run the router gRPC service until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.common.settings import add_settings_flags, settings_from_args
from services.router.settings import RouterSettings

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, RouterSettings)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(RouterSettings, args)
    asyncio.run(serve(settings))
    return 0


async def serve(settings: RouterSettings) -> None:
    from services.common.telemetry import setup_tracing
    from services.router.server import start_router

    setup_tracing("tandem-router")
    server, _router = await start_router(settings)
    server.install_signal_handlers()
    log.info("router serving on %s (kvstore %s, model %s)", server.address, settings.kvstore, settings.model)
    await server.wait_for_termination()
