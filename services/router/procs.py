"""``tandem router --procs N``: N router processes behind one gRPC port (and one HTTP port).

Why: one ``grpc.aio`` router process tops out at about one core. Every streamed token is a message
in from the worker and a message out to the client, each a Python callback on that process's
event loop (~130 µs of router CPU per token measured on the H200 box at concurrency 64), so the
front door, not the engine, limits a busy suite. Production servers answer this with several
front-end processes (vLLM's ``--api-server-count``; gRPC Python's multiprocessing example with
``SO_REUSEPORT``); so does this module::

    tandem router --procs 2        parent: holds the ports, supervises, serves nothing
      ├── router process 0  ─┐     each a whole router (services/router/server.py): its own event
      └── router process 1  ─┴──   loop, kvstore channel, worker channels and directory, all
                                   bound to the same gRPC (and HTTP) port with SO_REUSEPORT

* **Ports.** The parent checks each port, then holds it with a bound socket that never listens
  (``services.common.startup.reserve_shared_port``): with ``--port 0`` it picks the free port
  here and hands it to the children. The kernel spreads *connections* (not RPCs) over the
  children's listeners by a hash of the connection's addresses: a client needs several
  connections to use several processes (gRPC Python channels share one connection through the
  global subchannel pool unless opened with ``("grpc.use_local_subchannel_pool", 1)``).
* **Metrics.** Process *i* serves its own Prometheus endpoint on ``metrics_port + i`` (every
  port checked before anything starts; ``0``: a free port each, logged); scrape them all.
* **Shared per-deployment state.** Tenant cache salts need one secret for every process (else
  one tenant's requests would land in N cache namespaces): without ``--salt-secret-file`` /
  ``TANDEM_ROUTER_SALT_SECRET`` the parent draws one random secret for all its children.
  ``--policy-seed S`` gives process *i* seed S + i. Per-process limits (``--max-concurrent-rpcs``,
  ``--max-queued``) are per process: the router as a whole admits N times as much. A
  ``--front-trace`` file is shared: each process appends whole lines (one write each, O_APPEND).
* **Health.** A process holds NOT_SERVING until every process of the group is ready (kvstore
  answered, a compatible worker registered): a client never sees SERVING from one process while
  another would still refuse it. Later each process watches its workers itself, as one router does.
* **Supervision.** SIGTERM or SIGINT to the parent sends SIGTERM to every child (each drains as a
  single router does: health NOT_SERVING, in-flight streams get ``--grace-s``), waits, SIGKILLs
  stragglers, and exits 0. Children start with SIGINT ignored (kept across their exec) until
  their own handlers exist: a terminal's Ctrl-C reaches the whole process group, and a child
  still importing would die of it with a traceback of Python's start-up; the parent answers it
  for them. A child that exits on its own is reported, the others are stopped the
  same way, and the parent exits non-zero (the child's own code if it failed during start-up,
  e.g. 2 for a configuration mistake; else 1). It is not restarted in place: a crash of one is
  most likely a bug that waits for the others too, and the supervisor above (``tandem up``,
  systemd, Kubernetes) already restarts a router that exits. A child whose parent disappears
  (SIGKILL) drains and exits by itself: no orphan keeps the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from services.common.errors import TandemError
from services.common.settings import report_startup_error
from services.common.startup import EXIT_FAILURE, StartupError, check_port_free, reserve_shared_port
from services.router.settings import RouterSettings

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the parent looks at its children (and a child at the group's readiness)
PARENT_POLL_S = 1.0  # how often a child checks that its parent is alive
STOP_MARGIN_S = 10.0  # beyond grace_s, what a child gets to exit after SIGTERM before SIGKILL


def child_settings(settings: RouterSettings, index: int, port: int, http_port: int | None, salt_secret: str) -> RouterSettings:
    """The settings of router process ``index`` of a group (pure): one process, the group's ports,
    its own metrics port, the group's salt secret and its own tie-breaking seed."""
    update: dict = {"procs": 1, "port": port, "http_port": http_port}
    if not settings.salt_secret_file:  # a file is read by every child itself
        update["salt_secret"] = salt_secret
    if settings.metrics_port is not None:
        update["metrics_port"] = settings.metrics_port + index if settings.metrics_port else 0
    if settings.policy_seed is not None:
        update["policy_seed"] = settings.policy_seed + index
    return settings.model_copy(update=update)


@dataclass
class RouterProcess:
    """One child of the group, as the parent sees it."""

    index: int
    process: multiprocessing.process.BaseProcess
    reports: Connection  # from the child: {"started": ...} once bound, {"ready": True} once ready; to it: {"go": True}
    ready: bool = False
    metrics_port: int | None = None
    closed: bool = False  # its end of the pipe is gone (it exited)

    @property
    def pid(self) -> int | None:
        return self.process.pid


