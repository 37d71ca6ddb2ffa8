"""The one way Tandem wraps a ``grpc.aio`` method handler: ``wrap_handler`` plus a caching base
class for server interceptors. Auth, metrics, tracing and error mapping are each a few hooks::

    RPC ─▶ start(request, context) ─▶ state            raises: on_error maps it, handler never runs
             │
             ├─ around(state) ─▶ handler step ─▶ reset()   one step for unary, one per message for
             │                    on_message(state, msg)    streams (context variables are set
             │                                              around each step, never across a yield)
             ├─ on_error(exc, context)   exceptions other than cancellation / an abort already sent
             └─ end(state, context, exc) exactly once after start, however the RPC ends

Handlers are wrapped once per method and cached (``WrappingInterceptor``): per-call data
(metadata, the peer) is read from ``context`` in ``start``, so an RPC costs the hooks and nothing
else. Only unary-unary and unary-stream handlers exist in Tandem's protos; others pass through.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence

import grpc

# Health probes and reflection are polled constantly and say nothing about a request.
DEFAULT_EXCLUDED_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

Start = Callable[[object, grpc.aio.ServicerContext], object]
Around = Callable[[object], Callable[[], None] | None]
OnMessage = Callable[[object, object], None]
End = Callable[[object, grpc.aio.ServicerContext, BaseException | None], None]
OnError = Callable[[BaseException, grpc.aio.ServicerContext], Awaitable[None]]


def passthrough(exc: BaseException) -> bool:
    """Exceptions no hook may map (read-only): ``context.abort()`` already answered
    (AbortError); cancellation must propagate, and so must GeneratorExit (a streaming handler
    abandoned at a yield, client gone, is closed with it)."""
    return isinstance(exc, (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit))


def status_of(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    """The status an RPC ended with, as far as a server interceptor can tell (read-only)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if exc is None:
        return grpc.StatusCode.OK
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN  # includes an abort without a recorded code (should not happen)


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    *,
    start: Start | None = None,
    around: Around | None = None,
    on_message: OnMessage | None = None,
    end: End | None = None,
    on_error: OnError | None = None,
) -> grpc.RpcMethodHandler:
    """``handler`` with the hooks of the module docstring (all optional; read-only on its own).
    ``on_error`` usually aborts the call (which raises); if it returns, the exception goes on."""

    async def begin(request, context):
        try:
            return start(request, context) if start is not None else None
        except BaseException as exc:  # noqa: BLE001 - mapped or re-raised
            if on_error is not None and not passthrough(exc):
                await on_error(exc, context)
            raise

    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            state = await begin(request, context)
            error: BaseException | None = None
            try:
                reset = around(state) if around is not None else None
                try:
                    response = await inner(request, context)
                finally:
                    if reset is not None:
                        reset()
                if on_message is not None:
                    on_message(state, response)
                return response
            except BaseException as exc:
                error = exc
                if on_error is not None and not passthrough(exc):
                    await on_error(exc, context)
                raise
            finally:
                if end is not None:
                    end(state, context, error)

        return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer, handler.response_serializer)

    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def unary_stream(request, context):
            state = await begin(request, context)
            error: BaseException | None = None
            try:
                result = inner_stream(request, context)
                if not inspect.isasyncgen(result):  # a handler that writes with context.write()
                    reset = around(state) if around is not None else None
                    try:
                        await result
                    finally:
                        if reset is not None:
                            reset()
                    return
                try:
                    while True:
                        reset = around(state) if around is not None else None
                        try:
                            item = await result.__anext__()
                        except StopAsyncIteration:
                            break
                        finally:
                            if reset is not None:
                                reset()
                        if on_message is not None:
                            on_message(state, item)
                        yield item
                finally:
                    await result.aclose()  # close the handler now, not whenever GC gets to it
            except BaseException as exc:
                error = exc
                if on_error is not None and not passthrough(exc):
                    await on_error(exc, context)
                raise
            finally:
                if end is not None:
                    end(state, context, error)

        return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer, handler.response_serializer)
    return handler


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """A server interceptor that wraps each method's handler once (``wrap``) and reuses it.
    Methods starting with one of ``exclude_prefixes`` are left alone."""

    def __init__(self, exclude_prefixes: Sequence[str] = ()):
        self._exclude = tuple(exclude_prefixes)
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        raise NotImplementedError

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or (self._exclude and method.startswith(self._exclude)):
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self.wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)  # one entry per method: bounded
        return wrapped
