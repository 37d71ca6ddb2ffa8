"""Per-worker block events (stored / removed / cleared) and their subscribers. Opt-in.

With ``capacity`` 0 (the store's default) nothing is recorded and the trie computes no keys: the
index costs nothing for consumers that do not exist. With ``capacity`` > 0 each worker id has a
sequence counter starting at 1 that keeps counting across incarnations, and a ring buffer of its
latest ``capacity`` events so a watcher can resume with ``after_seq``; a watcher whose
``after_seq`` fell out of the buffer sees a gap in ``seq`` and should resync from ``Match`` or
``ListWorkers``. Keys are computed when the event is recorded (the trie keeps them per block).
An event never lists more than ``max_blocks`` blocks, so every event fits a bounded message::

    publish of 2,500 blocks, max_blocks 1,024:
      seq 7  STORED keys[0:1024]     parent = key before the first block
      seq 8  STORED keys[1024:2048]  parent = keys[1023]
      seq 9  STORED keys[2048:2500]  parent = keys[2047]

Subscribers are called synchronously after the verb that caused the event has fully happened
(the servicer forwards them to streams).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable, Sequence

from services.common.errors import FailedPrecondition

from .keys import BlockKey
from .types import Event, EventKind

log = logging.getLogger(__name__)

Subscriber = Callable[[str, Event], None]

MAX_BLOCKS_PER_EVENT = 1024  # 1,024 x (32-byte key + id) ~ 40 KB: far below any message limit


class EventLog:
    """Ring buffers and sequence counters of every worker id seen so far."""

    def __init__(self, capacity: int, max_blocks: int = MAX_BLOCKS_PER_EVENT):
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.capacity = capacity
        self.max_blocks = max_blocks
        self._buffers: dict[str, deque[Event]] = {}
        self._next_seq: dict[str, int] = {}
        self._subscribers: list[Subscriber] = []
        self._pending: list[Event] = []

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def knows(self, worker_id: str) -> bool:
        return worker_id in self._next_seq

    def last_seq(self, worker_id: str) -> int:
        return self._next_seq.get(worker_id, 1) - 1

    def record(
        self,
        worker_id: str,
        incarnation: int,
        kind: EventKind,
        block_ids: Sequence[int] = (),
        block_keys: Sequence[BlockKey] = (),
        parent_key: BlockKey | None = None,
    ) -> None:
        """Append the event, cut into parts of at most ``max_blocks`` blocks (mutates; a no-op
        when events are off); subscribers hear of it at the next ``flush``."""
        if not self.capacity:
            return
        buf = self._buffers.get(worker_id)
        if buf is None:
            buf = self._buffers[worker_id] = deque(maxlen=self.capacity)
        seq = self._next_seq.get(worker_id, 1)
        step = self.max_blocks
        start = 0
        while True:
            keys = tuple(block_keys[start : start + step])
            event = Event(seq, kind, worker_id, incarnation, keys, tuple(block_ids[start : start + step]), parent_key)
            buf.append(event)
            if self._subscribers:
                self._pending.append(event)
            seq += 1
            start += step
            if start >= len(block_ids):
                break
            if kind is EventKind.STORED:
                parent_key = keys[-1]
        self._next_seq[worker_id] = seq

    def since(self, worker_id: str, after_seq: int) -> list[Event]:
        """Buffered events of ``worker_id`` with ``seq > after_seq`` (read-only)."""
        if not self.capacity:
            raise FailedPrecondition("block events are off in this kvstore (enable them with events_per_worker > 0)")
        buf = self._buffers.get(worker_id, ())
        return [e for e in buf if e.seq > after_seq]

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Register ``callback(worker_id, event)``; returns a function that unregisters it."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def flush(self) -> None:
        """Deliver pending events to subscribers (called once a verb has completed). A failing
        subscriber is logged and skipped: the store's state is already committed."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        for event in pending:
            for callback in list(self._subscribers):
                try:
                    callback(event.worker_id, event)
                except Exception:  # noqa: BLE001 - a subscriber must not break the store
                    log.exception("event subscriber failed")
