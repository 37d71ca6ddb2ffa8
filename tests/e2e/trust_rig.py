"""The suite with mTLS on every hop, for the trust-boundary tests (issue 8): a throwaway CA,
certificates for the services and for the test's own callers, and stubs that call as any of them.

    identities: kvstore/kvstore  worker/w0  worker/evil  router/router  router/router2  client/alice
    callers:    rig.kv_as("evil") -> KVStoreStub over mTLS with evil's certificate
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from services.common.auth import load_channel_credentials
from services.common.certs import LocalCA
from tandem.kvstore.v1 import kvstore_pb2 as kv_pb
from tandem.kvstore.v1 import kvstore_pb2_grpc
from tandem.router.v1 import router_pb2, router_pb2_grpc
from tandem.worker.v1 import worker_pb2_grpc

TIMEOUT = 30.0
ROOT = Path(__file__).resolve().parents[2]
IDENTITIES = {
    "kvstore": ("kvstore", "kvstore"),
    "w0": ("worker", "w0"),
    "w1": ("worker", "w1"),
    "evil": ("worker", "evil"),
    "router": ("router", "router"),
    "router2": ("router", "router2"),
    "alice": ("client", "alice"),
}


def make_pki(directory) -> dict[str, Any]:
    """CertFiles per name of ``IDENTITIES``, all signed by one fresh CA (plus ``foreign``: a
    worker certificate from another CA)."""
    ca = LocalCA(days=1)
    files = {name: ca.write(directory, role, ident) for name, (role, ident) in IDENTITIES.items()}
    files["foreign"] = LocalCA(days=1).write(directory / "foreign", "worker", "w0")
    return files


def tls(files) -> dict[str, str]:
    """Settings fields that give a service ``files`` as its mTLS identity."""
    return {"tls_cert": files.cert, "tls_key": files.key, "tls_ca": files.ca}


def credentials(files) -> grpc.ChannelCredentials:
    return load_channel_credentials(files.ca, files.cert, files.key)


@dataclass
class TrustRig:
    pki: dict
    start_service: Any
    kv: Any = None
    workers: dict = field(default_factory=dict)
    router: Any = None
    _channels: list = field(default_factory=list)

    def start_kvstore(self, **overrides) -> Any:
        from services.kvstore.server import start_kvstore
        from services.kvstore.settings import KVStoreSettings

        settings = KVStoreSettings(**{"host": "127.0.0.1", "port": 0, "grace_s": 0.0, "lease_ttl_s": 1.5,
                                      **tls(self.pki["kvstore"]), **overrides})
        self.kv = self.start_service(lambda: start_kvstore(settings), credentials(self.pki["router"]))
        return self.kv

    def start_worker(self, name: str = "w0", **overrides) -> Any:
        from services.gpuworker.server import start_worker
        from services.gpuworker.settings import WorkerSettings

        settings = WorkerSettings(**{
            "host": "127.0.0.1", "port": 0, "kvstore": self.kv.address, "worker_id": name, "model": "tiny",
            "spec_mode": "eagle3", "num_blocks": 256, "heartbeat_s": 0.2, "grace_s": 0.0, **tls(self.pki[name]), **overrides,
        })

        async def start():
            server, runner, identity = await start_worker(settings)
            return server, (runner, identity)

        self.workers[name] = self.start_service(start, credentials(self.pki["router"]))
        return self.workers[name]

    def start_router(self, **overrides) -> Any:
        from services.router.server import start_router
        from services.router.settings import RouterSettings

        settings = RouterSettings(**{
            "host": "127.0.0.1", "port": 0, "kvstore": self.kv.address, "grace_s": 0.0, "registry_ttl_s": 0.0,
            "policy_seed": 7, "model": "tiny", "salt_secret": "trust-rig-salt-secret", **tls(self.pki["router"]), **overrides,
        })
        self.router = self.start_service(lambda: start_router(settings))
        self.router.loop.run(self.router.payload.ready.wait(), timeout=TIMEOUT)
        self.router.stub = router_pb2_grpc.RouterStub(self.router.channel)
        return self.router

    # -- callers -----------------------------------------------------------------------------
    def channel(self, address: str, name: str | None) -> grpc.Channel:
        """A channel to ``address`` presenting ``name``'s certificate (None: plaintext)."""
        channel = grpc.secure_channel(address, credentials(self.pki[name])) if name else grpc.insecure_channel(address)
        self._channels.append(channel)
        return channel

    def kv_as(self, name: str | None) -> kvstore_pb2_grpc.KVStoreStub:
        return kvstore_pb2_grpc.KVStoreStub(self.channel(self.kv.address, name))

    def worker_as(self, name: str | None, worker: str = "w0") -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self.channel(self.workers[worker].address, name))

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    # -- kvstore views (as the router, which may read Stats) ------------------------------------
    def stats(self) -> kv_pb.StatsResponse:
        return self.kv_as("router").Stats(kv_pb.StatsRequest(), timeout=TIMEOUT)

    def invariants(self) -> kv_pb.CheckInvariantsResponse:
        return self.kv_as("router").CheckInvariants(kv_pb.CheckInvariantsRequest(), timeout=TIMEOUT)

    def incarnation(self, worker_id: str = "w0") -> int:
        workers = self.kv_as("router").ListWorkers(kv_pb.ListWorkersRequest(), timeout=TIMEOUT).workers
        return next(w.incarnation for w in workers if w.worker_id == worker_id)

    def wait_settled(self, timeout_s: float = 15.0) -> kv_pb.StatsResponse:
        """Until no reservation is live or ending and no block is in use (workers end theirs
        asynchronously); returns the last Stats."""
        end = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            busy = stats.live_reservations or stats.ending_reservations or any(w.pool.in_use for w in stats.workers)
            if not busy or time.monotonic() > end:
                return stats
            time.sleep(0.05)

    def generate(self, text: str, *, token: str | None = None, timeout: float = TIMEOUT, **fields):
        """One router Generate to the end: (token ids, usage). Greedy unless ``fields`` say otherwise."""
        fields.setdefault("temperature", 0.0)
        metadata = [("authorization", f"Bearer {token}")] if token else None
        ids, usage = [], None
        for msg in self.router.stub.Generate(router_pb2.GenerateRequest(text=text, **fields), timeout=timeout, metadata=metadata):
            ids.extend(msg.token_ids)
            if msg.HasField("usage"):
                usage = msg.usage
        return ids, usage


def spawn_worker(rig: TrustRig, name: str) -> subprocess.Popen:
    """A worker process (tiny model) with ``name``'s certificate, so a test can SIGSTOP/SIGKILL it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           **{f"TANDEM_WORKER_{k.upper()}": v for k, v in tls(rig.pki[name]).items()}}
    argv = [sys.executable, "-m", "services.cli", "worker", "--kvstore", rig.kv.address, "--port", "0", "--worker-id", name,
            "--heartbeat-s", "0.2", "--num-blocks", "256", "--model", "tiny", "--spec-mode", "eagle3"]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_workers(rig: TrustRig, names: set[str], timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while True:
        listed = {w.worker_id for w in rig.kv_as("router").ListWorkers(kv_pb.ListWorkersRequest(), timeout=5).workers}
        if names <= listed:
            return
        assert time.monotonic() < end, f"workers {names - listed} never registered"
        time.sleep(0.1)


def code_of(call, *args, **kwargs) -> grpc.StatusCode:
    """The status of a unary call (or of draining a stream)."""
    try:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__") and not hasattr(result, "SerializeToString"):
            for _ in result:
                pass
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK
