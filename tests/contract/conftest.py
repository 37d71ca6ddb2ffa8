"""The deployment under test: the stack compose started (``TANDEM_CONTRACT_ROUTER``,
``TANDEM_CONTRACT_HTTP`` and ``TANDEM_CONTRACT_PROMETHEUS`` set by ``scripts/compose-smoke.sh``), or else an in-process suite
(kvstore + one tiny CPU worker + router, metrics on) so that the same tests run in every CI run."""

from __future__ import annotations

import os
import urllib.request
from dataclasses import dataclass
from typing import Callable

import pytest


@dataclass
class Deployment:
    router: str
    # service name -> the text of its /metrics, as the deployment's scraper sees it
    scrape: Callable[[], dict[str, str]]
    http: str = ""  # base URL of the router's OpenAI-compatible API (".../v1")


def _prometheus_scrape(base: str) -> Callable[[], dict[str, str]]:
    """Every target's health from Prometheus' API: what compose's Prometheus actually scrapes."""
    import json

    def scrape() -> dict[str, str]:
        with urllib.request.urlopen(f"{base}/api/v1/targets", timeout=5) as r:
            targets = json.load(r)["data"]["activeTargets"]
        return {t["labels"]["service"]: t["health"] for t in targets}

    return scrape


def _wait_serving(address: str, timeout_s: float = 60) -> None:
    """Every test may run first (xdist spreads them), so each waits for the router to be ready."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < end, f"router {address} never SERVING"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def deployment(request) -> Deployment:
    router = os.environ.get("TANDEM_CONTRACT_ROUTER")
    if router:
        found = Deployment(router, _prometheus_scrape(os.environ["TANDEM_CONTRACT_PROMETHEUS"]),
                           os.environ["TANDEM_CONTRACT_HTTP"])
    else:
        found = request.getfixturevalue("module_services")()
    _wait_serving(found.router)
    return found


@pytest.fixture(scope="module")
def module_services(service_loop):
    """Start the in-process suite once per module; stop it after."""
    from services.common.metrics import ServiceMetrics
    from services.gpuworker.server import start_worker
    from services.gpuworker.settings import WorkerSettings
    from services.kvstore.server import start_kvstore
    from services.kvstore.settings import KVStoreSettings
    from services.router.server import start_router
    from services.router.settings import RouterSettings

    servers = []
    m = {name: ServiceMetrics(name) for name in ("kvstore", "worker", "router")}

    def start() -> Deployment:
        kv, _ = service_loop.run(start_kvstore(KVStoreSettings(port=0, grace_s=0, metrics_port=0), metrics=m["kvstore"]))
        servers.append(kv)
        worker, _, _ = service_loop.run(start_worker(WorkerSettings(port=0, kvstore=kv.address, num_blocks=256, grace_s=0,
                                                                    metrics_port=0), metrics=m["worker"]), timeout=60)
        servers.append(worker)
        router, parts = service_loop.run(start_router(RouterSettings(port=0, kvstore=kv.address, grace_s=0, metrics_port=0,
                                                                     registry_ttl_s=0, http_port=0), metrics=m["router"]))
        servers.append(router)

        def scrape() -> dict[str, str]:
            health = {}
            for name, metrics in m.items():
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=5) as r:
                    health[name] = "up" if r.status == 200 and b"tandem_rpc_duration_seconds" in r.read() else "down"
            return health

        return Deployment(router.address, scrape, parts.http_url + "/v1")

    yield start
    for server in reversed(servers):
        service_loop.run(server.stop(0))
