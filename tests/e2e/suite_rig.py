"""End-to-end test rig (used by tests/e2e/conftest.py). The real suite on loopback: kvstore + gpuworker(s) (tiny model, torch backend, CPU) + router.

All three run in this process on the session's service loop (each worker's engine on its own
thread), except where a test needs to SIGKILL a worker: ``spawn_worker_process`` starts one as a
child process, exactly as ``tandem up`` does.
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

from services.gpuworker.server import start_worker
from services.gpuworker.settings import WorkerSettings
from services.router.server import start_router
from services.router.settings import RouterSettings
from tandem.kvstore.v1 import kvstore_pb2 as kv_pb
from tandem.router.v1 import router_pb2, router_pb2_grpc

TIMEOUT = 30.0
PROCESS_STARTUP_TIMEOUT = 120.0  # a worker whose engine process imports torch on a loaded 2-core machine
ROOT = Path(__file__).resolve().parents[2]

# A prompt long enough to span several 16-position blocks (byte tokenizer: one token per byte).
LONG_PREFIX = (
    "System: you are a careful assistant that answers in short sentences and never repeats "
    "itself. Context: Tandem pairs every target KV block with a draft KV block. "
)


@dataclass
class Suite:
    kv: Any  # RunningService of the kvstore (payload = KVStore core)
    start_service: Any
    tracer_provider: Any = None
    workers: list = field(default_factory=list)
    router: Any = None
    stub: Any = None

    def add_worker(self, worker_id: str, **overrides) -> Any:
        settings = WorkerSettings(
            **{
                "host": "127.0.0.1",
                "port": 0,
                "kvstore": self.kv.address,
                "worker_id": worker_id,
                "model": "tiny",
                "spec_mode": "eagle3",
                "num_blocks": 512,
                "heartbeat_s": 0.2,
                "grace_s": 0.0,
                **overrides,
            }
        )

        async def start():
            server, runner, identity = await start_worker(settings, tracer_provider=self.tracer_provider)
            return server, (runner, identity)

        svc = self.start_service(start, timeout=PROCESS_STARTUP_TIMEOUT if settings.separate_engine_process else TIMEOUT)
        self.workers.append(svc)
        return svc

    def add_router(self, **overrides) -> Any:
        settings = RouterSettings(
            **{
                "host": "127.0.0.1",
                "port": 0,
                "kvstore": self.kv.address,
                "grace_s": 0.0,
                "registry_ttl_s": 0.0,
                "policy_seed": 7,
                **overrides,
            }
        )
        self.router = self.start_service(lambda: start_router(settings, tracer_provider=self.tracer_provider))
        self.router.loop.run(self.router.payload.ready.wait(), timeout=TIMEOUT)
        self.stub = router_pb2_grpc.RouterStub(self.router.channel)
        return self.router

    # -- client side --------------------------------------------------------------------------

    def generate(self, text: str | None = None, *, token: str | None = None, timeout: float = TIMEOUT, **fields):
        """Run one Generate to the end; return (token ids, text, usage). Greedy unless ``fields``
        name a temperature (the API's unset temperature is OpenAI's 1.0)."""
        fields.setdefault("temperature", 0.0)
        request = router_pb2.GenerateRequest(text=text, **fields) if text is not None else router_pb2.GenerateRequest(**fields)
        metadata = [("authorization", f"Bearer {token}")] if token else None
        ids: list[int] = []
        pieces: list[str] = []
        usage = None
        for msg in self.stub.Generate(request, timeout=timeout, metadata=metadata):
            ids.extend(msg.token_ids)
            pieces.append(msg.text)
            if msg.HasField("usage"):
                usage = msg.usage
        return ids, "".join(pieces), usage

    # -- kvstore side -------------------------------------------------------------------------

    def stats(self) -> kv_pb.StatsResponse:
        return self.kv.stub.Stats(kv_pb.StatsRequest(), timeout=TIMEOUT)

    def invariants(self) -> kv_pb.CheckInvariantsResponse:
        return self.kv.stub.CheckInvariants(kv_pb.CheckInvariantsRequest(), timeout=TIMEOUT)

    def wait_no_live_reservations(self, timeout_s: float = 15.0) -> kv_pb.StatsResponse:
        """Poll until the kvstore holds no live reservation (the worker ends them asynchronously)."""
        end = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if stats.live_reservations == 0 or time.monotonic() > end:
                return stats
            time.sleep(0.05)


def spawn_worker_process(kv_address: str, worker_id: str, **flags) -> subprocess.Popen:
    """A gpuworker in its own process (so a test can SIGKILL it)."""
    argv = [sys.executable, "-m", "services.cli", "worker", "--kvstore", kv_address, "--port", "0",
            "--worker-id", worker_id, "--heartbeat-s", "0.2", "--num-blocks", "512"]
    for key, value in flags.items():
        flag = f"--{key.replace('_', '-')}"
        argv += [flag] if value is True else [flag, str(value)]  # True: a --switch
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_registered(suite, worker_id: str, proc: subprocess.Popen | None = None, timeout_s: float = 60.0) -> None:
    """Until worker ``worker_id`` is in the kvstore's registry (fails if its process ``proc``,
    when given, exits first)."""
    end = time.monotonic() + timeout_s
    while not any(w.worker_id == worker_id for w in suite.kv.stub.ListWorkers(kv_pb.ListWorkersRequest(), timeout=TIMEOUT).workers):
        assert proc is None or proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < end, "worker did not register"
        time.sleep(0.1)


def stream_a_few_tokens(suite, tokens: int = 4):
    """A long request, read until ``tokens`` arrived; the call stays open (cancel it)."""
    call = suite.stub.Generate(router_pb2.GenerateRequest(temperature=0.0, text=LONG_PREFIX, max_new_tokens=1500), timeout=TIMEOUT)
    got = 0
    for msg in call:
        got += len(msg.token_ids)
        if got >= tokens:
            break
    return call


def rpc_code(call) -> grpc.StatusCode:
    try:
        for _ in call:
            pass
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK
