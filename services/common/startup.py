"""Start-up that explains itself: typed start-up errors with exit codes, and waiting for a
dependency with bounded backoff.

A mistake in configuration or environment ends a command with ONE line on stderr
(``tandem kvstore: error: 127.0.0.1:50051 is already in use ...``) and an exit code a script can
branch on — never a traceback:

* ``EXIT_CONFIG`` (2, as argparse): a flag or ``TANDEM_*`` variable is invalid;
* ``EXIT_ENVIRONMENT`` (3): the configuration is fine but the machine is not (port taken, model
  folder missing, a dependency that never came up).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.common.errors import Code, TandemError

EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_ENVIRONMENT = 3

T = TypeVar("T")


class StartupError(Exception):
    """A start-up mistake: ``message`` is the one line a person reads, ``exit_code`` what the
    process exits with."""

    def __init__(self, message: str, exit_code: int = EXIT_ENVIRONMENT):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class PortInUse(StartupError):
    def __init__(self, address: str, what: str = "port"):
        super().__init__(f"{what} {address} is already in use (stop what holds it, or choose another port)")
        self.address = address


def check_port_free(host: str, port: int, what: str = "port") -> None:
    """Raise :class:`PortInUse` if ``host:port`` cannot be bound now (port 0 always can).
    gRPC's own bind failure says only "Failed to bind"; this says which port and why."""
    if port == 0:
        return
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is free
        _bind(s, host, port, what)


def port_held(host: str, port: int) -> bool:
    """Whether another socket holds ``host:port`` now (a probe bind; changes nothing)."""
    try:
        check_port_free(host, port)
    except PortInUse:
        return True
    return False


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bind(sock: socket.socket, host: str, port: int, what: str) -> None:
    """``sock.bind``, its failure as :class:`PortInUse` or a one-line :class:`StartupError`."""
    try:
        sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(f"{host}:{port}", what) from None
        raise StartupError(f"cannot bind {what} {host}:{port}: {exc.strerror}") from None


def reserve_shared_port(host: str, port: int, what: str = "port") -> socket.socket:
    """Hold ``host:port`` (0 = a free port, chosen now: read it from ``getsockname()``) for
    processes that bind it with ``SO_REUSEPORT``: a bound socket that never listens, so it takes no
    connections, but no process without ``SO_REUSEPORT`` can take the port while it is open (gRPC
    Python's multiprocessing example reserves its port the same way). A port already in use is
    :class:`PortInUse` (checked without ``SO_REUSEPORT``: another group's listener counts).
    The caller closes the socket."""
    check_port_free(host, port, what)
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        _bind(sock, host, port, what)
    except StartupError:
        sock.close()
        raise
    return sock


# Codes that mean "not there yet": worth waiting for. Anything else is a real answer.
RETRYABLE = (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED)


async def wait_for(
    attempt: Callable[[], Awaitable[T]],
    *,
    what: str,
    logger: logging.Logger,
    first_delay_s: float = 0.2,
    max_delay_s: float = 2.0,
    log_every_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``await attempt()`` until it stops raising a retryable :class:`TandemError`; return its result.

    Delays double from ``first_delay_s`` up to ``max_delay_s`` (bounded backoff); the first failure
    and then at most one per ``log_every_s`` are logged, so a missing dependency costs a line every
    few seconds, not one per probe. Non-retryable errors propagate at once.
    """
    started = clock()
    delay = first_delay_s
    next_log = started
    while True:
        try:
            return await attempt()
        except TandemError as exc:
            if exc.code not in RETRYABLE:
                raise
            now = clock()
            if now >= next_log:
                logger.warning("waiting for %s (%s); retrying, %.0f s so far", what, exc.message, now - started)
                next_log = now + log_every_s
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay_s)
