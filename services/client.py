"""``tandem generate``: stream an answer from the router and print usage."""

from __future__ import annotations

import argparse
import os
import sys


def _number(kind, low: float, inclusive: bool = True):
    """An argparse type: ``kind`` (int/float) that is >= low (or > low), with a one-line error."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if value < low or (not inclusive and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low:g} (got {text})")
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
    parser.add_argument("--max-new-tokens", type=_number(int, 1), default=64, help="tokens to generate (>= 1; default 64)")
    parser.add_argument("--temperature", type=_number(float, 0.0), default=0.0, help="0 = greedy (default)")
    parser.add_argument("--draft-tokens", type=_number(int, 0), default=None, help="draft tokens per step (0 = off; default: router's)")
    # never a flag with the token itself: argv is visible to every user of the machine (ps)
    parser.add_argument("--token-file", default="", help="file holding the bearer token (tenant); default: $TANDEM_TOKEN")
    parser.add_argument("--token", action=_RefuseToken, help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=_number(float, 0.0, inclusive=False), default=120.0, help="deadline of the request")


def generate_and_print(
    router: str,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    draft_tokens: int | None = None,
    token: str | None = None,
    timeout_s: float = 120.0,
    out=sys.stdout,
) -> int:
    """Stream one request; print text as it arrives, then a usage line. Returns an exit code."""
    import grpc

    from tandem.router.v1 import router_pb2, router_pb2_grpc

    request = router_pb2.GenerateRequest(text=prompt, max_new_tokens=max_new_tokens, temperature=temperature)
    if draft_tokens is not None:
        request.num_draft_tokens = draft_tokens
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        usage = None
        try:
            out.write(prompt)
            for msg in stub.Generate(request, timeout=timeout_s, metadata=metadata):
                if msg.text:
                    out.write(msg.text)
                    out.flush()
                if msg.HasField("usage"):
                    usage = msg.usage
        except grpc.RpcError as err:
            out.write("\n")
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    out.write("\n")
    if usage is not None:
        print(
            f"[worker {usage.worker_id}] prompt {usage.prompt_tokens} tokens "
            f"(cached {usage.cached_tokens}), completion {usage.completion_tokens} tokens, "
            f"acceptance length {usage.mean_acceptance_length:.2f}, "
            f"TTFT {usage.time_to_first_token_s * 1000:.1f} ms, finish {usage.finish_reason}",
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
        args.router,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        draft_tokens=args.draft_tokens,
        token=read_token(args.token_file),
        timeout_s=args.timeout_s,
    )
