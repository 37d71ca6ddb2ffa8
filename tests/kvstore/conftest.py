"""Fixtures for the in-process kvstore core tests: a controllable clock, a store on it, worker
specs with small defaults, and a fingerprint of everything a rejected call must leave unchanged."""

from __future__ import annotations

import pytest

from services.common.spec import SpecMode
from services.kvstore import KVStore, WorkerSpec


class FakeClock:
    """Monotonic seconds that only move when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _make_spec(worker_id: str = "w0", **fields) -> WorkerSpec:
    """A worker spec with small defaults: block size 4, 8 blocks, no draft (D = 0)."""
    defaults = dict(
        address="127.0.0.1:1",
        model_id="m",
        spec_mode=SpecMode.NONE,
        mtp_depth=0,
        block_size=4,
        num_blocks=8,
        vocab_size=100,
        max_seq_len=64,
    )
    return WorkerSpec(worker_id=worker_id, **{**defaults, **fields})


def _fingerprint(store: KVStore) -> tuple:
    """Everything observable about a store's state (read-only, through ``store.view()``): stats,
    each worker's lease, free queue, eviction order, pins and runs, live reservations, event
    sequence numbers and the logical clock."""
    view = store.view()
    return (
        store.stats(),
        [(w.spec, w.incarnation) for w in store.list_workers()],
        {
            wid: (view.lease_deadline(wid), view.free_ids(wid), view.eviction_order(wid), view.pins(wid), view.runs(wid))
            for wid in view.worker_ids()
        },
        view.reservations(),
        {wid: view.last_seq(wid) for wid in view.worker_ids()},
        view.tick(),
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock) -> KVStore:
    return KVStore(clock=clock, lease_ttl_s=10.0, epoch=0, events_per_worker=64)


@pytest.fixture
def make_spec():
    """``make_spec(worker_id="w0", **overrides) -> WorkerSpec`` with small defaults."""
    return _make_spec


@pytest.fixture
def fingerprint():
    """``fingerprint(store) -> tuple``: compare before/after a call that must change nothing."""
    return _fingerprint


@pytest.fixture(params=["memory", "redis"])
def kvstore_service(start_kvstore_service, request):
    """A fresh kvstore on port 0 with block events on (they are opt-in; WatchEvents is tested),
    on each backend: every gRPC contract test of the kvstore runs against memory and Redis."""
    return start_kvstore_service(events_per_worker=256, backend=request.param)
