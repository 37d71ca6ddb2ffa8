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
    """Everything observable about a store's state (read-only): stats, each worker's free queue,
    eviction order and info, live reservations, trie size and event sequence numbers."""
    workers = store._workers
    return (
        store.stats(),
        [(w.spec, w.incarnation, w.lease_deadline) for w in workers.values()],
        {wid: (w.pool.free_ids(), w.pool.eviction_order()) for wid, w in workers.items()},
        sorted((rid, r.snapshot()) for rid, r in store._reservations.items()),
        {wid: store._events.last_seq(wid) for wid in workers},
        store.tick,
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock) -> KVStore:
    return KVStore(clock=clock, lease_ttl_s=10.0, epoch=0)


@pytest.fixture
def make_spec():
    """``make_spec(worker_id="w0", **overrides) -> WorkerSpec`` with small defaults."""
    return _make_spec


@pytest.fixture
def fingerprint():
    """``fingerprint(store) -> tuple``: compare before/after a call that must change nothing."""
    return _fingerprint
