"""A Python client of the router (``Client`` blocking, ``AsyncClient`` for asyncio), and
``tandem generate``, which streams an answer with it and prints the usage.

    from services.client import Client
    with Client("127.0.0.1:50050", token="tokA") as c:
        for delta in c.stream("Once upon a time", max_tokens=32, temperature=0.8, seed=0):
            print(delta.text, end="")
        answer = c.generate("Hello", max_tokens=8, stop=["\\n"])   # .text, .usage, .finish_reason

Errors arrive as the typed :class:`~services.common.errors.TandemError` of their status code
(``InvalidArgument``, ``ResourceExhausted``, ...), or :class:`ClientError` for codes without one.
Unset sampling fields take the router's defaults, which are OpenAI's (temperature 1.0: sampling;
pass ``temperature=0`` for greedy). ``tandem generate`` defaults to ``--temperature 0`` (greedy).
``logprobs=N`` returns each token's raw target logprob and N alternatives; ``samples(prompt, n)``
returns ``n`` answers that share the prompt's KV.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

from services.common.errors import TandemError, error_class



class ClientError(TandemError):
    """A status code Tandem has no typed error for (INTERNAL, UNKNOWN, ...); ``code_name`` says which."""

    def __init__(self, code_name: str, message: str):
        super().__init__(f"{code_name}: {message}")
        self.code_name = code_name


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    mean_acceptance_length: float
    worker_id: str
    time_to_first_token_s: float


@dataclass(frozen=True, slots=True)
class Delta:
    """One streamed message; the last one (of its sample) has ``usage`` and ``finish_reason`` set."""

    text: str
    token_ids: tuple[int, ...]
    usage: Usage | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last message
    logprobs: tuple = ()  # TokenLogprob per token id, when asked for
    index: int = 0  # the sample (n > 1)


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    token_ids: tuple[int, ...]
    usage: Usage
    finish_reason: str
    logprobs: tuple = ()  # services.common.logprobs.TokenLogprob per token, when asked for


def _request(prompt: str | Sequence[int], *, max_tokens: int, temperature: float | None, top_p: float | None,
             top_k: int, seed: int | None, stop: Sequence[str], stop_token_ids: Sequence[int], ignore_eos: bool,
             num_draft_tokens: int | None, request_id: str, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, repetition_penalty: float | None = None, logprobs: int | None = None,
             n: int = 1):
    from services.common.wire import tokens_to_proto
    from tandem.router.v1 import router_pb2

    req = router_pb2.GenerateRequest(max_new_tokens=max_tokens, top_k=top_k, stop=list(stop),
                                     stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos, request_id=request_id,
                                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, n=n)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.CopyFrom(tokens_to_proto(list(prompt)))
    for name, value in (("temperature", temperature), ("top_p", top_p), ("seed", seed),
                        ("num_draft_tokens", num_draft_tokens), ("repetition_penalty", repetition_penalty),
                        ("logprobs", logprobs)):
        if value is not None:  # unset stays unset: the router's default applies (k: the router's, else the worker's)
            setattr(req, name, value)
    return req


def _delta(msg) -> Delta:
    from services.common.wire import FINISH_REASONS, logprobs_from_proto

    ids = tuple(msg.token_ids)
    logprobs = logprobs_from_proto(ids, msg.logprobs)
    if not msg.HasField("usage"):
        return Delta(msg.text, ids, logprobs=logprobs, index=msg.index)
    u = msg.usage
    usage = Usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.mean_acceptance_length, u.worker_id,
                  u.time_to_first_token_s)
    return Delta(msg.text, ids, usage, FINISH_REASONS.get(msg.finish_reason, "length"), logprobs, msg.index)


def _typed(err) -> TandemError:
    code = err.code().name
    cls = error_class(code)
    return cls(err.details() or code) if cls else ClientError(code, err.details() or "")


def _answer(deltas: list[Delta]) -> Answer:
    last = deltas[-1]
    return Answer("".join(d.text for d in deltas), tuple(t for d in deltas for t in d.token_ids), last.usage,
                  last.finish_reason, tuple(lp for d in deltas for lp in d.logprobs))


def _answers(deltas: list[Delta], n: int) -> list[Answer]:
    return [_answer([d for d in deltas if d.index == i]) for i in range(n)]


# Each stream's unread bytes the client lets gRPC buffer (services.common.channels.stream_window_options).
# 0 = gRPC's own, auto-tuned window. A small one (e.g. 64) makes a consumer slower than the engine
# get fewer messages of more tokens each, its lag bounded; but a window must cover the link's
# bandwidth × round trip, or it adds latency on a distant router (a 64-byte window on a 50 ms link
# doubled the token latency at 200 tokens/s). The router bounds what it buffers itself.
DEFAULT_STREAM_WINDOW_BYTES = 0


class _Base:
    def __init__(self, address: str = "127.0.0.1:50050", *, token: str | None = None, timeout_s: float = 120.0,
                 credentials=None, stream_window_bytes: int = DEFAULT_STREAM_WINDOW_BYTES):
        self.address, self.timeout_s, self._credentials = address, timeout_s, credentials
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._options: tuple = ()
        if stream_window_bytes:  # imported only then: channels pulls in the telemetry SDK
            from services.common.channels import stream_window_options

            self._options = stream_window_options(stream_window_bytes)

    def _channel(self, grpc_module):
        if self._credentials is not None:
            return grpc_module.secure_channel(self.address, self._credentials, options=self._options)
        return grpc_module.insecure_channel(self.address, options=self._options)


class Client(_Base):
    """Blocking client over one channel (``close()`` or use as a context manager).
    ``credentials``: ``grpc.ssl_channel_credentials(...)`` for a TLS router; ``stream_window_bytes``:
    how much of a stream gRPC buffers unread (``DEFAULT_STREAM_WINDOW_BYTES``; 0 = gRPC's own)."""

    def __init__(self, address: str = "127.0.0.1:50050", **kwargs):
        import grpc

        from tandem.router.v1 import router_pb2_grpc

        super().__init__(address, **kwargs)
        self._grpc = grpc
        self._chan = self._channel(grpc)
        self._stub = router_pb2_grpc.RouterStub(self._chan)

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 64, temperature: float | None = None,
               top_p: float | None = None, top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
               stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, num_draft_tokens: int | None = None,
               request_id: str = "", timeout_s: float | None = None, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, repetition_penalty: float | None = None, logprobs: int | None = None,
               n: int = 1) -> Iterator[Delta]:
        """Deltas as the router streams them; the last carries usage and finish reason."""
        req = _request(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                       stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                       num_draft_tokens=num_draft_tokens, request_id=request_id, presence_penalty=presence_penalty,
                       frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, logprobs=logprobs,
                       n=n)
        call = self._stub.Generate(req, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        try:
            for msg in call:
                yield _delta(msg)
        except self._grpc.RpcError as err:
            raise _typed(err) from None
        finally:
            call.cancel()  # a consumer that stops early cancels the request (no-op once it ended)

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Answer:
        """The whole answer (same arguments as :meth:`stream`)."""
        return _answer(list(self.stream(prompt, **kwargs)))

    def samples(self, prompt: str | Sequence[int], n: int, **kwargs) -> list[Answer]:
        """``n`` whole answers of one prompt, sharing its KV (same arguments as :meth:`stream`)."""
        return _answers(list(self.stream(prompt, n=n, **kwargs)), n)

    def close(self) -> None:
        self._chan.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Base):
    """The asyncio client (``grpc.aio``); create it inside the event loop it is used on."""

    def __init__(self, address: str = "127.0.0.1:50050", **kwargs):
        import grpc

        from tandem.router.v1 import router_pb2_grpc

        super().__init__(address, **kwargs)
        self._grpc = grpc
        self._chan = self._channel(grpc.aio)
        self._stub = router_pb2_grpc.RouterStub(self._chan)

    async def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 64, temperature: float | None = None,
                     top_p: float | None = None, top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
                     stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                     num_draft_tokens: int | None = None, request_id: str = "",
                     timeout_s: float | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                     repetition_penalty: float | None = None, logprobs: int | None = None,
                     n: int = 1) -> AsyncIterator[Delta]:
        req = _request(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                       stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                       num_draft_tokens=num_draft_tokens, request_id=request_id, presence_penalty=presence_penalty,
                       frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, logprobs=logprobs,
                       n=n)
        call = self._stub.Generate(req, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        try:
            async for msg in call:
                yield _delta(msg)
        except self._grpc.aio.AioRpcError as err:
            raise _typed(err) from None
        finally:
            call.cancel()

    async def generate(self, prompt: str | Sequence[int], **kwargs) -> Answer:
        return _answer([d async for d in self.stream(prompt, **kwargs)])

    async def samples(self, prompt: str | Sequence[int], n: int, **kwargs) -> list[Answer]:
        return _answers([d async for d in self.stream(prompt, n=n, **kwargs)], n)

    async def close(self) -> None:
        await self._chan.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


# ------------------------------------------------------------------------------- tandem generate
def _number(kind, low: float, inclusive: bool = True, high: float | None = None):
    """An argparse type: ``kind`` (int/float) that is >= low (or > low) and <= high, with a one-line error."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if value < low or (not inclusive and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low:g} (got {text})")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g} (got {text})")
        return value

    return parse


class _RefuseToken(argparse.Action):
    """``--token VALUE`` is refused (exit 2) without echoing the value."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("--token is not accepted (a command line is visible to every user): "
                     "use --token-file PATH or the TANDEM_TOKEN variable")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="text prompt")
    parser.add_argument("--router", default=os.environ.get("TANDEM_ROUTER_ADDRESS", "127.0.0.1:50050"), help="router host:port")
    parser.add_argument("--max-tokens", "--max-new-tokens", dest="max_new_tokens", type=_number(int, 1), default=64,
                        help="tokens to generate (>= 1; default 64)")
    # explicit greedy default here (the API's unset temperature is OpenAI's 1.0)
    parser.add_argument("--temperature", type=_number(float, 0.0), default=0.0,
                        help="0 = greedy (default here; an API call that leaves it unset samples at 1.0)")
    parser.add_argument("--top-p", type=_number(float, 0.0, inclusive=False, high=1.0), default=None, help="nucleus mass in (0, 1] (default 1)")
    parser.add_argument("--top-k", type=_number(int, 0), default=0, help="keep the k most likely tokens (0 = all; default)")
    parser.add_argument("--seed", type=_number(int, 0), default=None, help="seed for reproducible sampling (default: unseeded)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable); the text ends before it")
    parser.add_argument("--draft-tokens", type=_number(int, 0), default=None, help="draft tokens per step (0 = off; default: the router's --num-draft-tokens, else the worker's default)")
    # never a flag with the token itself: argv is visible to every user of the machine (ps)
    parser.add_argument("--token-file", default="", help="file holding the bearer token (tenant); default: $TANDEM_TOKEN")
    parser.add_argument("--token", action=_RefuseToken, help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=_number(float, 0.0, inclusive=False), default=120.0, help="deadline of the request")


