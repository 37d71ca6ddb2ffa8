"""Bearer-token authentication and TLS/mTLS credentials for Tandem's gRPC servers and channels.

The interceptor only extracts the token and asks a service-supplied ``authenticate`` callable who
it belongs to; the service decides what a principal is (the router maps tokens to tenants)::

    client ── metadata "authorization: Bearer <token>" ──▶ BearerAuthInterceptor
                                                             principal = authenticate(token)
                                                               raises Unauthenticated → UNAUTHENTICATED
                                                             handler runs with current_principal()

The principal lives in a context variable set around the handler, so it cannot leak between
RPCs. Health and reflection stay open (load balancers probe them without credentials).
TLS helpers read PEM files named in settings; a client CA on the server side turns on mTLS.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import grpc

from services.common.errors import InvalidArgument
from services.common.interceptors import DEFAULT_EXCLUDED_METHOD_PREFIXES, WrappingInterceptor, wrap_handler
from services.common.server import abort_with_status

AUTHORIZATION_KEY = "authorization"
DEFAULT_EXEMPT_METHOD_PREFIXES = DEFAULT_EXCLUDED_METHOD_PREFIXES  # load balancers probe without credentials

_principal: contextvars.ContextVar[object | None] = contextvars.ContextVar("tandem_principal", default=None)


def bearer_token(metadata) -> str | None:
    """The token of an ``authorization: Bearer <token>`` metadata entry, or None (read-only).

    The scheme is case-insensitive (RFC 6750); any other scheme or an empty token counts as none.
    """
    for key, value in metadata or ():
        if key.lower() != AUTHORIZATION_KEY or not isinstance(value, str):
            continue
        scheme, _, token = value.strip().partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer" and token:
            return token
        return None
    return None


def current_principal() -> object | None:
    """Who the current RPC was authenticated as (None outside an authenticated handler)."""
    return _principal.get()


class BearerAuthInterceptor(WrappingInterceptor):
    """Authenticate every RPC (except ``exempt_prefixes``) before its handler runs.

    ``authenticate(token_or_None)`` returns the principal or raises a :class:`TandemError`
    (normally ``Unauthenticated``), which becomes the call's status; the handler never runs then.
    """

    def __init__(
        self,
        authenticate: Callable[[str | None], object],
        *,
        exempt_prefixes: Sequence[str] = DEFAULT_EXEMPT_METHOD_PREFIXES,
    ):
        super().__init__(exempt_prefixes)
        self._authenticate = authenticate

    def wrap(self, handler, method):
        authenticate = self._authenticate

        def start(request, context) -> object:
            return authenticate(bearer_token(context.invocation_metadata()))

        def around(principal):
            # Set around each step of the handler only, never across a yield of ours (a
            # generator closed later from another task must not reset it there).
            return partial(_principal.reset, _principal.set(principal))

        async def on_error(exc: BaseException, context) -> None:
            await abort_with_status(exc, context, method)

        return wrap_handler(handler, start=start, around=around, on_error=on_error)


# ------------------------------------------------------------------------------------------- TLS
def _read_pem(path: str | Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise InvalidArgument(f"{what} {str(path)!r} is not a PEM file")
    return data


def load_server_credentials(
    cert_file: str | Path, key_file: str | Path, client_ca_file: str | Path | None = None
) -> grpc.ServerCredentials:
    """TLS credentials for a server from PEM files (read-only).

    With ``client_ca_file`` the server requires and verifies client certificates (mTLS).
    Unreadable or non-PEM files are InvalidArgument, reported at start rather than at first call.
    """
    cert = _read_pem(cert_file, "TLS certificate")
    key = _read_pem(key_file, "TLS private key")
    if client_ca_file:
        ca = _read_pem(client_ca_file, "TLS client CA")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    return grpc.ssl_server_credentials([(key, cert)])


def load_channel_credentials(
    ca_file: str | Path | None = None,
    cert_file: str | Path | None = None,
    key_file: str | Path | None = None,
) -> grpc.ChannelCredentials:
    """TLS credentials for a client channel from PEM files (read-only).

    ``ca_file`` None trusts the system roots; ``cert_file`` + ``key_file`` (both or neither)
    present a client certificate for mTLS.
    """
    if bool(cert_file) != bool(key_file):
        raise InvalidArgument("a client certificate needs both cert_file and key_file")
    ca = _read_pem(ca_file, "TLS CA") if ca_file else None
    cert = _read_pem(cert_file, "TLS client certificate") if cert_file else None
    key = _read_pem(key_file, "TLS client key") if key_file else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def warn_if_insecure(settings, logger) -> None:
    """One warning line when a service runs without mTLS (insecure mode trusts every caller)."""
    if not getattr(settings, "tls_cert", ""):
        logger.warning("no --tls-cert/--tls-key/--tls-ca: insecure mode, every caller that reaches this "
                       "service is trusted with every role (bind it to loopback or a private network)")


def suite_credentials(settings) -> tuple[grpc.ServerCredentials | None, grpc.ChannelCredentials | None]:
    """(server, channel) credentials for mTLS inside the suite from a service's ``tls_cert`` /
    ``tls_key`` / ``tls_ca`` settings; (None, None) when they are unset (insecure mode). The
    server requires a client certificate signed by ``tls_ca``; the channel presents
    ``tls_cert`` and verifies the server against ``tls_ca`` (read-only)."""
    if not getattr(settings, "tls_cert", ""):
        return None, None
    server = load_server_credentials(settings.tls_cert, settings.tls_key, settings.tls_ca)
    channel = load_channel_credentials(settings.tls_ca, settings.tls_cert, settings.tls_key)
    return server, channel
