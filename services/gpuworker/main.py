"""``tandem worker``: run a gpuworker until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.common.settings import add_settings_flags, settings_from_args
from services.gpuworker.settings import WorkerSettings

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, WorkerSettings)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(WorkerSettings, args)
    asyncio.run(serve(settings))
    return 0


async def serve(settings: WorkerSettings) -> None:
    from services.common.telemetry import setup_tracing
    from services.gpuworker.server import start_worker

    setup_tracing("tandem-gpuworker")
    server, _runner, identity = await start_worker(settings)
    server.install_signal_handlers()
    await server.wait_for_termination()
