"""The router's retry rules: the bounded wait queue, capacity-retry backoff, and what a worker
failure means for a request. Pure: no network, no clock, no sleeping.

One request moves through these states (the dispatcher drives it)::

    ┌──────────────── RESOURCE_EXHAUSTED on every ranked worker ─────────────────┐
    ▼                                                                            │
  PLAN (Match → rank) ──▶ RESERVE (first choice, then the next ...) ─────────────┤
    ▲                         │ reserved                                         │ queue full
    │                         ▼                                                  ▼ or no time left
    │                     STREAM from the worker ──▶ done                RESOURCE_EXHAUSTED
    │                         │ fails
    │                         ▼
    └── retryable, before the first token, attempts left   (else: an error to the client;
                                                            after tokens: UNAVAILABLE)

Each attempt reserves under its own kvstore request id (``id``, ``id~1``, ``id~2`` ...): the
kvstore keeps a request id on one worker, and a failed attempt's reservation may still be live
(its worker ends it) while the next attempt reserves elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from services.common.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TandemError,
    Unauthenticated,
    Unavailable,
)

_ERRORS: dict[str, type[TandemError]] = {
    cls.code.value: cls
    for cls in (
        InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted, Unavailable,
        DeadlineExceeded, Unauthenticated, PermissionDenied, Cancelled,
    )
}

# Worker answers that say "this worker, not this request, could not do it" — before the first
# token another worker may well succeed.
_RETRY_ELSEWHERE = frozenset({"UNAVAILABLE", "UNKNOWN", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"})
# ... and of those, the ones that say the worker itself is broken (avoid it for a while).
_WORKER_BROKEN = frozenset({"UNAVAILABLE", "UNKNOWN"})


class UpstreamInternal(Exception):
    """A peer answered INTERNAL (or a code Tandem does not map): the client sees a bare INTERNAL."""


def error_for(code_name: str, message: str) -> Exception:
    """The exception that makes the router answer ``code_name`` with ``message`` (pure)."""
    cls = _ERRORS.get(code_name)
    return cls(message) if cls is not None else UpstreamInternal(f"{code_name}: {message}")


class WaitQueue:
    """Counts requests waiting for capacity; at most ``capacity`` at once."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise InvalidArgument(f"queue capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.waiting = 0

    def enter(self) -> None:
        """Take a place (mutates); ResourceExhausted when all ``capacity`` places are taken."""
        if self.waiting >= self.capacity:
            raise ResourceExhausted(
                f"no worker has capacity now and the wait queue is full ({self.capacity} waiting)"
            )
        self.waiting += 1

    def leave(self) -> None:
        """Give the place back (mutates)."""
        if self.waiting <= 0:
            raise FailedPrecondition("leave() without enter()")
        self.waiting -= 1


def backoff_delays(first_s: float, max_s: float) -> Iterator[float]:
    """first_s, 2·first_s, 4·first_s, ... capped at max_s, forever (pure generator)."""
    delay = first_s
    while True:
        yield min(delay, max_s)
        delay = min(delay * 2, max_s)


@dataclass
class AttemptState:
    """Attempts of one request: which workers failed, which attempt this is. Mutable."""

    request_id: str
    max_attempts: int
    attempt: int = 0
    excluded: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)
    failed_incarnation: dict[str, int] = field(default_factory=dict)  # worker id -> the one that failed

    def excluded_now(self, incarnations: dict[str, int]) -> set[str]:
        """The excluded workers still at the incarnation that failed (read-only): one that
        re-registered since (a kvstore restart) is a new candidate."""
        return {w for w in self.excluded
                if w not in self.failed_incarnation or incarnations.get(w) == self.failed_incarnation[w]}

    def reservation_request_id(self) -> str:
        """The kvstore/worker request id of the current attempt (read-only)."""
        return self.request_id if self.attempt == 0 else f"{self.request_id}~{self.attempt}"

    def worker_failed(self, worker_id: str, code_name: str, message: str, *, streamed_tokens: int,
                      incarnation: int | None = None) -> None:
        """Record that ``worker_id`` failed with ``code_name`` (mutates) and decide.

        Returns when another worker should be tried (excluding this one); otherwise raises the error
        for the client: after tokens were streamed, UNAVAILABLE saying so (a retry would repeat
        text the client already has); before, the worker's own code unless it is a retryable one
        and attempts are left (then UNAVAILABLE naming every failure).
        """
        self.failures.append(f"{worker_id}: {code_name} {message}".strip())
        if code_name in ("CANCELLED", "DEADLINE_EXCEEDED"):
            raise error_for(code_name, f"worker {worker_id}: {message}")
        if streamed_tokens:
            raise Unavailable(
                f"worker {worker_id} failed after {streamed_tokens} tokens were streamed "
                f"({code_name}: {message}); the request was not retried"
            )
        if code_name not in _RETRY_ELSEWHERE:
            raise error_for(code_name, f"worker {worker_id}: {message}")
        self.excluded.add(worker_id)
        if incarnation is not None:
            self.failed_incarnation[worker_id] = incarnation
        self.attempt += 1
        if self.attempt >= self.max_attempts:
            raise Unavailable(
                f"{self.attempt} attempt(s) failed before the first token: " + "; ".join(self.failures)
            )

    @staticmethod
    def worker_is_broken(code_name: str) -> bool:
        """Whether a failure with ``code_name`` says the worker itself is unhealthy (pure)."""
        return code_name in _WORKER_BROKEN

    def no_worker_left(self) -> Unavailable:
        """The error when every compatible worker is excluded or cooling down (pure)."""
        detail = "; ".join(self.failures) if self.failures else "every worker is cooling down after failures"
        return Unavailable(f"no healthy worker left for this request ({detail})")

