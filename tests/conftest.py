"""Shared fixtures: real gRPC services on 127.0.0.1 (port 0) driven by plain synchronous clients.

The servers are ``grpc.aio`` servers; they run on one asyncio event loop in a daemon thread for
the whole test session (one loop per process: grpc.aio dislikes hopping between loops). Tests talk
to them with ordinary blocking stubs from the test thread, so no pytest-asyncio is needed::

    test thread                          "service-loop" thread
    -----------                          ---------------------
    stub.Match(req, timeout=5) ──gRPC──▶ grpc.aio server ──▶ servicer ──▶ core (KVStore)
    svc.in_loop(store.stats)  ─────────▶ runs the callable on the loop (no race with handlers)

Reusable pieces for later router / worker tests:

* ``service_loop``          session fixture, a :class:`LoopThread`;
* ``start_service``         factory fixture: ``start_service(start_coro_fn) -> RunningService``
                            (``start_coro_fn()`` returns ``(GrpcServer, payload)``); every service
                            started is stopped at teardown;
* ``start_kvstore_service`` factory fixture: a kvstore with settings overrides;
* ``kvstore_service``       a fresh kvstore per test (default settings).

Every client call made by a test must carry a deadline (``timeout=``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

# grpc.aio is imported lazily inside fixtures so collecting non-gRPC tests stays cheap.

STARTUP_TIMEOUT_S = 10.0


class LoopThread:
    """An asyncio event loop running forever in a daemon thread (one per test session)."""

    def __init__(self, name: str = "service-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Awaitable[Any], timeout: float = STARTUP_TIMEOUT_S) -> Any:
        """Run ``coro`` on the loop and wait for its result (re-raises its exception)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = STARTUP_TIMEOUT_S, **kwargs: Any) -> Any:
        """Call a plain function on the loop thread, serialized with every RPC handler there."""

        async def invoke():
            return fn(*args, **kwargs)

        return self.run(invoke(), timeout)

    def close(self) -> None:
        # Cancel what is left (e.g. lease reapers of services a test forgot), then stop the loop.
        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(cancel_all())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(STARTUP_TIMEOUT_S)


@dataclass
class RunningService:
    """A started gRPC service: its server, address, whatever its starter returned, and a channel."""

    server: Any  # services.common.server.GrpcServer
    payload: Any  # e.g. the KVStore core
    loop: LoopThread
    channel: grpc.Channel
    stopped: bool = field(default=False)
    stop_timeout_s: float = STARTUP_TIMEOUT_S  # longer for services that run child processes

    @property
    def address(self) -> str:
        return self.server.address

    def in_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the service's event loop (safe w.r.t. running handlers)."""
        return self.loop.call(fn, *args, **kwargs)

    def stop(self, grace_s: float = 0.0) -> None:
        """Drain and stop the server (idempotent). Mutates: the server stops serving."""
        if not self.stopped:
            self.stopped = True
            self.loop.run(self.server.stop(grace_s), timeout=grace_s + self.stop_timeout_s)

    def new_channel(self, **options: Any) -> grpc.Channel:
        """Another channel to the service (caller closes it); ``options`` become channel args."""
        return grpc.insecure_channel(self.address, options=list(options.items()))


@pytest.fixture(scope="session")
def service_loop():
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture
def start_service(service_loop):
    """Factory: ``start_service(start)`` where ``start()`` is a coroutine returning
    ``(GrpcServer, payload)``; waits until it answers and stops it at teardown."""
    started: list[RunningService] = []

    def _start(start: Callable[[], Awaitable[tuple[Any, Any]]], credentials: Any = None,
               timeout: float = STARTUP_TIMEOUT_S) -> RunningService:
        """``credentials``: channel credentials for a service that serves (m)TLS; ``timeout``: for
        starters that spawn processes (an engine process imports torch and builds its model)."""
        server, payload = service_loop.run(start(), timeout=timeout)
        channel = grpc.secure_channel(server.address, credentials) if credentials else grpc.insecure_channel(server.address)
        grpc.channel_ready_future(channel).result(timeout=STARTUP_TIMEOUT_S)
        svc = RunningService(server=server, payload=payload, loop=service_loop, channel=channel,
                             stop_timeout_s=max(STARTUP_TIMEOUT_S, timeout))
        started.append(svc)
        return svc

    yield _start
    for svc in started:
        svc.stop()  # before closing the channel: closing a channel to a live server takes 0.2 s
        svc.channel.close()


