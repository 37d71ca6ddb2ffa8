"""Client channels from one Tandem service to another: limits, deadlines, tracing, optional TLS.

Every outgoing call must carry a deadline. Callers compute one from their own caller's remaining
time with :func:`call_timeout`; as a backstop the channel's :class:`DefaultDeadline` interceptors
give any call made without ``timeout=`` the channel's default, so no call can hang forever::

    stub.Match(req)               ──▶ DefaultDeadline (timeout None → default_timeout_s)
    stub.Match(req, timeout=0.3)  ──▶ DefaultDeadline (kept)  ──▶ tracing (inject traceparent) ──▶ wire

:class:`ChannelPool` keeps one channel per address (the router dials many workers) and closes
them all on shutdown.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import grpc

from services.common.errors import InvalidArgument
from services.common.telemetry import client_tracing_interceptors

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# HTTP/2 keepalive on every channel: a peer that stops answering (SIGSTOP, a dead host, a cut
# network) is noticed within ~time + timeout and its calls fail UNAVAILABLE instead of hanging.
# Servers permit pings this often (services.common.server.SERVER_KEEPALIVE_OPTIONS).
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
KEEPALIVE_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # gRPC core times a keepalive ping out by the HTTP/2 ping timeout (default 60 s), not only
    # keepalive_timeout_ms: without this a frozen peer is noticed after a minute
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


def call_timeout(remaining_s: float | None, cap_s: float, *, floor_s: float = 0.001) -> float:
    """Deadline (seconds) for an outgoing call: the caller's remaining time, capped at ``cap_s``.

    ``remaining_s`` None means the caller set no deadline (then ``cap_s``). Never below
    ``floor_s``: an already expired caller gets a call that fails at once with
    DEADLINE_EXCEEDED rather than one without a deadline. Pure.
    """
    if cap_s <= 0:
        raise InvalidArgument(f"cap_s must be > 0, got {cap_s}")
    timeout = cap_s if remaining_s is None else min(remaining_s, cap_s)
    return max(timeout, floor_s)


# Every channel reconnects quickly: gRPC's default first reconnect backoff is 1 s (growing to
# 120 s), too slow for a failover or a kvstore restart measured in seconds — a kvstore back after
# 1.5 s was reached up to a whole backoff later. A connect attempt to a dead port costs next to
# nothing, so the backoff stays at most 250 ms.
FAILOVER_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
)


def stream_window_options(window_bytes: int) -> tuple[tuple[str, object], ...]:
    """Channel options that let the receiver of a token stream buffer at most about
    ``window_bytes`` of each stream unread (0: gRPC's own window, auto-tuned up to megabytes).

    A reader that falls behind then stops the sender at once instead of queueing thousands of
    one-token messages in gRPC, and the sender, whose tokens keep coming, merges the ones that
    wait into its next message (the worker does; the router, reading a worker only as fast as
    its client reads it, passes the stop on)::

        engine ─▶ worker ──(window)──▶ router ──(window)──▶ client
                  merges what waits     reads the worker    reads slowly: its window fills,
                  while its sends are   only after each      the router's write waits, the
                  held: fewer, larger   write to its client  worker's window fills, the worker
                  messages              (no read-ahead)      merges

    The lag a slow reader accumulates is then bounded by the window, not by the request's
    length: at the end of a closed-loop wave the router drains a few messages per stream, not
    every token it fell behind by. A message larger than the window still passes (gRPC grants
    what a pending read needs), one window update per message; HTTP/2's BDP probe is off, as it
    would grow the window back. Pure."""
    if window_bytes < 0:
        raise InvalidArgument(f"window_bytes must be >= 0, got {window_bytes}")
    if window_bytes == 0:
        return ()
    return (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window_bytes))


def grpc_target(addresses: str) -> str:
    """A gRPC target for one address or a comma-separated list of them (a kvstore leader and
    its standbys). A list becomes an ``ipv4:``/``ipv6:`` target of resolved addresses, which
    gRPC's pick_first tries in order: only the leading kvstore listens, so the channel lands on
    it and moves on when it dies. Names are resolved once, here. InvalidArgument for an empty
    entry or an unresolvable name."""
    import socket

    parts = [p.strip() for p in addresses.split(",")]
    if len(parts) == 1:
        return parts[0]
    resolved: list[str] = []
    family = None
    for part in parts:
        host, sep, port = part.rpartition(":")
        if not part or not sep or not port.isdigit():
            raise InvalidArgument(f"address {part!r} in {addresses!r} must be HOST:PORT")
        host = host.strip("[]")
        try:
            # one family for the whole target (ipv4: or ipv6:): the first address decides
            infos = socket.getaddrinfo(host, int(port), family=family or 0, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise InvalidArgument(f"cannot resolve {host!r} in {addresses!r}: {exc}") from None
        fam, *_, sockaddr = infos[0]
        family = family or fam
        ip = sockaddr[0]
        resolved.append(f"[{ip}]:{port}" if fam == socket.AF_INET6 else f"{ip}:{port}")
    scheme = "ipv6" if family == socket.AF_INET6 else "ipv4"
    return f"{scheme}:{','.join(resolved)}"


def _with_default_timeout(details: grpc.aio.ClientCallDetails, default_s: float) -> grpc.aio.ClientCallDetails:
    if details.timeout is not None:
        return details
    return details._replace(timeout=default_s)


class _DefaultDeadlineUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, default_s: float):
        self.default_s = default_s

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_default_timeout(client_call_details, self.default_s), request)


class _DefaultDeadlineUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, default_s: float):
        self.default_s = default_s

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_default_timeout(client_call_details, self.default_s), request)


def default_deadline_interceptors(default_s: float) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that give calls made without ``timeout=`` a deadline of ``default_s``."""
    if not default_s > 0:
        raise InvalidArgument(f"default deadline must be > 0, got {default_s}")
    return [_DefaultDeadlineUnaryUnary(default_s), _DefaultDeadlineUnaryStream(default_s)]


def open_channel(
    address: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    default_timeout_s: float = 60.0,
    trace: bool = True,
    intercept_streams: bool = True,
    interceptors: Iterable[grpc.aio.ClientInterceptor] = (),
    options: Sequence[tuple[str, object]] = (),
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``address`` (must be called with an event loop running).

    Bounded message sizes both ways, a default deadline for calls without one, W3C trace context
    propagation (``trace``), then ``interceptors``; TLS when ``credentials`` are given.

    ``intercept_streams=False`` leaves server-streaming calls without interceptors: grpc.aio
    reads every message of an intercepted stream through one more async iterator, ~5 % of a
    router's CPU at 64 streams. Such calls must then pass ``timeout=`` and
    ``metadata=telemetry.trace_metadata()`` themselves.
    """
    if not address:
        raise InvalidArgument("address is required")
    chain = [*default_deadline_interceptors(default_timeout_s)]
    if trace:
        chain.extend(client_tracing_interceptors())
    chain.extend(interceptors)
    if not intercept_streams:
        chain = [i for i in chain if not isinstance(i, grpc.aio.UnaryStreamClientInterceptor)]
    opts = _options(max_message_bytes, options, address, credentials)
    target = grpc_target(address)
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=opts, interceptors=chain)
    return grpc.aio.insecure_channel(target, options=opts, interceptors=chain)


def _options(max_message_bytes: int, options: Sequence[tuple[str, object]], address: str = "",
             credentials: grpc.ChannelCredentials | None = None) -> list[tuple[str, object]]:
    failover: list[tuple[str, object]] = [*FAILOVER_OPTIONS]
    if "," in address:  # a leader and its standbys (``grpc_target``)
        if credentials is not None:
            # The target is a list of resolved IPs: TLS checks every kvstore's certificate against
            # the first listed host name, so they must all carry it (e.g. a shared service name).
            failover.append(("grpc.ssl_target_name_override", address.split(",")[0].strip().rpartition(":")[0].strip("[]")))
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *KEEPALIVE_OPTIONS,
        *failover,
        *options,
    ]


def open_sync_channel(
    address: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    options: Sequence[tuple[str, object]] = (),
) -> grpc.Channel:
    """A blocking channel (for threads outside the event loop) with the same limits, keepalive
    and optional (m)TLS as :func:`open_channel`; callers pass ``timeout=`` on every call."""
    if not address:
        raise InvalidArgument("address is required")
    opts = _options(max_message_bytes, options, address, credentials)
    target = grpc_target(address)
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=opts)
    return grpc.insecure_channel(target, options=opts)


class ChannelPool:
    """One lazily opened channel per address, all sharing the same settings.

    :meth:`get` mutates the pool (opens a channel on first use); :meth:`close` closes them all.
    """

    def __init__(self, **channel_kwargs):
        self._kwargs = channel_kwargs
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address, **self._kwargs)
        return channel

    def __contains__(self, address: str) -> bool:
        return address in self._channels

    async def discard(self, address: str) -> None:
        """Close and forget the channel to ``address`` (e.g. a worker that left the registry)."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
