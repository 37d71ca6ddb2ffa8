"""Debug-only timestamps of each request's way through a router front (``--front-trace FILE``,
``TANDEM_ROUTER_FRONT_TRACE``; off by default, and then nothing here runs).

Both fronts stamp the same four moments, with ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for
every process of the machine, so a benchmark client can line its own send/receive times up):

* ``entry``: the front has the request (HTTP: the ASGI app is called, headers parsed; gRPC: the
  servicer's ``Generate`` is called, message parsed);
* ``dispatch``: the job is built and handed to the dispatcher;
* ``first_event``: the dispatcher's first event (the first token) is back in the front;
* ``first_write``: the front hands its first token to its transport (HTTP: ``send`` of the first
  body chunk; gRPC: the first ``GenerateResponse`` is yielded to grpc).

One JSON line per request, appended to the file just after the first write: ``front``, ``key``
(a hash of the prompt's token ids, so a client can match its own requests) and the four stamps.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import numpy as np

STAMPS = ("entry", "dispatch", "first_event", "first_write")


def prompt_key(token_ids) -> str:
    """The key a trace line carries for a prompt of ``token_ids`` (any ints, as uint32)."""
    return hashlib.blake2b(np.asarray(token_ids, dtype=np.uint32).tobytes(), digest_size=8).hexdigest()


class Stamps:
    """One request's stamps; ``entry`` is taken on creation."""

    __slots__ = ("trace", "front", "key", "times")

    def __init__(self, trace: FrontTrace, front: str):
        self.trace, self.front, self.key = trace, front, ""
        self.times: dict[str, float] = {"entry": time.monotonic()}

    def mark(self, stamp: str) -> None:
        """Stamp ``stamp`` now (first time only); the first write completes the line."""
        if stamp in self.times:
            return
        self.times[stamp] = time.monotonic()
        if stamp == "first_write":  # written after this step of the loop, off the first token's way
            asyncio.get_running_loop().call_soon(self.trace.write, self)


class FrontTrace:
    """The trace file (JSON lines, line-buffered)."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with the router

    def start(self, front: str) -> Stamps:
        return Stamps(self, front)

    def write(self, stamps: Stamps) -> None:
        if self._file.closed:  # a request still streaming while the router stops
            return
        self._file.write(json.dumps({"front": stamps.front, "key": stamps.key, **stamps.times}) + "\n")

    def close(self) -> None:
        self._file.close()


def read_trace(path) -> list[dict]:
    """The lines of a trace file (for benchmarks and tests)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
