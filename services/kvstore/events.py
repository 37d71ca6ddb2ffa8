"""Per-worker block events (stored / removed / cleared) and their subscribers.

Each worker id has a sequence counter starting at 1 that keeps counting across incarnations, and
a bounded ring buffer of its latest events so a watcher can resume with ``after_seq``; a watcher
whose ``after_seq`` fell out of the buffer sees a gap in ``seq`` and should resync from ``Match``
or ``ListWorkers``. Subscribers are called synchronously after the verb that caused the event has
fully happened (the servicer forwards them to streams). Events refer to the trie nodes involved
and derive their 256-bit keys on first read, so nobody pays for hashing an unread event.
"""

from __future__ import annotations

import logging
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Callable, Sequence

from .keys import BlockKey
from .types import Event, EventKind

if TYPE_CHECKING:
    from .radix_trie import Chain, Node

log = logging.getLogger(__name__)


def _keys_of(chains: list[Chain], indices: list[int], parent: Node | None) -> tuple[tuple[BlockKey, ...], BlockKey | None]:
    return tuple([c.key_at(i) for c, i in zip(chains, indices)]), (None if parent is None else parent.key)


Subscriber = Callable[[str, Event], None]


class EventLog:
    """Ring buffers and sequence counters of every worker id seen so far."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._buffers: dict[str, deque[Event]] = {}
        self._next_seq: dict[str, int] = {}
        self._subscribers: list[Subscriber] = []
        self._pending: list[Event] = []

    def knows(self, worker_id: str) -> bool:
        return worker_id in self._next_seq

    def last_seq(self, worker_id: str) -> int:
        return self._next_seq.get(worker_id, 1) - 1

    def record(
        self,
        worker_id: str,
        incarnation: int,
        kind: EventKind,
        nodes: Sequence[Node] = (),
        block_ids: tuple[int, ...] = (),
        parent: Node | None = None,
    ) -> Event:
        """Append an event (mutates); subscribers hear of it at the next ``flush``. The keys of
        ``nodes`` (non-root trie nodes) and ``parent`` are derived when someone reads the event,
        from the nodes' ``Chain`` records: the event keeps those, not the nodes."""
        seq = self._next_seq.get(worker_id, 1)
        self._next_seq[worker_id] = seq + 1
        source = None
        if nodes or parent is not None:
            source = partial(_keys_of, [n.chain for n in nodes], [n.index for n in nodes], parent)
        event = Event(seq, kind, worker_id, incarnation, block_ids=block_ids, source=source)
        buf = self._buffers.get(worker_id)
        if buf is None:
            buf = self._buffers[worker_id] = deque(maxlen=self.capacity)
        buf.append(event)
        if self._subscribers:
            self._pending.append(event)
        return event

    def since(self, worker_id: str, after_seq: int) -> list[Event]:
        """Buffered events of ``worker_id`` with ``seq > after_seq`` (read-only)."""
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
