"""The throwaway CA, role identities in certificates, and the role interceptor over a real
loopback mTLS server (issue 8)."""

from __future__ import annotations

import argparse
import os
import stat

import grpc
import pytest

from services.common.auth import load_channel_credentials, suite_credentials
from services.common.certs import LocalCA, identity_uri, parse_identity_uri
from services.common.errors import InvalidArgument, PermissionDenied
from services.common.peers import Peer, PeerRoleInterceptor, acting_worker, current_peer
from services.common.server import GrpcServer, ServiceBinding

SERVICE = "tandem.test.Roles"


def test_identity_uris_round_trip_and_reject_junk():
    assert parse_identity_uri(identity_uri("worker", "gpu0")) == ("worker", "gpu0")
    for uri in ("spiffe://tandem/admin/x", "spiffe://other/worker/x", "spiffe://tandem/worker/", "spiffe://tandem/worker/a/b"):
        assert parse_identity_uri(uri) is None
    with pytest.raises(InvalidArgument):
        identity_uri("root", "x")
    with pytest.raises(InvalidArgument):
        identity_uri("worker", "x" * 129)


def test_acting_worker():
    assert acting_worker(None) is None and acting_worker(None, "w0") == "w0"  # insecure: the claim
    assert acting_worker(Peer("worker", "w0")) == "w0" and acting_worker(Peer("worker", "w0"), "w0") == "w0"
    assert acting_worker(Peer("router", "r")) is None
    with pytest.raises(PermissionDenied):
        acting_worker(Peer("worker", "w0"), "w1")
    with pytest.raises(PermissionDenied):
        acting_worker(Peer("router", "r"), "w0")


def test_written_keys_are_private(tmp_path):
    files = LocalCA().write(tmp_path, "worker", "w0")
    assert stat.S_IMODE(os.stat(files.key).st_mode) == 0o600
    settings = argparse.Namespace(tls_cert=files.cert, tls_key=files.key, tls_ca=files.ca)
    server, channel = suite_credentials(settings)
    assert server is not None and channel is not None
    assert suite_credentials(argparse.Namespace(tls_cert="")) == (None, None)


def test_role_interceptor_admits_allowed_roles_only(tmp_path, start_service):
    ca = LocalCA()
    server_files = ca.write(tmp_path, "kvstore", "kv")
    callers = {name: ca.write(tmp_path, role, name) for name, role in (("w0", "worker"), ("r", "router"), ("c", "client"))}

    async def who(request, context):
        peer = current_peer()
        return f"{peer.role}/{peer.id}".encode()

    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "WorkerOnly": grpc.unary_unary_rpc_method_handler(who),
        "Unlisted": grpc.unary_unary_rpc_method_handler(who),
    })
    binding = ServiceBinding(lambda _s, server: server.add_generic_rpc_handlers((handler,)), None, SERVICE)
    creds, _ = suite_credentials(argparse.Namespace(tls_cert=server_files.cert, tls_key=server_files.key, tls_ca=server_files.ca))

    async def start():
        server = GrpcServer([binding], port=0, grace_s=0, server_credentials=creds,
                            interceptors=[PeerRoleInterceptor({"WorkerOnly": frozenset({"worker"})})])
        await server.start()
        await server.set_serving()
        return server, None

    svc = start_service(start, load_channel_credentials(callers["w0"].ca, callers["w0"].cert, callers["w0"].key))
    assert svc.channel.unary_unary(f"/{SERVICE}/WorkerOnly")(b"", timeout=5) == b"worker/w0"
    with pytest.raises(grpc.RpcError) as err:  # a method nobody was allowed: closed to everyone
        svc.channel.unary_unary(f"/{SERVICE}/Unlisted")(b"", timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    for name in ("r", "c"):
        f = callers[name]
        with grpc.secure_channel(svc.address, load_channel_credentials(f.ca, f.cert, f.key)) as channel:
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(f"/{SERVICE}/WorkerOnly")(b"", timeout=5)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_tandem_certs_writes_once(tmp_path):
    from services.certs_command import run

    out = tmp_path / "certs"
    args = argparse.Namespace(out=str(out), workers=2, hosts="kvstore,router", force=False, days=1)
    assert run(args) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["ca.crt", "kvstore-kvstore.crt", "kvstore-kvstore.key", "router-router.crt", "router-router.key",
                            "worker-worker0.crt", "worker-worker0.key", "worker-worker1.crt", "worker-worker1.key"])
    ca = (out / "ca.crt").read_bytes()
    assert run(args) == 0 and (out / "ca.crt").read_bytes() == ca  # kept: running services stay valid
    assert run(argparse.Namespace(**{**vars(args), "force": True})) == 0 and (out / "ca.crt").read_bytes() != ca
