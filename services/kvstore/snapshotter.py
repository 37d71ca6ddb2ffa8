"""Snapshots of a Redis-backed kvstore made outside the leader's process, so they never hold its
event loop (pickling a 31k-block store held it ~180 ms; see docs/benchmarks.md).

The journal is deterministic (``journal.py``): the snapshot plus the journal entries in Redis
describe the leader's state exactly. So a separate process reads them, replays them into its own
copy, pickles that, and writes it back as the new snapshot under the leader's fencing token::

    leader (event loop free)            snapshot process (python -m services.kvstore.snapshotter)
    ── entries ──▶ Redis journal ──────▶ read snapshot + journal ─▶ replay ─▶ pickle
                                         ◀── _SNAPSHOT(token, seq, blob): fenced, never older ─┘

It snapshots what is durable (at most the leader's acknowledged state), replay checks every
entry's outcome (a divergence is an error, never a wrong snapshot), and the write is refused if
the leader lost its lease or a newer snapshot exists. Costs a second copy of the state, briefly,
in another process (not another thread: the GIL would hold the loop just the same).

The leader passes the Redis URL, key prefix and lease token on stdin (no secret in argv).
"""

from __future__ import annotations

import json
import sys
import time

from .redis_backend import RedisLog


def snapshot_from_redis(url: str, prefix: str, token: str) -> tuple[int, int, float]:
    """Rebuild the store from Redis and write it back as the snapshot under ``token``.
    Returns (seq, bytes, seconds). Raises on a fenced write or a diverging journal."""
    started = time.perf_counter()
    log = RedisLog(url, prefix=prefix, node_id="snapshotter")
    try:
        store = log.replica()
        blob = store.snapshot()
        log.token = token
        log.write_snapshot(store.seq, blob)
        return store.seq, len(blob), time.perf_counter() - started
    finally:
        log.close()


def main() -> int:
    args = json.loads(sys.stdin.read())
    seq, size, seconds = snapshot_from_redis(args["url"], args["prefix"], args["token"])
    print(json.dumps({"seq": seq, "bytes": size, "seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
