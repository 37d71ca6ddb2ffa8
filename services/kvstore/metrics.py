"""Prometheus view of the kvstore: every value is read from ``KVStore.stats()`` when scraped.

The core keeps its own counters (per worker incarnation) and knows nothing of Prometheus; this
collector turns one ``stats()`` snapshot into metric families. ``stats()`` must run on the event
loop that serves the store (the core is single-threaded), while scrapes arrive on the HTTP
endpoint's thread, so the collector hands the call to the loop and waits for it.

Per-worker counters restart at zero when a worker re-registers; Prometheus' ``rate()`` treats
that as a counter reset.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.kvstore.store import KVStore
from services.kvstore.types import StoreStats

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0

# (metric name, help, WorkerStats attribute) of the per-worker counters.
_WORKER_COUNTERS = (
    ("tandem_kvstore_requested_positions", "Prompt positions asked for by Reserve (hit rate denominator)", "requested_positions"),
    ("tandem_kvstore_reused_positions", "Prompt positions served from cache by Reserve (hit rate numerator)", "reused_positions"),
    ("tandem_kvstore_evicted_blocks", "Cached blocks evicted to make room", "evictions"),
    ("tandem_kvstore_published_blocks", "Blocks published into the shared index", "published_blocks"),
    ("tandem_kvstore_deduplicated_blocks", "Published blocks that were already cached (the copy was freed)", "deduplicated_blocks"),
)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class KVStoreCollector(Collector):
    """Collects the kvstore's pool, reservation and cache counters at scrape time (read-only)."""

    def __init__(self, store: KVStore, loop: asyncio.AbstractEventLoop):
        self._store = store
        self._loop = loop

    def _stats(self) -> StoreStats | None:
        if self._loop.is_closed():
            return None
        if _running_loop() is self._loop:
            return self._store.stats()  # already on the loop (a direct registry read)

        async def read() -> StoreStats:
            return self._store.stats()

        try:
            return asyncio.run_coroutine_threadsafe(read(), self._loop).result(SCRAPE_TIMEOUT_S)
        except Exception as exc:  # loop stopped or busy: an empty scrape beats a failed one
            log.warning("kvstore stats unavailable for metrics: %r", exc)
            return None

    def collect(self):
        stats = self._stats()
        if stats is None:
            return
        pool = GaugeMetricFamily("tandem_kvstore_pool_blocks", "KV blocks per worker and state", labels=["worker", "state"])
        live = GaugeMetricFamily("tandem_kvstore_worker_live_reservations", "Live reservations per worker", labels=["worker"])
        counters = [CounterMetricFamily(name, text, labels=["worker"]) for name, text, _ in _WORKER_COUNTERS]
        for w in stats.workers:
            for state in ("free", "cached", "in_use"):
                pool.add_metric([w.worker_id, state], getattr(w.pool, state))
            live.add_metric([w.worker_id], w.live_reservations)
            for family, (_, _, attr) in zip(counters, _WORKER_COUNTERS):
                family.add_metric([w.worker_id], getattr(w, attr))
        yield pool
        yield live
        yield from counters
        yield GaugeMetricFamily("tandem_kvstore_workers", "Registered workers with a live lease", value=len(stats.workers))
        yield GaugeMetricFamily("tandem_kvstore_live_reservations", "Live reservations, all workers", value=stats.live_reservations)
        yield GaugeMetricFamily("tandem_kvstore_trie_nodes", "Distinct published blocks in the radix index", value=stats.trie_nodes)
        yield CounterMetricFamily("tandem_kvstore_matches", "Match calls answered", value=stats.matches)
        yield CounterMetricFamily("tandem_kvstore_reservations_created", "Reservations created", value=stats.reservations_created)
