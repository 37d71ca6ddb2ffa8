"""Bearer-token interceptor and TLS/mTLS credential helpers, over real loopback servers."""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest

from services.common.auth import (
    BearerAuthInterceptor,
    bearer_token,
    current_principal,
    load_channel_credentials,
    load_server_credentials,
)
from services.common.errors import InvalidArgument, Unauthenticated
from services.common.server import GrpcServer, ServiceBinding

SERVICE = "tandem.test.Whoami"


def _whoami_binding():
    """Unary and streaming methods that answer with the authenticated principal."""

    async def unary(request: bytes, context):
        return str(current_principal()).encode()

    async def stream(request: bytes, context):
        for _ in range(2):
            yield str(current_principal()).encode()

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
        },
    )
    return ServiceBinding(lambda _s, server: server.add_generic_rpc_handlers((handler,)), None, SERVICE)


def _authenticate(token):
    if token == "good":
        return "alice"
    raise Unauthenticated("missing or unknown bearer token")


def _start(start_service, **server_kwargs):
    async def start():
        server = GrpcServer([_whoami_binding()], port=0, grace_s=0,
                            interceptors=[BearerAuthInterceptor(_authenticate)], **server_kwargs)
        await server.start()
        await server.set_serving()
        return server, None

    return start


@pytest.mark.parametrize(
    "metadata, token",
    [
        ((), None),
        ((("authorization", "Bearer abc"),), "abc"),
        ((("authorization", "bearer   abc  "),), "abc"),
        ((("Authorization", "Bearer abc"),), "abc"),
        ((("authorization", "Basic abc"),), None),
        ((("authorization", "Bearer "),), None),
        ((("x-other", "Bearer abc"),), None),
    ],
)
def test_bearer_token_parsing(metadata, token):
    assert bearer_token(metadata) == token


def test_interceptor_authenticates_unary_and_stream(start_service):
    svc = start_service(_start(start_service))
    unary = svc.channel.unary_unary(f"/{SERVICE}/Unary")
    stream = svc.channel.unary_stream(f"/{SERVICE}/Stream")
    good = [("authorization", "Bearer good")]
    assert unary(b"", timeout=5, metadata=good) == b"alice"
    assert list(stream(b"", timeout=5, metadata=good)) == [b"alice", b"alice"]
    for metadata in (None, [("authorization", "Bearer bad")], [("authorization", "Basic good")]):
        with pytest.raises(grpc.RpcError) as exc:
            unary(b"", timeout=5, metadata=metadata)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as exc:
            list(stream(b"", timeout=5, metadata=metadata))
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the principal never leaks out of a handler into the server's loop
    assert svc.loop.call(current_principal) is None


def test_health_stays_open_without_a_token(start_service):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    svc = start_service(_start(start_service))
    resp = health_pb2_grpc.HealthStub(svc.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


# -------------------------------------------------------------------------------------------- TLS
def _make_pki(tmp_path):
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate (PEM files)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject_key, cn, issuer_key, issuer_cn, *, ca=False, san=None):
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(name(issuer_cn))
            .public_key(subject_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def write(path, obj):
        if hasattr(obj, "private_bytes"):
            data = obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
        else:
            data = obj.public_bytes(serialization.Encoding.PEM)
        path.write_bytes(data)
        return str(path)

    ca_key, server_key, client_key = key(), key(), key()
    ca = cert(ca_key, "tandem-test-ca", ca_key, "tandem-test-ca", ca=True)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = cert(server_key, "localhost", ca_key, "tandem-test-ca", san=san)
    client = cert(client_key, "router", ca_key, "tandem-test-ca")
    return {
        "ca": write(tmp_path / "ca.pem", ca),
        "server_cert": write(tmp_path / "server.pem", server),
        "server_key": write(tmp_path / "server.key", server_key),
        "client_cert": write(tmp_path / "client.pem", client),
        "client_key": write(tmp_path / "client.key", client_key),
    }


def _call_over_tls(address, credentials):
    with grpc.secure_channel(address, credentials) as channel:
        return channel.unary_unary(f"/{SERVICE}/Unary")(b"", timeout=5, metadata=[("authorization", "Bearer good")])


def test_tls_and_mtls(service_loop, tmp_path):
    pki = _make_pki(tmp_path)
    servers = []

    def start(creds):
        async def go():
            server = GrpcServer([_whoami_binding()], port=0, grace_s=0, server_credentials=creds,
                                interceptors=[BearerAuthInterceptor(_authenticate)])
            await server.start()
            return server

        server = service_loop.run(go())
        servers.append(server)
        return server.address

    try:
        # TLS: the client verifies the server against the CA
        tls = start(load_server_credentials(pki["server_cert"], pki["server_key"]))
        assert _call_over_tls(tls, load_channel_credentials(pki["ca"])) == b"alice"

        # mTLS: a client certificate is required
        mtls = start(load_server_credentials(pki["server_cert"], pki["server_key"], pki["ca"]))
        with_cert = load_channel_credentials(pki["ca"], pki["client_cert"], pki["client_key"])
        assert _call_over_tls(mtls, with_cert) == b"alice"
        with pytest.raises(grpc.RpcError) as exc:
            _call_over_tls(mtls, load_channel_credentials(pki["ca"]))
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for server in servers:
            service_loop.run(server.stop(0))


def test_credential_files_are_checked_up_front(tmp_path):
    not_pem = tmp_path / "x.pem"
    not_pem.write_text("hello")
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_server_credentials(tmp_path / "missing.pem", tmp_path / "missing.key")
    with pytest.raises(InvalidArgument, match="not a PEM"):
        load_channel_credentials(not_pem)
    with pytest.raises(InvalidArgument, match="both"):
        load_channel_credentials(None, cert_file=not_pem)