class RouterProcs:
    """The parent's side of a group (see the module docstring): :meth:`start`, then :meth:`poll`
    (or :meth:`wait_ready`) until :meth:`stop`. Synchronous, so tests can run a group in-process;
    the CLI drives it from :func:`serve_procs`."""

    def __init__(self, settings: RouterSettings, *, log_level: int | None = None):
        self.settings = settings
        self.log_level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
        self.port: int | None = None
        self.http_port: int | None = None
        self.children: list[RouterProcess] = []
        self._held = []  # the reserved port sockets, closed by stop()
        # spawn, not fork: a forked child would inherit the parent's threads and any gRPC state
        self._ctx = multiprocessing.get_context("spawn")
        self._go = False  # every child was ready and was told it may say SERVING

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    @property
    def serving(self) -> bool:
        """Whether every child was ready and was told to say SERVING."""
        return self._go

    def start(self) -> None:
        """Check and hold the ports, then start the children (returns at once; they become ready
        on their own). Raises :class:`StartupError` for a taken port; stops what started on error."""
        s = self.settings
        try:
            if s.metrics_port:
                for i in range(s.procs):
                    check_port_free(s.host, s.metrics_port + i, f"metrics port of router process {i}")
            grpc_port = reserve_shared_port(s.host, s.port, "router port")
            self._held.append(grpc_port)
            self.port = grpc_port.getsockname()[1]
            if s.http_port is not None:
                http_port = reserve_shared_port(s.host, s.http_port, "router HTTP port")
                self._held.append(http_port)
                self.http_port = http_port.getsockname()[1]
            secret = s.salt_secret
            if not (s.salt_secret_file or s.salt_secret):
                secret = secrets.token_hex(32)
                log.info("no --salt-secret-file: the %d router processes share one random salt secret "
                         "(routers of one deployment need the same secret to share the cache)", s.procs)
            for i in range(s.procs):
                reports, theirs = self._ctx.Pipe()  # reports up, the one "go" down; EOF tells a death
                process = self._ctx.Process(
                    target=_child_main, name=f"tandem-router-{i}", daemon=True,  # daemon: ended if this process exits
                    args=(child_settings(s, i, self.port, self.http_port, secret), i, self.log_level, theirs),
                )
                with sigint_ignored():  # the child inherits SIG_IGN through its exec (module docstring)
                    process.start()
                theirs.close()  # the child holds the only other end: EOF here once it exits
                self.children.append(RouterProcess(i, process, reports))
        except BaseException:
            self.stop()
            raise

    def poll(self) -> RouterProcess | None:
        """Read the children's reports without blocking; once every child is ready, let them all
        say SERVING. Returns a child that has exited (the first), else None."""
        for child in self.children:
            while not child.closed and child.reports.poll():
                try:
                    msg = child.reports.recv()
                except (EOFError, OSError):
                    child.closed = True
                    break
                if "started" in msg:
                    child.metrics_port = msg["metrics_port"]
                    metrics = f", metrics on port {child.metrics_port}" if child.metrics_port else ""
                    log.info("router process %d (pid %d) bound %s%s", child.index, child.pid, self.address, metrics)
                if msg.get("ready"):
                    child.ready = True
        if self.children and not self._go and all(c.ready for c in self.children):
            for child in self.children:
                tell(child.reports, {"go": True})
            self._go = True
            log.info("all %d router processes ready: SERVING on %s", len(self.children), self.address)
        return next((c for c in self.children if c.process.exitcode is not None), None)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every child is ready (SERVING); :class:`StartupError` if one exits first
        (with its exit code) or ``timeout_s`` passes."""
        end = time.monotonic() + timeout_s
        while True:
            dead = self.poll()
            if dead is not None:
                raise StartupError(describe_exit(dead), startup_exit_code(dead))
            if self.serving:
                return
            if time.monotonic() > end:
                raise StartupError(f"router processes not all ready after {timeout_s:.0f} s", EXIT_FAILURE)
            time.sleep(POLL_S / 2)

    def stop(self, timeout_s: float | None = None) -> dict[int, int | None]:
        """SIGTERM every live child, wait (``grace_s`` + a margin, or ``timeout_s``), SIGKILL the
        rest; release the ports. Returns {index: exit code}. Idempotent."""
        for child in self.children:
            if child.process.exitcode is None:
                child.process.terminate()  # SIGTERM: the child drains like a single router
        end = time.monotonic() + (self.settings.grace_s + STOP_MARGIN_S if timeout_s is None else timeout_s)
        for child in self.children:
            child.process.join(max(0.0, end - time.monotonic()))
            if child.process.exitcode is None:
                log.warning("router process %d (pid %d) did not stop in time: SIGKILL", child.index, child.pid)
                child.process.kill()
                child.process.join()
            child.reports.close()
        for sock in self._held:
            sock.close()
        self._held.clear()
        return {c.index: c.process.exitcode for c in self.children}


@contextlib.contextmanager
def sigint_ignored():
    """SIGINT ignored inside the block, then the previous handler back (main thread only: Python
    sets handlers there alone; elsewhere nothing changes). A SIGINT inside the block is lost: the
    block is one process spawn, a few milliseconds."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def tell(conn: Connection, msg: dict) -> None:
    """Send ``msg`` over a group pipe; a peer that is gone is noticed elsewhere (its exit code,
    or the child's parent watch), not here."""
    try:
        conn.send(msg)
    except OSError:
        pass


