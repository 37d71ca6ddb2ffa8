"""Who is calling, from the mTLS peer certificate, and which roles may call which method.

Inside the suite every hop is mutual TLS (``tls.py``); each certificate names a role and an id
(``spiffe://tandem/<role>/<id>``, see ``certs.py``). :class:`PeerRoleInterceptor` reads it from
the handshake (no per-call parsing: gRPC exposes the URI SAN as ``peer_uri``), refuses methods the
role may not call, and makes the peer available to the handler::

    RPC ─▶ peer_of(context) ── no Tandem identity ─▶ UNAUTHENTICATED
             │ role not allowed for the method ────▶ PERMISSION_DENIED (handler never runs)
             └─▶ handler runs with current_peer() = Peer(role, id)

Finer rules (a worker acts only under its own id, only on its own reservations) need the request
and live in the servicers and the kvstore core, which get ``current_peer()``.

Without TLS (``--insecure``) no interceptor is installed and ``current_peer()`` is None: every
caller that can reach the port is trusted with every role (what the README says about
insecure mode). Health and reflection stay open (probes carry no identity).
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import grpc

from services.common.certs import parse_identity_uri
from services.common.errors import PermissionDenied, Unauthenticated
from services.common.interceptors import DEFAULT_EXCLUDED_METHOD_PREFIXES, WrappingInterceptor, wrap_handler
from services.common.server import abort_with_status


@dataclass(frozen=True, slots=True)
class Peer:
    """An authenticated service: ``role`` (kvstore, worker, router, client) and its ``id``."""

    role: str
    id: str


_peer: contextvars.ContextVar[Peer | None] = contextvars.ContextVar("tandem_peer", default=None)


def current_peer() -> Peer | None:
    """The mTLS peer of the current RPC (None in insecure mode or outside a handler)."""
    return _peer.get()


def peer_of(context: grpc.aio.ServicerContext) -> Peer | None:
    """The Tandem identity in the caller's certificate, or None (read-only)."""
    auth = context.auth_context() or {}
    for uri in auth.get("peer_uri", ()):
        parsed = parse_identity_uri(uri.decode("utf-8", "replace"))
        if parsed is not None:
            return Peer(*parsed)
    return None


def acting_worker(peer: Peer | None, claimed: str = "") -> str | None:
    """The worker id a call acts as: the certificate's for a worker peer (a different non-empty
    ``claimed`` id is PermissionDenied), ``claimed`` (or None) in insecure mode, None for others."""
    if peer is None:
        return claimed or None
    if peer.role != "worker":
        if claimed:
            raise PermissionDenied(f"a {peer.role} cannot act as worker {claimed[:64]!r}")
        return None
    if claimed and claimed != peer.id:
        raise PermissionDenied(f"worker {peer.id!r} cannot act as worker {claimed[:64]!r}")
    return peer.id


class PeerRoleInterceptor(WrappingInterceptor):
    """Admit only callers whose certificate role ``rules[method name]`` lists (see module doc).

    ``rules`` maps a method's short name (``"Reserve"``) to the roles allowed; a method missing
    from ``rules`` is refused to everyone (new RPCs are closed until someone decides)."""

    def __init__(self, rules: Mapping[str, frozenset[str]]):
        super().__init__(DEFAULT_EXCLUDED_METHOD_PREFIXES)
        self._rules = dict(rules)

    def wrap(self, handler, method):
        allowed = self._rules.get(method.rsplit("/", 1)[-1], frozenset())

        def start(request, context) -> Peer:
            peer = peer_of(context)
            if peer is None:
                raise Unauthenticated("this service needs a Tandem client certificate (mTLS)")
            if peer.role not in allowed:
                raise PermissionDenied(f"role {peer.role!r} may not call {method.rsplit('/', 1)[-1]}")
            return peer

        def around(peer):
            return partial(_peer.reset, _peer.set(peer))

        async def on_error(exc: BaseException, context) -> None:
            await abort_with_status(exc, context, method)

        return wrap_handler(handler, start=start, around=around, on_error=on_error)
