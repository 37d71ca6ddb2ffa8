"""Fused interceptor layers (``wrap_handler`` applied to an already wrapped handler) behave
exactly like the nested wrappers they replace: the same hooks, in the same order, under the same
arounds, with the same outcome — checked against the nested implementation they replaced, over
generated layer stacks and handler behaviours (start failures, handler errors, on_error hooks that
abort or return, consumers that stop early)."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from functools import partial

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.interceptors import passthrough, wrap_handler

_VARS = [contextvars.ContextVar(f"layer{j}", default=None) for j in range(4)]


# ----------------------------------------------------------------- the reference: nested wrappers
def _nested(handler, *, start=None, around=None, on_message=None, end=None, on_error=None):
    """One layer as Tandem wrapped handlers before the layers were fused (one generator each)."""

    async def begin(request, context):
        try:
            return start(request, context) if start is not None else None
        except BaseException as exc:
            if on_error is not None and not passthrough(exc):
                await on_error(exc, context)
            raise

    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            state = await begin(request, context)
            error = None
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

        return grpc.unary_unary_rpc_method_handler(unary_unary)

    inner_stream = handler.unary_stream

    async def unary_stream(request, context):
        state = await begin(request, context)
        error = None
        try:
            result = inner_stream(request, context)
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
                await result.aclose()
        except BaseException as exc:
            error = exc
            if on_error is not None and not passthrough(exc):
                await on_error(exc, context)
            raise
        finally:
            if end is not None:
                end(state, context, error)

    return grpc.unary_stream_rpc_method_handler(unary_stream)


# ------------------------------------------------------------------------------- the scenarios
class Boom(Exception):
    pass


def _visible() -> str:
    return "".join(str(j) for j, v in enumerate(_VARS) if v.get() is not None)


def _layer_hooks(j: int, spec: dict, log: list):
    """Hooks of layer ``j`` that log every call with the arounds visible at that moment."""
    hooks = {}
    if spec["start"] != "none":
        def start(request, context):
            log.append(("start", j, _visible()))
            if spec["start"] == "raises":
                raise Boom(f"start {j}")
            return f"state{j}"
        hooks["start"] = start
    if spec["around"]:
        def around(state):
            log.append(("around", j, _visible()))
            return partial(_VARS[j].reset, _VARS[j].set(state))
        hooks["around"] = around
    if spec["on_message"]:
        hooks["on_message"] = lambda state, msg: log.append(("message", j, msg, _visible()))
    if spec["end"]:
        hooks["end"] = lambda state, context, exc: log.append(("end", j, state, repr(exc), _visible()))
    if spec["on_error"] != "none":
        async def on_error(exc, context):
            log.append(("on_error", j, repr(exc), _visible()))
            await asyncio.sleep(0)
            if spec["on_error"] == "raises":
                raise Boom(f"mapped by {j}")
        hooks["on_error"] = on_error
    return hooks


def _bare(kind: str, items: int, raise_at: int | None, log: list):
    if kind == "unary":
        async def unary(request, context):
            log.append(("handler", _visible()))
            await asyncio.sleep(0)
            if raise_at is not None:
                raise Boom("handler")
            return "response"
        return grpc.unary_unary_rpc_method_handler(unary)

    async def stream(request, context):
        try:
            for i in range(items):
                log.append(("step", i, _visible()))
                await asyncio.sleep(0)
                if raise_at == i:
                    raise Boom(f"handler at {i}")
                yield f"item{i}"
        finally:
            log.append(("handler closed", _visible()))
    return grpc.unary_stream_rpc_method_handler(stream)


def _plain(handler):
    """The same handler without the fusion marker: the next wrap nests instead of fusing."""
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(handler.unary_unary)
    return grpc.unary_stream_rpc_method_handler(handler.unary_stream)


def _stack(scenario: dict, log: list, fused: bool):
    handler = _bare(scenario["kind"], scenario["items"], scenario["raise_at"], log)
    for j in range(len(scenario["layers"]) - 1, -1, -1):  # innermost first, as grpc.aio applies them
        hooks = _layer_hooks(j, scenario["layers"][j], log)
        handler = wrap_handler(handler, **hooks) if fused else _nested(_plain(handler), **hooks)
    return handler


async def _drive(handler, scenario: dict, log: list):
    if handler.unary_unary is not None:
        try:
            return ("ok", await handler.unary_unary("request", None))
        except BaseException as exc:  # noqa: BLE001 - the outcome compared
            return ("raised", repr(exc))
    gen = handler.unary_stream("request", None)
    assert inspect.isasyncgen(gen)
    got = []
    try:
        async for item in gen:
            got.append(item)
            log.append(("consumer", item, _visible()))
            if scenario["stop_after"] is not None and len(got) >= scenario["stop_after"]:
                await gen.aclose()
                return ("closed", got)
        return ("ok", got)
    except BaseException as exc:  # noqa: BLE001 - the outcome compared
        return ("raised", repr(exc), got)


def _run(scenario: dict, fused: bool):
    log: list = []
    handler = _stack(scenario, log, fused)
    outcome = asyncio.run(_drive(handler, scenario, log))
    return outcome, log


_layer = st.fixed_dictionaries({
    "start": st.sampled_from(["none", "ok", "ok", "raises"]),
    "around": st.booleans(),
    "on_message": st.booleans(),
    "end": st.booleans(),
    "on_error": st.sampled_from(["none", "returns", "raises"]),
})


@st.composite
def _scenarios(draw):
    kind = draw(st.sampled_from(["unary", "stream"]))
    items = draw(st.integers(0, 3))
    raise_at = draw(st.none() | st.integers(0, max(0, items - 1)))
    return {
        "kind": kind,
        "items": items,
        "raise_at": raise_at if kind == "stream" or raise_at is None else 0,
        "layers": draw(st.lists(_layer, min_size=1, max_size=4)),
        "stop_after": draw(st.none() | st.integers(1, 3)) if kind == "stream" else None,
    }


@settings(max_examples=300, deadline=None)
@given(_scenarios())
def test_fused_layers_run_the_hooks_of_nested_layers_in_the_same_order(scenario):
    assert _run(scenario, fused=True) == _run(scenario, fused=False)


def test_wrapping_a_wrapped_handler_fuses_the_layers_around_the_bare_handler():
    """The point of fusing: four interceptors make one wrapper around the bare handler (one
    generator step per streamed message), and every around is set while the handler steps,
    none while the consumer runs."""
    log: list = []
    scenario = {"kind": "stream", "items": 2, "raise_at": None, "stop_after": None,
                "layers": [{"start": "ok", "around": True, "on_message": True, "end": True, "on_error": "raises"}] * 4}
    handler = _stack(scenario, log, fused=True)
    bare, layers = handler.tandem_layers
    assert len(layers) == 4 and bare.unary_stream.__name__ == "stream"
    outcome = asyncio.run(_drive(handler, scenario, log))
    assert outcome == ("ok", ["item0", "item1"])
    assert [e[2] for e in log if e[0] == "step"] == ["0123", "0123"]
    assert [e[2] for e in log if e[0] == "consumer"] == ["", ""]
