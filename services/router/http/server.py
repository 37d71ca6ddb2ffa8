"""Serve the OpenAI front with uvicorn inside the router's event loop, beside the gRPC server.

The socket is bound first (``bind``: a taken port is a one-line start-up error before the gRPC
server binds anything); ``HttpFront.run`` serves until cancelled, then stops accepting and gives
open requests ``grace_s``. Signals stay with the gRPC server (its handlers start the drain, which
cancels ``run``): uvicorn's own signal capture is switched off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from services.common.startup import StartupError, check_port_free

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the gRPC server owns SIGTERM/SIGINT
        yield


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening socket on host:port (0 = any free port); StartupError when it cannot bind.
    ``reuse_port``: one of a group of processes on one port (``tandem router --procs N``; the
    group's parent holds and checked the port), so ``SO_REUSEPORT`` and no check here."""
    if not reuse_port:
        check_port_free(host, port, "router HTTP port")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says
    # TCP. Without it Nagle holds an SSE event written right after the headers until the client's
    # delayed ACK (~40 ms on Linux): that was most of the HTTP front's TTFT overhead.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets (Linux)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot bind the router HTTP port {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class HttpFront:
    """One uvicorn server on a bound socket."""

    def __init__(self, app, sock: socket.socket, *, grace_s: float):
        self._sock = sock
        self.host, self.port = sock.getsockname()[:2]
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=max(grace_s, 0.1), timeout_keep_alive=30)
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Start serving (returns once uvicorn accepts connections)."""
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # re-raise why it stopped
                raise StartupError("the router HTTP server stopped during start-up")
            await asyncio.sleep(0.01)

    async def run(self) -> None:
        """Wait while serving; when cancelled, stop accepting and drain (bounded)."""
        try:
            await asyncio.shield(self._task)
        finally:
            self._server.should_exit = True
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._task, self._server.config.timeout_graceful_shutdown + 2)
            self._sock.close()
