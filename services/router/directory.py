"""The router's view of the workers: a registry snapshot, requests in flight, recent failures.

* The registry (address, model, block size, pool size, ...) comes from kvstore ``ListWorkers`` and
  is reused for ``ttl_s``; a Match that names a worker or incarnation the snapshot lacks makes it
  stale at once (a worker registered or restarted).
* In-flight counts are this router's own: requests it reserved on a worker and has not finished.
* A worker that failed (unreachable, UNAVAILABLE) is avoided by new requests for ``cooldown_s``.

Plain synchronous state; the clock is injected. Every method says whether it mutates.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerEntry:
    """One registered worker incarnation as the kvstore describes it."""

    worker_id: str
    incarnation: int
    address: str
    model_id: str
    spec_mode: int  # tandem.common.v1.SpecMode value
    span: int
    block_size: int
    num_blocks: int
    used_blocks: int
    vocab_size: int
    max_seq_len: int


class WorkerDirectory:
    """Registry snapshot + in-flight counts + failure cooldowns (see the module docstring)."""

    def __init__(self, *, ttl_s: float, cooldown_s: float, clock: Callable[[], float] = time.monotonic):
        self._ttl_s = ttl_s
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._entries: dict[str, WorkerEntry] = {}
        self._fetched_at: float | None = None
        self._in_flight: dict[str, int] = {}
        self._failed_until: dict[str, float] = {}
        # Set by the router's model binding: False for a worker incarnation serving another model.
        self.compatible: Callable[[str, int], bool] = lambda worker_id, incarnation: True

    # ---------------------------------------------------------------------------------- registry
    def replace(self, entries: Iterable[WorkerEntry]) -> None:
        """Install a fresh ListWorkers answer (mutates)."""
        self._entries = {e.worker_id: e for e in entries}
        self._fetched_at = self._clock()

    def invalidate(self) -> None:
        """Make the next :meth:`is_fresh_for` false (mutates)."""
        self._fetched_at = None

    def is_fresh_for(self, workers: Iterable[tuple[str, int]]) -> bool:
        """True if the snapshot is younger than ``ttl_s`` and knows every (worker, incarnation)
        pair given (read-only)."""
        if self._fetched_at is None or self._clock() - self._fetched_at > self._ttl_s:
            return False
        for worker_id, incarnation in workers:
            entry = self._entries.get(worker_id)
            if entry is None or entry.incarnation != incarnation:
                return False
        return True

    def get(self, worker_id: str) -> WorkerEntry | None:
        """The snapshot's entry for ``worker_id`` (read-only)."""
        return self._entries.get(worker_id)

    def entries(self) -> list[WorkerEntry]:
        """Every worker of the snapshot, by worker id (read-only)."""
        return [self._entries[k] for k in sorted(self._entries)]

    # --------------------------------------------------------------------------------- in flight
    def begin(self, worker_id: str) -> None:
        """Count one more request on ``worker_id`` (mutates)."""
        self._in_flight[worker_id] = self._in_flight.get(worker_id, 0) + 1

    def end(self, worker_id: str) -> None:
        """Count one request fewer on ``worker_id`` (mutates); never below zero."""
        left = self._in_flight.get(worker_id, 0) - 1
        if left > 0:
            self._in_flight[worker_id] = left
        else:
            self._in_flight.pop(worker_id, None)

    def in_flight(self, worker_id: str) -> int:
        """Requests this router has running on ``worker_id`` (read-only)."""
        return self._in_flight.get(worker_id, 0)

    # ---------------------------------------------------------------------------------- failures
    def mark_failed(self, worker_id: str) -> None:
        """Avoid ``worker_id`` for new requests during the cooldown (mutates)."""
        if self._cooldown_s > 0:
            self._failed_until[worker_id] = self._clock() + self._cooldown_s

    def is_healthy(self, worker_id: str) -> bool:
        """False while ``worker_id`` is cooling down after a failure (forgets expired marks), or
        when its current incarnation serves another model."""
        entry = self._entries.get(worker_id)
        if entry is not None and not self.compatible(worker_id, entry.incarnation):
            return False
        until = self._failed_until.get(worker_id)
        if until is None:
            return True
        if self._clock() >= until:
            del self._failed_until[worker_id]
            return True
        return False
