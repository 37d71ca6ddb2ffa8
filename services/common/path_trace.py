"""Debug-only timestamps of each request's way through the suite's processes
(``TANDEM_PATH_TRACE=PREFIX`` in their environment; off by default, and then a stamp is one
attribute test).

Every process the variable reaches (router, worker, the worker's engine process) appends one
line per stamp to ``PREFIX.<pid>``: ``<time.monotonic()> <point> <request id>``. CLOCK_MONOTONIC
is one clock for every process of a machine, so lines of all files line up, and a request's
stamps in order are its way to the first token::

    router    entry ─ Match ─ matched ─ Reserve ─ reserved ─ Worker.Generate ─ called
    worker    ─ entry ─ GetReservation ─ reserved ─ (pipe) ─┐
    engine                                                  admitted ─ prefill, steps ─ first
    worker    ─ (pipe) ─ first (its first message sent) ─┐
    router                                               first (the first tokens received)

The worker names a request ``<tenant scope>/<router request id>``; :func:`read_paths` keeps the
part after the last ``/``, so one request has one name everywhere. The router front's own trace
(``front_trace``: one JSON line per request, HTTP and gRPC fronts) times the front alone.

Session 41 found with it that the worker's GetReservation took 14 ms at the median at 64
concurrent streams (a blocking call on an executor thread, waiting for the GIL behind the event
loop) where the kvstore answers in ~2.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "TANDEM_PATH_TRACE"
POINTS = ("router.entry", "router.matched", "router.reserved", "router.called", "worker.entry", "worker.reserved",
          "engine.admitted", "engine.first", "worker.first", "router.first")

_prefix = os.environ.get(ENV, "")
_file = None


def stamp(point: str, request_id: str) -> None:
    """Append ``point`` for ``request_id`` now (nothing when tracing is off). Line-buffered: a
    process that is killed loses at most the line being written."""
    global _file
    if not _prefix:
        return
    if _file is None:
        _file = open(f"{_prefix}.{os.getpid()}", "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - the process's
    _file.write(f"{time.monotonic():.6f} {point} {request_id}\n")


def read_paths(prefix: str | Path) -> dict[str, dict[str, float]]:
    """Every traced request's stamps (request id → point → monotonic seconds; the first stamp of a
    point counts) from the files ``prefix.*``. Pure apart from reading them."""
    prefix = Path(prefix)
    paths: dict[str, dict[str, float]] = {}
    for f in sorted(prefix.parent.glob(prefix.name + ".*")):
        for line in f.read_text(encoding="utf-8").splitlines():
            parts = line.split(" ", 2)
            if len(parts) != 3:
                continue  # a line cut short by a killed process
            at, point, rid = parts
            paths.setdefault(rid.rsplit("/", 1)[-1], {}).setdefault(point, float(at))
    return paths


def hops(path: dict[str, float]) -> dict[str, float]:
    """The time between each two consecutive points of :data:`POINTS` a request has both of
    ("router.entry → router.matched": seconds). Pure."""
    out = {}
    for a, b in zip(POINTS, POINTS[1:]):
        if a in path and b in path:
            out[f"{a} → {b}"] = path[b] - path[a]
    return out