def generate_and_print(router: str, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0,
                       top_p: float | None = None, top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
                       draft_tokens: int | None = None, token: str | None = None, timeout_s: float = 120.0,
                       out=sys.stdout) -> int:
    """Stream one request; print text as it arrives, then a usage line. Returns an exit code."""
    last = None
    with Client(router, token=token, timeout_s=timeout_s) as client:
        out.write(prompt)
        try:
            for delta in client.stream(prompt, max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                       top_k=top_k, seed=seed, stop=stop, num_draft_tokens=draft_tokens):
                if delta.text:
                    out.write(delta.text)
                    out.flush()
                last = delta
        except TandemError as err:
            out.write("\n")
            name = err.code_name if isinstance(err, ClientError) else err.code.value
            message = err.message.removeprefix(f"{name}: ")
            print(f"error: {name}: {message}", file=sys.stderr)
            return 1
    out.write("\n")
    if last is not None and last.usage is not None:
        u = last.usage
        print(
            f"[worker {u.worker_id}] prompt {u.prompt_tokens} tokens "
            f"(cached {u.cached_tokens}), completion {u.completion_tokens} tokens, "
            f"acceptance length {u.mean_acceptance_length:.2f}, "
            f"TTFT {u.time_to_first_token_s * 1000:.1f} ms, finish {last.finish_reason}",
            file=out,
        )
    return 0


def read_token(token_file: str = "", environ=None) -> str | None:
    """The bearer token from ``token_file`` (stripped) or ``$TANDEM_TOKEN``; None if neither."""
    environ = os.environ if environ is None else environ
    if token_file:
        try:
            return open(token_file, encoding="utf-8").read().strip() or None
        except OSError as exc:
            raise SystemExit(f"tandem generate: error: cannot read --token-file {token_file!r}: {exc.strerror or exc}")
    return environ.get("TANDEM_TOKEN") or None


def run(args: argparse.Namespace) -> int:
    return generate_and_print(
        args.router, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop, draft_tokens=args.draft_tokens,
        token=read_token(args.token_file), timeout_s=args.timeout_s,
    )
