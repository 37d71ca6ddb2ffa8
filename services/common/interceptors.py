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
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class Hooks:
    """One interceptor's hooks (see the module docstring); each optional."""

    start: Start | None = None
    around: Around | None = None
    on_message: OnMessage | None = None
    end: End | None = None
    on_error: OnError | None = None


_NO_RESPONSE = object()
_LAYERS = "tandem_layers"  # attribute of a wrapped handler: (the bare handler, its hooks outermost first)


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
    ``on_error`` usually aborts the call (which raises); if it returns, the exception goes on.

    A handler this function already wrapped is not wrapped again but fused: the result runs
    every layer's hooks around the bare handler in ONE coroutine or async generator, in exactly
    the order nested wrappers would (each layer's start, on_error and end under the arounds of
    the layers outside it; on_message innermost first) — five interceptors cost one generator
    step per streamed message instead of five."""
    hooks = Hooks(start, around, on_message, end, on_error)
    bare, below = getattr(handler, _LAYERS, (handler, ()))
    layers = (hooks, *below)
    if bare.unary_unary is not None:
        wrapped = grpc.unary_unary_rpc_method_handler(
            _unary_unary(bare.unary_unary, layers), handler.request_deserializer, handler.response_serializer)
    elif bare.unary_stream is not None:
        wrapped = grpc.unary_stream_rpc_method_handler(
            _unary_stream(bare.unary_stream, layers), handler.request_deserializer, handler.response_serializer)
    else:
        return handler
    setattr(wrapped, _LAYERS, (bare, layers))
    return wrapped


class _Call:
    """One call's pass through the layers: their states and active arounds (mutated as it runs)."""

    __slots__ = ("layers", "context", "states", "resets", "_arounds", "_touched")

    def __init__(self, layers: tuple[Hooks, ...], context, steps: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())):
        self.layers = layers
        self.context = context
        # per message, only the layers with something to do (see _per_message)
        self._arounds, self._touched = steps
        self.states: list[object] = []
        self.resets: list[Callable[[], None] | None] = []  # index j: layer j's around, while active

    async def enter(self, request) -> None:
        """Start the layers outermost first, each under the arounds of those outside it; leaves
        every around active. A start that raises unwinds the layers already started."""
        for hooks in self.layers:
            try:
                state = hooks.start(request, self.context) if hooks.start is not None else None
            except BaseException as exc:  # noqa: BLE001 - this layer's on_error, then unwound
                raise await self.unwind(await self._on_error(hooks, exc)) from None
            self.states.append(state)
            self.resets.append(hooks.around(state) if hooks.around is not None else None)

    def activate(self) -> None:
        """Set every around again (a step after a yield), outermost first."""
        layers, states, resets = self.layers, self.states, self.resets
        for j in self._arounds:
            resets[j] = layers[j].around(states[j])

    def deliver(self, item) -> None:
        """A message goes out: each layer, innermost first, resets its around and sees it."""
        layers, states, resets = self.layers, self.states, self.resets
        for j in self._touched:
            reset = resets[j]
            if reset is not None:
                resets[j] = None
                reset()
            on_message = layers[j].on_message
            if on_message is not None:
                on_message(states[j], item)

    async def unwind(self, exc: BaseException | None, response=_NO_RESPONSE) -> BaseException | None:
        """End the started layers innermost first, each after resetting its own around and
        before those outside it: on_error (which may replace the exception), or on_message of a
        unary ``response``, then end with the exception as that layer received it. Returns what
        leaves the outermost layer."""
        for j in range(len(self.states) - 1, -1, -1):
            self._reset(j)
            received = exc
            if exc is not None:
                exc = await self._on_error(self.layers[j], exc)
            elif response is not _NO_RESPONSE and self.layers[j].on_message is not None:
                self.layers[j].on_message(self.states[j], response)
            end = self.layers[j].end
            if end is not None:
                end(self.states[j], self.context, received)
        return exc

    def _reset(self, j: int) -> None:
        reset = self.resets[j]
        if reset is not None:
            self.resets[j] = None
            reset()

    async def _on_error(self, hooks: Hooks, exc: BaseException) -> BaseException:
        if hooks.on_error is None or passthrough(exc):
            return exc
        try:
            await hooks.on_error(exc, self.context)
        except BaseException as raised:  # noqa: BLE001 - usually the abort: it goes on outwards
            return raised
        return exc


def _per_message(layers: tuple[Hooks, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(layers with an around, outermost first; layers with an around or on_message, innermost
    first): what a streamed message touches, computed once per method, not per message."""
    arounds = tuple(j for j, h in enumerate(layers) if h.around is not None)
    touched = tuple(j for j in range(len(layers) - 1, -1, -1)
                    if layers[j].around is not None or layers[j].on_message is not None)
    return arounds, touched


def _unary_unary(inner, layers: tuple[Hooks, ...]):
    async def unary_unary(request, context):
        call = _Call(layers, context)
        await call.enter(request)
        try:
            response = await inner(request, context)
        except BaseException as exc:  # noqa: BLE001 - unwound through every layer, then raised
            raise await call.unwind(exc) from None
        await call.unwind(None, response)
        return response

    return unary_unary


def _unary_stream(inner, layers: tuple[Hooks, ...]):
    steps = _per_message(layers)

    async def unary_stream(request, context):
        call = _Call(layers, context, steps)
        await call.enter(request)
        result = None
        try:
            result = inner(request, context)
            if not inspect.isasyncgen(result):  # a handler that writes with context.write()
                await result
                result = None
            else:
                while True:
                    try:
                        item = await result.__anext__()
                    except StopAsyncIteration:
                        break
                    call.deliver(item)
                    yield item
                    call.activate()
        except BaseException as exc:  # noqa: BLE001 - unwound through every layer, then raised
            failure: BaseException | None = exc
        else:
            failure = None
        # the innermost layer closes the handler (now, not whenever GC gets to it) before it ends
        if call.states:
            call._reset(len(call.states) - 1)
        if result is not None:
            try:
                await result.aclose()
            except BaseException as exc:  # noqa: BLE001 - replaces the first, as a finally would
                failure = exc
        failure = await call.unwind(failure)
        if failure is not None:
            raise failure

    return unary_stream


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
