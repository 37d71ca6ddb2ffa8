"""The one way Tandem services run a ``grpc.aio`` server.

What every service gets from :class:`GrpcServer`:

* the stock health service (``grpc.health.v1``): NOT_SERVING until :meth:`GrpcServer.set_serving`,
  and NOT_SERVING again while draining;
* server reflection for the registered services;
* graceful shutdown on SIGTERM/SIGINT: health flips to NOT_SERVING, new RPCs are refused, in-flight
  RPCs get ``grace_s`` seconds;
* bounded receive size and concurrency (``grpc.max_receive_message_length``,
  ``maximum_concurrent_rpcs``);
* :class:`ErrorMappingInterceptor`: typed domain errors become their status code with their
  message; anything else is logged with its stack trace and reaches the client as a bare
  ``INTERNAL`` (no internals leak);
* a slot for more interceptors (telemetry, auth), applied outermost first.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.errors import InvalidArgument, TandemError
from services.common.interceptors import WrappingInterceptor, wrap_handler
from services.common.startup import StartupError, check_port_free

INSTANCE_ENV = "TANDEM_INSTANCE"  # set by `tandem up` for each child: see instance_service


def instance_service(instance: str) -> str:
    """The health service name a process started with ``INSTANCE_ENV=instance`` answers for, as
    every other service it serves; no other process does."""
    return f"tandem.instance.{instance}"

log = logging.getLogger(__name__)

INTERNAL_MESSAGE = "internal error (see server logs)"
# Accept the clients' keepalive pings (services.common.channels.KEEPALIVE_OPTIONS) and ping idle
# clients ourselves, so a vanished caller's streams end instead of holding their resources.
SERVER_KEEPALIVE_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 4_000),
    ("grpc.http2.max_ping_strikes", 0),
)


def status_code_of(error: TandemError) -> grpc.StatusCode:
    """The gRPC status code a domain error maps to (the names are shared, see ``errors.Code``)."""
    return grpc.StatusCode[error.code.value]


async def abort_with_status(exc: BaseException, context: grpc.aio.ServicerContext, method: str = "") -> None:
    """Answer the call for ``exc`` (always raises): a domain error's code and message, or a
    bare INTERNAL after logging the stack trace."""
    if isinstance(exc, TandemError):
        await context.abort(status_code_of(exc), exc.message)
    log.error("internal error in %s", method or "an RPC handler", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


class _Malformed:
    """What a request that does not parse deserializes to (see ``ErrorMappingInterceptor``)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def _tolerant(deserializer):
    """``deserializer`` that returns a :class:`_Malformed` instead of raising: gRPC would answer
    a parse failure with UNKNOWN, the parser's internals and a traceback per call."""
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, invalid UTF-8, ...
            return _Malformed(type(exc).__name__)

    return deserialize


class ErrorMappingInterceptor(WrappingInterceptor):
    """Map exceptions escaping any handler to status codes (see module docstring); a request
    message that does not parse (bad protobuf, invalid UTF-8 in a string) is INVALID_ARGUMENT
    with one log line, and the handler never runs."""

    def wrap(self, handler, method):
        async def on_error(exc: BaseException, context: grpc.aio.ServicerContext) -> None:
            await abort_with_status(exc, context, method)

        def start(request, context) -> None:
            if isinstance(request, _Malformed):
                log.warning("malformed %s request from %s (%s)", method, context.peer(), request.reason)
                raise InvalidArgument("the request message does not parse (malformed protobuf or invalid UTF-8)")

        if hasattr(handler, "_replace"):
            handler = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
        return wrap_handler(handler, start=start, on_error=on_error)


@dataclass
class ServiceBinding:
    """A servicer and how to attach it: ``add(servicer, server)`` from the generated ``*_pb2_grpc``."""

    add: Callable[[object, grpc.aio.Server], None]
    servicer: object
    full_name: str  # e.g. "tandem.kvstore.v1.KVStore" (for health and reflection)