def describe_exit(child: RouterProcess) -> str:
    """One line on how ``child`` ended (pure)."""
    code = child.process.exitcode
    how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with code {code}"
    when = "" if child.ready else " during start-up (its error is above)"
    return f"router process {child.index} (pid {child.pid}) {how}{when}"


def startup_exit_code(child: RouterProcess) -> int:
    """What the parent exits with after ``child`` ended on its own: a start-up failure's own code
    (2 configuration, 3 environment), else 1 (pure)."""
    code = child.process.exitcode
    return code if not child.ready and code is not None and code > 0 else EXIT_FAILURE


async def serve_procs(settings: RouterSettings) -> None:
    """The CLI's parent: start the group, supervise until SIGTERM/SIGINT or a child's exit
    (then :class:`StartupError` with the exit code, after stopping the others)."""
    group = RouterProcs(settings)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        log.info("received %s: stopping the %d router processes", sig.name, settings.procs)
        stopping.set()

    # before the children start: a SIGTERM while they start must stop them, not orphan them
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    group.start()
    log.info("router on %s: %d processes (pids %s), SERVING once every one is ready (kvstore %s, model %s)",
             group.address, settings.procs, ", ".join(str(c.pid) for c in group.children), settings.kvstore, settings.model)
    if group.http_port is not None:
        log.info("OpenAI-compatible HTTP API on http://%s:%d/v1 (every router process)", settings.host, group.http_port)
    dead = None
    try:
        while not stopping.is_set() and dead is None:
            dead = group.poll()
            if dead is None:
                await asyncio.sleep(POLL_S)
        if dead is not None:
            log.error("%s: stopping the other router processes", describe_exit(dead))
    finally:
        codes = await asyncio.to_thread(group.stop)
    log.info("router processes stopped (exit codes %s)", ", ".join(f"{i}: {c}" for i, c in codes.items()))
    if dead is not None:
        raise StartupError(describe_exit(dead) + "; stopped the others", startup_exit_code(dead))


# ------------------------------------------------------------------------------------ the child
def _child_main(settings: RouterSettings, index: int, log_level: int, parent: Connection) -> None:
    """Entry point of router process ``index`` (a fresh interpreter: spawn)."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [router {index}]: %(message)s")
    try:
        asyncio.run(_serve_child(settings, parent))
    except (StartupError, TandemError) as exc:
        sys.exit(report_startup_error(f"router (process {index})", exc))
    except KeyboardInterrupt:  # SIGINT is ignored until its server's handlers exist; asyncio gives
        sys.exit(130)  # SIGINT back to Python's default when its loop closes (a Ctrl-C while exiting)


async def _serve_child(settings: RouterSettings, parent: Connection) -> None:
    from services.common.gc_tuning import settle_heap
    from services.common.metrics import ServiceMetrics
    from services.common.telemetry import setup_tracing
    from services.router.server import start_router

    setup_tracing("tandem-router")
    parent_pid = os.getppid()

    async def when_all_ready() -> None:
        settle_heap(settings, f"router process {os.getpid()}")  # before SERVING: requests may follow at once
        tell(parent, {"ready": True})
        while True:
            try:
                if parent.poll() and parent.recv().get("go"):  # the parent's one message
                    return
            except (EOFError, OSError):  # the parent is gone: _watch_parent drains this process
                pass
            await asyncio.sleep(POLL_S)

    metrics = ServiceMetrics("router") if settings.metrics_port is not None else None
    server, _router = await start_router(settings, metrics=metrics, reuse_port=True, before_serving=when_all_ready)
    server.install_signal_handlers()
    server.run_in_background(_watch_parent(server, parent_pid))
    tell(parent, {"started": True, "metrics_port": metrics.port if metrics is not None else None})
    await server.wait_for_termination()


async def _watch_parent(server, parent: int) -> None:
    """Drain this child once its parent is gone (it was SIGKILLed: nobody would stop us)."""
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_POLL_S)
    log.error("the router parent process (pid %d) is gone: draining", parent)
    # a task of its own: server.stop() cancels the background tasks, this one included
    _orphan_stops.append(asyncio.get_running_loop().create_task(server.stop()))


_orphan_stops: list[asyncio.Task] = []  # keeps the stop task referenced until the loop ends
