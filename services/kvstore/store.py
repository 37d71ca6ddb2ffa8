"""The kvstore facade: every transaction verb of DESIGN §2 over per-worker pools and one trie.

(API skeleton: bodies follow.)
"""

from __future__ import annotations

import time
from typing import Callable

from .types import (
    Event,
    ExtendItem,
    ItemResult,
    MatchResult,
    PublishResult,
    ReleaseResult,
    Reservation,
    StoreStats,
    TrimItem,
    WorkerInfo,
    WorkerSpec,
)


class KVStore:
    """Synchronous, single-threaded kvstore core; the servicer serializes calls."""

    def __init__(
        self,
        *,
        lease_ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        max_tokens: int = 1 << 20,
        tombstones: int = 65536,
        events_per_worker: int = 4096,
    ):
        raise NotImplementedError

    def register_worker(self, spec: WorkerSpec) -> WorkerInfo:
        raise NotImplementedError

    def list_workers(self) -> list[WorkerInfo]:
        raise NotImplementedError

    def heartbeat(self, worker_id: str, incarnation: int) -> float:
        raise NotImplementedError

    def expire_leases(self) -> list[str]:
        raise NotImplementedError

    def match(self, tokens, *, cache_salt: bytes = b"", model_id: str | None = None) -> list[MatchResult]:
        raise NotImplementedError

    def reserve(self, *, worker_id: str, incarnation: int, request_id: str, tokens, cache_salt: bytes = b"",
                headroom_positions: int = 0) -> Reservation:
        raise NotImplementedError

    def get_reservation(self, reservation_id: str) -> Reservation:
        raise NotImplementedError

    def extend(self, items: list[ExtendItem]) -> list[ItemResult]:
        raise NotImplementedError

    def trim(self, items: list[TrimItem]) -> list[ItemResult]:
        raise NotImplementedError

    def publish(self, *, reservation_id: str, incarnation: int, new_tokens=(), final_positions: int) -> PublishResult:
        raise NotImplementedError

    def release(self, *, reservation_id: str, incarnation: int, new_tokens=(),
                final_positions: int | None = None) -> ReleaseResult:
        raise NotImplementedError

    def suspend(self, *, reservation_id: str, incarnation: int, new_tokens=(),
                final_positions: int | None = None) -> ReleaseResult:
        raise NotImplementedError

    def abort(self, *, reservation_id: str, incarnation: int) -> bool:
        raise NotImplementedError

    def stats(self, worker_id: str | None = None) -> StoreStats:
        raise NotImplementedError

    def check_invariants(self) -> list[str]:
        raise NotImplementedError

    def events_since(self, worker_id: str, after_seq: int) -> list[Event]:
        raise NotImplementedError

    def subscribe(self, callback: Callable[[str, Event], None]) -> Callable[[], None]:
        raise NotImplementedError