class GrpcServer:
    """A ``grpc.aio`` server with health, reflection, limits, error mapping and drain."""

    def __init__(
        self,
        bindings: Sequence[ServiceBinding],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_receive_bytes: int = 16 * 1024 * 1024,
        max_concurrent_rpcs: int | None = 1024,
        grace_s: float = 5.0,
        interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
        server_credentials: grpc.ServerCredentials | None = None,
        reuse_port: bool = False,
    ):
        self._bindings = list(bindings)
        self._address = f"{host}:{port}"
        self._grace_s = grace_s
        self._credentials = server_credentials
        self._reuse_port = reuse_port
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self._server = grpc.aio.server(
            interceptors=[*interceptors, ErrorMappingInterceptor()],
            options=[
                ("grpc.max_receive_message_length", max_receive_bytes),
                ("grpc.max_send_message_length", max_receive_bytes),
                # off by default: a second server on a taken port must fail, not share it; on only
                # for the processes of one group (``tandem router --procs N``: its parent holds
                # the port, services.common.startup.reserve_shared_port)
                ("grpc.so_reuseport", 1 if reuse_port else 0),
                *SERVER_KEEPALIVE_OPTIONS,
            ],
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        self.port: int | None = None
        self._stopped = asyncio.Event()
        self._draining = False
        self._serving = False
        self._background: list[asyncio.Task] = []
        self._on_stop: list[Callable[[], object]] = []

    @property
    def address(self) -> str:
        host = self._address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> int:
        """Bind, start serving (health NOT_SERVING until :meth:`set_serving`); return the port."""
        for b in self._bindings:
            b.add(b.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        names = [b.full_name for b in self._bindings]
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self._server,
        )
        host, _, port = self._address.rpartition(":")
        if not self._reuse_port:  # a shared port is held by the group's parent, which checked it
            check_port_free(host.strip("[]"), int(port))  # a one-line PortInUse instead of "Failed to bind"
        try:
            if self._credentials is not None:
                self.port = self._server.add_secure_port(self._address, self._credentials)
            else:
                self.port = self._server.add_insecure_port(self._address)
        except RuntimeError as exc:  # grpc's bind failure (lost a race with another process)
            raise StartupError(f"cannot bind {self._address}: {exc}") from None
        if not self.port:
            raise StartupError(f"cannot bind {self._address}")
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.start()
        return self.port

    async def _set_all(self, status) -> None:
        self._serving = status == health_pb2.HealthCheckResponse.SERVING
        # A launcher that started this process names it (INSTANCE_ENV) to tell its answers from
        # those of another process on the same port (services.launcher.wait_serving)
        instance = os.environ.get(INSTANCE_ENV)
        for name in ["", *(b.full_name for b in self._bindings), *([instance_service(instance)] if instance else [])]:
            result = self.health.set(name, status)
            if inspect.isawaitable(result):
                await result

    async def set_serving(self) -> None:
        """Mark every service SERVING (call once the service is ready)."""
        if not self._draining:
            await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def set_not_serving(self) -> None:
        """Mark every service NOT_SERVING (it lost what it needs; :meth:`set_serving` undoes it)."""
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)

    @property
    def serving(self) -> bool:
        """Whether health currently says SERVING (read-only; for ``/ready``)."""
        return self._serving and not self._draining

    def add_binding(self, binding: ServiceBinding) -> None:
        """Attach one more service (before :meth:`start`)."""
        self._bindings.append(binding)

    def on_stop(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` once the server has drained: a coroutine function is awaited on this
        loop (closing a ``grpc.aio`` channel), anything else runs in a thread (it may block)."""
        self._on_stop.append(callback)

    def run_in_background(self, coro) -> asyncio.Task:
        """Run ``coro`` for the server's lifetime; :meth:`stop` cancels it after draining."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.append(task)
        return task

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: health NOT_SERVING, refuse new RPCs, give in-flight ones ``grace_s``."""
        self._draining = True
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.stop(self._grace_s if grace_s is None else grace_s)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for callback in self._on_stop:
            if inspect.iscoroutinefunction(callback):
                await callback()
            else:
                await asyncio.to_thread(callback)
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT start a graceful stop (idempotent)."""
        loop = asyncio.get_running_loop()

        def on_signal(sig: signal.Signals) -> None:
            log.info("received %s: draining", sig.name)
            if not self._draining:
                loop.create_task(self.stop())

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, on_signal, sig)
            except (NotImplementedError, RuntimeError):  # not the main thread / platform
                pass
