"""A service process on a port picked free for it, for tests that need to know the port up front.

Picking a free port and handing it to a process that binds it seconds later (imports) is a race:
another test's server (pytest-xdist runs two at once) may bind it first, and would even answer
its health checks. ``start_on_free_port`` names the process (``TANDEM_INSTANCE``: only it answers
health for that name, ``services.launcher.wait_serving``) and starts it again on another port
when it lost the one it was given, as ``tandem up`` does for its children.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Callable

from services.common.server import INSTANCE_ENV
from services.common.startup import EXIT_ENVIRONMENT, StartupError, port_held
from services.launcher import wait_serving
from tests.redis_server import free_port


def start_on_free_port(start: Callable[[int, dict[str, str]], subprocess.Popen], timeout_s: float,
                       tries: int = 3) -> tuple[subprocess.Popen, int]:
    """``start(port, env)`` (env: variables to add to the process's environment) on a free port,
    then wait until that process is SERVING there; returns (process, port). A process that exits
    with code 3 while another holds its port is started again on a new one (``tries`` in all)."""
    for attempt in range(1, tries + 1):
        port, instance = free_port(), uuid.uuid4().hex
        proc = start(port, {INSTANCE_ENV: instance})
        try:
            wait_serving(f"127.0.0.1:{port}", time.monotonic() + timeout_s, proc, instance=instance)
            return proc, port
        except StartupError:
            if attempt == tries or proc.poll() != EXIT_ENVIRONMENT or not port_held("127.0.0.1", port):
                raise
