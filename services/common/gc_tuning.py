"""CPython's cyclic garbage collector in a serving process: freeze what start-up made, and say
when a collection still stalls the process.

After start-up a service holds hundreds of thousands of objects that live as long as it does
(a CPU worker after warm-up: ~310,000 — torch, the model's modules, gRPC, protobuf; each process
logs its own count when it freezes them).
With CPython's default settings every full collection traverses all of them, and nothing else in
the process runs meanwhile: in a worker's engine process that is every running request's next
token (140-350 ms a full collection on the 2-core dev VM; ``bench/gc_bench.py`` measures the pauses
of the served suite). ``tune_gc`` moves the start-up heap to the permanent generation
(``gc.freeze``), so collections traverse only what was made since.

    start-up (imports, model, warm-up)  ──tune_gc()──▶  serving: collections see new objects only

Process-wide: call once from a service's entry point, at the end of its start-up (after a
worker's warm-up), never from library code or tests (a frozen object is never collected).
``GcPauses`` logs a warning for any collection longer than a threshold (SGLang's
``gc_warning_threshold_secs``), so a pause that remains is seen, not guessed.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

# (young, middle, old) collection thresholds: CPython's own, for every service. Once the start-up
# heap is frozen every collection is short (bench/gc_bench.py, 45 s served runs on the dev VM: the
# worker's and the router's longest 3-10 ms, against 14-351 ms unfrozen). The kvstore used to
# collect young objects every 50,000 allocations instead (15-25 % of its cycle went to collections
# before its heap was frozen); frozen, that bought nothing measurable (in process 44-47 µs a cycle
# either way, over gRPC 942 / 943 against 948 / 972 cycles/s, on Redis 74-79 µs either way) and
# served it made each young collection of gRPC garbage a 9-31 ms stall (session 28).
THRESHOLDS = (700, 10, 10)
WARN_PAUSE_S = 0.05  # a collection this long is a visible stall of every stream the process serves


def tune_gc(thresholds: tuple[int, int, int] = THRESHOLDS) -> int:
    """Collect once, freeze every surviving object, set ``thresholds``. Returns how many objects
    were frozen. Process-wide and irreversible by design (see the module docstring)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
    return gc.get_freeze_count()


class GcPauses:
    """Per-generation count and seconds of the collections since ``install`` (a ``gc.callbacks``
    hook), and a warning log line for each one longer than ``warn_s`` (``None``: never). Reading
    the totals is safe from any thread; the hook runs in whichever thread triggered the
    collection."""

    def __init__(self, warn_s: float | None = WARN_PAUSE_S, name: str = "this process"):
        self.warn_s = warn_s
        self.name = name
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest_s = 0.0
        self._started: float | None = None

    def install(self) -> "GcPauses":
        gc.callbacks.append(self._hook)
        return self

    def uninstall(self) -> None:
        if self._hook in gc.callbacks:
            gc.callbacks.remove(self._hook)

    def _hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed between a start and its stop
            return
        took = time.perf_counter() - self._started
        self._started = None
        g = info["generation"]
        self.count[g] += 1
        self.seconds[g] += took
        self.longest_s = max(self.longest_s, took)
        if self.warn_s is not None and took > self.warn_s:
            try:
                log.warning("%s: a generation-%d garbage collection stalled it %.0f ms (%d objects collected)",
                            self.name, g, took * 1e3, info.get("collected", 0))
            except RuntimeError:  # the collection began inside a write to the same stream (reentrant)
                pass

    def as_dict(self) -> dict:
        return {"collections": list(self.count), "seconds": [round(s, 6) for s in self.seconds],
                "longest_s": round(self.longest_s, 6)}


def settle_heap(settings, name: str) -> GcPauses | None:
    """A service's end of start-up: ``tune_gc()`` when ``settings.gc_freeze`` (else the
    collector stays as CPython set it), a pause watcher unless ``settings.gc_warn_ms`` is 0
    (``TandemSettings`` fields). Process-wide; call once per process (a kvstore that becomes
    leader again calls it again: freezing twice is harmless, the watcher is installed once)."""
    global _watcher
    if settings.gc_freeze:
        frozen = tune_gc()
        log.info("%s: %d start-up objects frozen out of the garbage collector's reach", name, frozen)
    if not settings.gc_warn_ms:
        return None
    if _watcher is None:
        _watcher = GcPauses(settings.gc_warn_ms / 1e3, name).install()
    return _watcher


_watcher: GcPauses | None = None


__all__ = ["GcPauses", "THRESHOLDS", "WARN_PAUSE_S", "settle_heap", "tune_gc"]