@pytest.fixture
def start_kvstore(start_service):
    """Factory: ``start_kvstore(servicer_cls=KVStoreServicer)`` serves a fresh in-memory KVStore
    (a long lease) through ``servicer_cls`` — a subclass that injects faults, say — and returns
    the running service with ``.stub`` set; ``.payload`` is the store."""

    def _start(servicer_cls=None, *, lease_ttl_s: float = 120.0) -> RunningService:
        from services.common.server import GrpcServer, ServiceBinding
        from services.kvstore.servicer import KVStoreServicer
        from services.kvstore.store import KVStore
        from tandem.kvstore.v1 import kvstore_pb2_grpc

        cls = servicer_cls or KVStoreServicer

        async def start():
            store = KVStore(lease_ttl_s=lease_ttl_s)
            server = GrpcServer([ServiceBinding(kvstore_pb2_grpc.add_KVStoreServicer_to_server, cls(store),
                                                "tandem.kvstore.v1.KVStore")], port=0, grace_s=0)
            await server.start()
            await server.set_serving()
            return server, store

        svc = start_service(start)
        svc.stub = kvstore_pb2_grpc.KVStoreStub(svc.channel)
        return svc

    return _start


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server for the session (see ``tests/redis_server.py``)."""
    from tests.redis_server import RedisServer

    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def start_kvstore_service(start_service, request):
    """Factory: ``start_kvstore_service(store=None, **settings_overrides) -> RunningService`` whose
    ``payload`` is the ``KVStore``, with a blocking ``stub`` (``KVStoreStub``) and ``kv``
    (:class:`KVClient`) attached."""
    from services.kvstore.server import start_kvstore
    from services.kvstore.settings import KVStoreSettings
    from tandem.kvstore.v1 import kvstore_pb2_grpc

    leaderships: list = []

    def _start(store=None, **overrides: Any) -> RunningService:
        settings = KVStoreSettings(**{"host": "127.0.0.1", "port": 0, "grace_s": 0.0, **overrides})
        if settings.backend == "redis":
            if store is not None:
                raise ValueError("the redis backend recovers its own store")
            from tests.redis_server import unique_prefix

            if "redis_url" not in overrides:
                settings = settings.model_copy(update=dict(
                    redis_url=request.getfixturevalue("redis_server").url, redis_prefix=unique_prefix()))
            if "redis_lease_ms" not in overrides:  # a loaded CI box must not lose the lease mid-test
                settings = settings.model_copy(update=dict(redis_lease_ms=10_000))

            async def start():
                from services.kvstore.leader import Leadership

                async def serve(s, recovered):
                    return (await start_kvstore(s, store=recovered))[0]

                lead = Leadership(settings, start_server=serve)
                lead.task = asyncio.get_running_loop().create_task(lead.run())
                leaderships.append(lead)
                await asyncio.wait_for(lead.leading.wait(), STARTUP_TIMEOUT_S)
                return lead.server, lead.store

            svc = start_service(start)
            svc.leadership = leaderships[-1]  # type: ignore[attr-defined]
        else:
            svc = start_service(lambda: start_kvstore(settings, store=store))
        svc.stub = kvstore_pb2_grpc.KVStoreStub(svc.channel)  # type: ignore[attr-defined]
        svc.settings = settings  # type: ignore[attr-defined]
        svc.kv = KVClient(svc)  # type: ignore[attr-defined]
        return svc

    yield _start
    for lead in leaderships:
        async def finish(lead=lead):
            lead.stop.set()
            await asyncio.gather(lead.task, return_exceptions=True)

        request.getfixturevalue("service_loop").run(finish())  # leaderships run on the session loop


@pytest.fixture
def kvstore_service(start_kvstore_service) -> RunningService:
    """A fresh kvstore (default settings, port 0) for one test."""
    return start_kvstore_service()


# ------------------------------------------------------------------------------------------------
# kvstore client helper


class KVClient:
    """Blocking kvstore client for tests: the generated stub, a deadline on every call, and
    request builders with small defaults (block size 4, EAGLE-3, vocab 1,000).

    Methods that send mutating RPCs say so; ``snapshot()`` reads Stats + CheckInvariants, which
    change nothing, so two snapshots around a rejected call must be equal.
    """

    def __init__(self, svc: RunningService, timeout: float = 5.0):
        from tandem.common.v1 import common_pb2
        from tandem.kvstore.v1 import kvstore_pb2

        self.svc = svc
        self.stub = svc.stub  # type: ignore[attr-defined]
        self.pb = kvstore_pb2
        self.common = common_pb2
        self.timeout = timeout

    # -- builders ---------------------------------------------------------------------------
    def tokens(self, ids) -> Any:
        """Packed ``TokenIds`` (the form Tandem's own services send)."""
        from services.common.wire import tokens_to_proto

        return tokens_to_proto(list(ids))

    def register_request(self, worker_id: str = "w0", **fields: Any) -> Any:
        from tandem.common.v1 import common_pb2

        defaults = dict(
            address="127.0.0.1:1",
            model_id="m",
            spec_mode=common_pb2.SPEC_MODE_EAGLE3,
            block_size=4,
            num_blocks=64,
            vocab_size=1000,
            max_seq_len=1024,
        )
        return self.pb.RegisterWorkerRequest(worker_id=worker_id, **{**defaults, **fields})

    # -- calls ------------------------------------------------------------------------------
    def register(self, worker_id: str = "w0", **fields: Any) -> Any:
        """RegisterWorker (mutates); returns the ``WorkerInfo``."""
        req = self.register_request(worker_id, **fields)
        return self.stub.RegisterWorker(req, timeout=self.timeout).worker

    def match(self, ids, **fields: Any) -> dict[str, Any]:
        """Match (read-only apart from the counter); ``{worker_id: WorkerMatch}``."""
        resp = self.stub.Match(self.pb.MatchRequest(tokens=self.tokens(ids), **fields), timeout=self.timeout)
        return {m.worker_id: m for m in resp.workers}

    def reserve(self, worker, request_id: str, ids, **fields: Any) -> Any:
        """Reserve on ``worker`` (a WorkerInfo) (mutates); returns the ``Reservation``."""
        req = self.pb.ReserveRequest(
            worker_id=worker.worker_id,
            incarnation=worker.incarnation,
            request_id=request_id,
            tokens=self.tokens(ids),
            **fields,
        )
        return self.stub.Reserve(req, timeout=self.timeout).reservation

    def publish(self, r, final_positions: int, new_ids=()) -> Any:
        """Publish (mutates); returns the ``PublishResponse``."""
        req = self.pb.PublishRequest(
            reservation_id=r.reservation_id,
            incarnation=r.incarnation,
            new_tokens=self.tokens(new_ids),
            final_positions=final_positions,
        )
        return self.stub.Publish(req, timeout=self.timeout)

    def release(self, r, final_positions: int = 0, new_ids=(), *, verb: str = "Release") -> Any:
        """Release or Suspend (mutates); returns the ``ReleaseResponse``."""
        req = self.pb.ReleaseRequest(
            reservation_id=r.reservation_id,
            incarnation=r.incarnation,
            new_tokens=self.tokens(new_ids),
            final_positions=final_positions,
        )
        return getattr(self.stub, verb)(req, timeout=self.timeout)

    def abort(self, r) -> bool:
        """Abort (mutates); returns ``aborted``."""
        req = self.pb.AbortRequest(reservation_id=r.reservation_id, incarnation=r.incarnation, worker_id=getattr(r, "worker_id", ""))
        return self.stub.Abort(req, timeout=self.timeout).aborted

    def capacity(self, verb: str, *items: tuple[Any, int]) -> list[Any]:
        """Extend or Trim with ``(reservation, capacity_positions)`` items (mutates)."""
        req = getattr(self.pb, f"{verb}Request")(
            items=[
                self.pb.CapacityItem(reservation_id=r.reservation_id, incarnation=r.incarnation, capacity_positions=c)
                for r, c in items
            ]
        )
        return list(getattr(self.stub, verb)(req, timeout=self.timeout).results)

    def stats(self, worker_id: str = "") -> Any:
        return self.stub.Stats(self.pb.StatsRequest(worker_id=worker_id), timeout=self.timeout)

    def invariants(self) -> Any:
        return self.stub.CheckInvariants(self.pb.CheckInvariantsRequest(), timeout=self.timeout)

    def snapshot(self) -> tuple[Any, Any]:
        """(Stats, CheckInvariants) — both read-only; the audit must be clean."""
        inv = self.invariants()
        assert inv.ok, list(inv.violations)
        return self.stats(), inv

    def expect_error(self, code: grpc.StatusCode, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> grpc.RpcError:
        """Call ``fn`` and require it to fail with ``code`` and leave Stats and invariants unchanged."""
        before = self.snapshot()
        with pytest.raises(grpc.RpcError) as info:
            fn(*args, **kwargs)
        assert info.value.code() == code, (info.value.code(), info.value.details())
        assert self.snapshot() == before, "a rejected call changed the store"
        return info.value


@pytest.fixture
def kv(kvstore_service) -> KVClient:
    """A :class:`KVClient` on a fresh kvstore (default settings)."""
    return kvstore_service.kv
