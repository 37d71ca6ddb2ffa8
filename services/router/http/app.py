"""The OpenAI-compatible HTTP front: a thin adapter over the router's :class:`Dispatcher`.

    HTTP request ──▶ bearer token → tenant (the gRPC path's TenantRegistry)
                 ──▶ JSON body → schema (400s) → prompt ids (chat template) → jobs.build_job
                 ──▶ Dispatcher.generate (the same routing, reservation and settling as gRPC)
                 ──▶ one JSON response, or server-sent events ending in ``data: [DONE]``

Errors before the first token are HTTP errors in OpenAI's shape (see ``errors``); after it, a
stream carries one ``data: {"error": ...}`` event and ends. A client that disconnects cancels its
request: the cancellation reaches ``Dispatcher.generate``, which cancels the worker call (the
worker aborts the reservation) or settles a reservation no worker acknowledged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from services.common.auth import bearer_token
from services.common.chat_template import ChatTemplate, load_chat_template, normalize_messages
from services.common.errors import TandemError, Unavailable
from services.router.dispatcher import Completion, Dispatcher
from services.router.front_trace import FrontTrace, Stamps, prompt_key
from services.router.http.errors import BodyTooLarge, ModelNotFound, RequestError, http_error
from services.router.http.schema import ChatCompletionRequest, CompletionRequest, parse
from services.router.jobs import GenerateJob, RequestLimits, build_job, sample_jobs
from services.router.samples import first_events, merged
from services.router.tenants import Tenant, TenantRegistry

log = logging.getLogger(__name__)


def _dumps(body: dict) -> str:
    return json.dumps(body, separators=(",", ":"))  # compact: what every answer and event is


def _json(status: int, body: dict) -> Response:
    return Response(_dumps(body), status_code=status, media_type="application/json")


def _sse(body: dict) -> str:
    return f"data: {_dumps(body)}\n\n"


def usage_body(usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class ClientGone(Exception):
    """The HTTP client disconnected before its request was read."""


class _Watch:
    """Cancels the request's task when its client disconnects (hang-up cancels generation).

    One watcher task per request, started once the body is read, instead of a task per wait:
    the first token then reaches the handler, and is written, without any hop between tasks.
    """

    def __init__(self, receive):
        self.gone = False  # the client hung up (the task's CancelledError is ours)
        self.finished = False  # the answer is complete: uvicorn's receive() then says disconnect too
        self._task = asyncio.current_task()
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.finished:
            self.gone = True
            self._task.cancel()

    def stop(self) -> None:
        self.finished = True
        self._watcher.cancel()


async def _read_body(scope, receive, limit: int) -> bytes:
    """The request body; BodyTooLarge past ``limit`` bytes, by its Content-Length before anything
    is read, or as the chunks arrive (a chunked body has none): memory stays bounded."""
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


async def _send_json(send, status: int, body: dict) -> None:
    data = _dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON_HEADERS, (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


class _Endpoint:
    """A raw ASGI endpoint (Starlette routes a non-function endpoint to it as it is)."""

    def __init__(self, handler):
        self._handler = handler

    async def __call__(self, scope, receive, send) -> None:
        await self._handler(scope, receive, send)


class OpenAIFront:
    """Routes of the HTTP front. ``source()`` returns the router's current (tokenizer, limits,
    model name): all None until ``--model auto`` learned the model from a worker."""

    def __init__(self, dispatcher: Dispatcher, tenants: TenantRegistry, source: Callable[[], tuple],
                 *, metrics=None, clock: Callable[[], float] = time.time, trace: FrontTrace | None = None,
                 max_body_bytes: int = 16 << 20):
        self.dispatcher = dispatcher
        self.max_body_bytes = max_body_bytes  # larger bodies are refused (413) before they are read whole
        self.trace = trace  # debug: per-request timestamps (front_trace); None = off
        self.metrics = metrics  # RouterMetrics: HTTP generations count in the same series as gRPC ones
        self.tenants = tenants
        self._source = source
        self._clock = clock
        self._templates: dict[str, ChatTemplate] = {}

    def app(self):
        app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            # the generation routes are raw ASGI: no Request/Response objects, no Starlette
            # StreamingResponse (its anyio task group costs ~0.5 ms before the first chunk)
            Route("/v1/completions", _Endpoint(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", _Endpoint(self.chat_completions), methods=["POST"]),
        ])
        return app if self.trace is None else _traced(app, self.trace)

    # ------------------------------------------------------------------------------- helpers
    def _tenant(self, scope) -> Tenant:
        header = _header(scope, b"authorization")
        return self.tenants.authenticate(bearer_token([("authorization", header)] if header else []))

    def _bound(self) -> tuple:
        tokenizer, limits, model = self._source()
        if tokenizer is None or limits is None or not model:
            raise Unavailable("no worker is registered yet, so the router does not know its model")
        return tokenizer, limits, model

    @staticmethod
    def _check_model(asked: str, served: str) -> None:
        if asked not in (served, Path(served).name):
            raise ModelNotFound(asked)

    @staticmethod
    def _parse(raw: bytes, schema):
        try:
            body = json.loads(raw)
        except ValueError:
            raise RequestError("the request body is not valid JSON") from None
        return parse(schema, body)

    def _template(self, model: str) -> ChatTemplate:
        if model not in self._templates:
            self._templates[model] = load_chat_template(model)
        return self._templates[model]

    @staticmethod
    def _jobs(req, limits: RequestLimits, tokenizer, *, text=None, token_ids=None, max_tokens: int) -> list[GenerateJob]:
        """One job per sample (``n``); sample i of a seeded request uses seed + i."""
        return sample_jobs(req.n, lambda *, seed, request_id: build_job(
            text=text,
            token_ids=token_ids,
            max_new_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's default
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            seed=seed,
            num_draft_tokens=req.num_draft_tokens,
            stop_token_ids=req.stop_token_ids or (),
            stop_strings=req.stop_strings(),
            ignore_eos=req.ignore_eos,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            logprobs=req.logprob_count(),
            request_id=request_id,
            limits=limits,
            tokenizer=tokenizer,
        ), seed=req.seed)

    async def _generation(self, scope, receive, send, run) -> None:
        """Serve one generation request: read its body, watch for a hang-up from then on, and
        ``run(body, send, track)``. A typed error before the answer started becomes OpenAI's JSON
        error with its HTTP status; every outcome is counted in the router's metrics (a stream
        counts its own)."""
        track = _Track(self.metrics)
        watch: _Watch | None = None
        started = False

        async def reply(message) -> None:
            nonlocal started
            started = True
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                watch.finished = True  # uvicorn's receive() says "disconnect" once the answer is complete
            await send(message)

        try:
            body = await _read_body(scope, receive, self.max_body_bytes)
            watch = _Watch(receive)
            await run(body, reply, track)
        except asyncio.CancelledError:
            if watch is None or not watch.gone:
                raise  # the server's (shutdown), not our hang-up
            track.end("CANCELLED")  # nothing to answer: nobody listens
        except ClientGone:
            track.end("CANCELLED")
        except TandemError as exc:
            track.end(exc.code.value)
            if not started:
                await _send_json(send, *http_error(exc))
        except Exception as exc:  # a bug: logged with its trace, never shown to the client
            track.end("INTERNAL")
            log.exception("HTTP %s %s failed", scope["method"], scope["path"])
            if not started:
                await _send_json(send, *http_error(exc))
        finally:
            if watch is not None:
                watch.stop()
                if watch.gone:  # our cancellation is handled (also if the dispatcher turned it into an error)
                    asyncio.current_task().uncancel()

    # -------------------------------------------------------------------------------- routes
    async def health(self, request: Request) -> Response:
        """vLLM's liveness probe, which load generators (guidellm) call before a run: 200 with an
        empty body once the router knows its model, 503 before. No token needed (it says nothing
        about any tenant)."""
        _tok, _lim, model = self._source()
        return Response(status_code=200 if model else 503)

    async def models(self, request: Request) -> Response:
        try:
            self._tenant(request.scope)
        except TandemError as exc:
            return _json(*http_error(exc))
        _tok, _lim, model = self._source()
        data = [{"id": model, "object": "model", "created": 0, "owned_by": "tandem"}] if model else []
        return _json(200, {"object": "list", "data": data})

    async def completions(self, scope, receive, send) -> None:
        async def run(body: bytes, send, track):
            tenant = self._tenant(scope)
            req: CompletionRequest = self._parse(body, CompletionRequest)
            tokenizer, limits, model = self._bound()
            self._check_model(req.model, model)
            text, ids = req.single_prompt()
            jobs = self._jobs(req, limits, tokenizer, text=text, token_ids=ids, max_tokens=req.max_tokens or 16)
            await self._respond(scope, send, req, jobs, tenant, model, track, chat=False, tokenizer=tokenizer)

        await self._generation(scope, receive, send, run)

    async def chat_completions(self, scope, receive, send) -> None:
        async def run(body: bytes, send, track):
            tenant = self._tenant(scope)
            req: ChatCompletionRequest = self._parse(body, ChatCompletionRequest)
            tokenizer, limits, model = self._bound()
            self._check_model(req.model, model)
            messages = normalize_messages([m.model_dump() for m in req.messages])
            ids = self._template(model).encode(messages, tokenizer, add_generation_prompt=req.add_generation_prompt)
            max_tokens = req.token_limit() or limits.max_new_tokens
            jobs = self._jobs(req, limits, tokenizer, token_ids=ids, max_tokens=max_tokens)
            await self._respond(scope, send, req, jobs, tenant, model, track, chat=True, tokenizer=tokenizer)

        await self._generation(scope, receive, send, run)

    # ------------------------------------------------------------------------------ responses
    async def _respond(self, scope, send, req, jobs: list[GenerateJob], tenant: Tenant, model: str,
                       track: _Track, *, chat: bool, tokenizer) -> None:
        """Run ``jobs`` (``n`` samples of one prompt) and answer with all of them as choices."""
        arrival = time.monotonic()
        stamps: Stamps | None = scope.get(_STAMPS)
        if stamps is not None:
            stamps.key = prompt_key(jobs[0].prompt)
            stamps.mark("dispatch")
        streams = [self.dispatcher.generate(j, tenant, deadline=None, arrival=arrival) for j in jobs]
        logprobs = _Logprobs(tokenizer, chat) if req.logprob_count() is not None else None
        shape = _Shape(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(self._clock()), model, chat, track,
                       logprobs)
        # every sample's first event before answering: a request failing before its first token
        # gets its HTTP status, not an SSE error (see ``samples``)
        firsts = await first_events(streams)
        if stamps is not None:
            stamps.mark("first_event")
        events = merged(firsts, streams)
        chunks = None
        try:  # a hang-up cancels this task wherever it waits: closing the events cancels the request
            if not req.stream:
                body = await shape.collect(events, len(jobs))
                await _send_json(send, 200, body)
                track.end("OK")
                return
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = shape.stream(events, len(jobs), include_usage)
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if chunks is not None:
                await chunks.aclose()
            await events.aclose()
            for s in streams:  # no-ops unless the hang-up came before ``merged`` started
                await s.aclose()


_STAMPS = "tandem.front_trace"  # the ASGI scope key of a traced request's Stamps


def _traced(app, trace: FrontTrace):
    """``app`` with front_trace stamps: entry when called, first write at the first body chunk."""
    async def traced(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        stamps = scope[_STAMPS] = trace.start("http")

        async def stamped_send(message):
            if message["type"] == "http.response.body" and message.get("body") and stamps.key:
                stamps.mark("first_write")
            await send(message)

        await app(scope, receive, stamped_send)

    return traced


def summed_usage(usages: list) -> dict:
    """OpenAI's usage of ``n`` samples: the prompt once (as the first sample saw it), completions summed."""
    body = usage_body(usages[0])
    body["completion_tokens"] = sum(u.completion_tokens for u in usages)
    body["total_tokens"] = body["prompt_tokens"] + body["completion_tokens"]
    return body


