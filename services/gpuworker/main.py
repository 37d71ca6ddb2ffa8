"""``tandem worker``: run a gpuworker until SIGTERM/SIGINT."""

from __future__ import annotations

import logging

from services.common.settings import service_command
from services.gpuworker.settings import WorkerSettings

log = logging.getLogger(__name__)


async def serve(settings: WorkerSettings) -> None:
    from services.common.gc_tuning import settle_heap
    from services.common.telemetry import setup_tracing
    from services.gpuworker.server import start_worker

    setup_tracing("tandem-gpuworker")
    # the engine warmed up (in either process): the heap is settled before any router can reach us
    server, _runner, _identity = await start_worker(settings, before_register=lambda: settle_heap(settings, "worker"))
    server.install_signal_handlers()
    await server.wait_for_termination()


add_arguments, run = service_command(WorkerSettings, serve)