class _Track:
    """One generation in the router's metrics: in flight from creation, one outcome at the end."""

    def __init__(self, metrics):
        self._metrics = metrics
        if metrics is not None:
            metrics.in_flight.inc()

    def usage(self, usage) -> None:
        if self._metrics is not None:
            self._metrics.observe_usage(usage)

    def end(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.outcome(outcome)
            self._metrics = None  # once


class _Logprobs:
    """OpenAI's logprobs objects of one request's samples: chat ``{"content": [...]}`` entries, or the
    completions API's parallel lists with text offsets (continued across a stream's chunks)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self._offsets: dict[int, int] = {}  # sample -> text offset of its next token
        self._names: dict[int, str] = {}

    def _name(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            if len(self._names) > 65536:  # bounded: one request, but a vocabulary can be large
                self._names.clear()
            name = self._names[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return name

    def body(self, i: int, logprobs) -> dict:
        if self.chat:
            def entry(t: int, v: float) -> dict:
                name = self._name(t)
                return {"token": name, "logprob": v, "bytes": list(name.encode("utf-8"))}

            return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                                for lp in logprobs]}
        tokens, offsets = [], []
        offset = self._offsets.get(i, 0)
        for lp in logprobs:
            tokens.append(self._name(lp.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        self._offsets[i] = offset
        # as OpenAI: the sampled token is always among the top entries (so up to N + 1 of them)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self._name(t): v for t, v in lp.top} | {tokens[j]: lp.logprob}
                                 for j, lp in enumerate(logprobs)],
                "text_offset": offsets}


class _Shape:
    """The response objects of one request (completion or chat; whole or chunks)."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, track: _Track, logprobs: _Logprobs | None = None):
        self.rid, self.created, self.model, self.chat, self.track = rid, created, model, chat, track
        self.logprobs = logprobs

    def _envelope(self, choices: list, *, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, i: int, text: str, finish: str | None, *, chunk: bool, first: bool = False,
                logprobs=()) -> dict:
        lp = self.logprobs.body(i, logprobs) if self.logprobs is not None and (logprobs or not chunk) else None
        if not self.chat:
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
        if chunk:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": finish}

    async def collect(self, events: AsyncIterator, n: int) -> dict:
        pieces: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list] = [[] for _ in range(n)]
        usages: list = [None] * n
        async for i, event in events:
            pieces[i].append(event.text)
            logprobs[i].extend(event.logprobs)
            if isinstance(event, Completion):
                usages[i] = event.usage
                self.track.usage(event.usage)
        choices = [self._choice(i, "".join(p), u.finish_reason, chunk=False, logprobs=logprobs[i])
                   for i, (p, u) in enumerate(zip(pieces, usages))]
        body = self._envelope(choices, chunk=False)
        body["usage"] = summed_usage(usages)
        return body

    async def stream(self, events: AsyncIterator, n: int, include_usage: bool) -> AsyncIterator[str]:
        """SSE lines; closing this generator (client gone) closes ``events``, which cancels the request."""
        outcome = "CANCELLED"  # unless it ends below (a client that hangs up cancels the generator)
        opened, usages = [False] * n, [None] * n
        try:
            async for i, event in events:
                if event.text or event.logprobs or not opened[i]:
                    yield _sse(self._envelope([self._choice(i, event.text, None, chunk=True, first=not opened[i],
                                                            logprobs=event.logprobs)], chunk=True))
                    opened[i] = True
                if isinstance(event, Completion):
                    usages[i] = event.usage
                    self.track.usage(event.usage)
                    yield _sse(self._envelope([self._choice(i, "", event.usage.finish_reason, chunk=True)], chunk=True))
            outcome = "OK"
            if include_usage:
                body = self._envelope([], chunk=True)
                body["usage"] = summed_usage(usages)
                yield _sse(body)
        except TandemError as exc:
            outcome = exc.code.value
            _status, body = http_error(exc)
            yield _sse(body)
        except Exception as exc:
            outcome = "INTERNAL"
            log.exception("HTTP stream %s failed", self.rid)
            _status, body = http_error(exc)
            yield _sse(body)
        finally:
            self.track.end(outcome)
            await events.aclose()
        yield "data: [DONE]\n\n"
