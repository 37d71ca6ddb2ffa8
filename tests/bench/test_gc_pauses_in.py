"""bench/_common.gc_pauses_in (gc_bench's and serve_bench's reading of the suite's logs): the
pause lines the services' ``GcPauses`` writes, and the count each freeze logs, read back per
process."""

from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from _common import gc_pauses_in  # noqa: E402

from services.common.gc_tuning import GcPauses  # noqa: E402

PREFIX = "2026-12-04 22:00:00,000 WARNING services.common.gc_tuning"


def test_the_lines_the_watcher_writes_are_the_lines_the_bench_reads(tmp_path, caplog):
    pauses = GcPauses(warn_s=0.0, name="router process 17").install()  # every collection is logged
    try:
        with caplog.at_level(logging.WARNING, logger="services.common.gc_tuning"):
            gc.collect(0)
            gc.collect(2)
    finally:
        pauses.uninstall()
    records = [r for r in caplog.records if r.name == "services.common.gc_tuning"]
    assert len(records) == sum(pauses.count) >= 2
    # as a router child writes them (its format adds "[router 0]" after the logger name)
    (tmp_path / "router.log").write_text("".join(f"{PREFIX} [router 0]: {r.getMessage()}\n" for r in records))
    got, heaps = gc_pauses_in(tmp_path)
    assert heaps == {}
    assert got["router process 17"]["by_generation"] == pauses.count


def test_pauses_and_frozen_heaps_are_summed_per_process(tmp_path):
    (tmp_path / "worker0.log").write_text("\n".join([
        "2026-12-04 22:00:00,000 INFO services.common.gc_tuning: worker: 313512 start-up objects frozen out of the garbage collector's reach",
        f"{PREFIX}: worker: a generation-0 garbage collection stalled it 3 ms (10 objects collected)",
        f"{PREFIX}: worker: a generation-2 garbage collection stalled it 142 ms (8555 objects collected)",
        f"{PREFIX}: engine process: a generation-1 garbage collection stalled it 9 ms (1 objects collected)",
        "some.other.logger: worker: a generation-2 garbage collection stalled it 999 ms (not the watcher's line)",
    ]) + "\n")
    got, heaps = gc_pauses_in(tmp_path)
    assert heaps == {"worker": 313512}
    assert set(got) == {"worker", "engine process"}
    w = got["worker"]
    assert w["over_1ms"] == 2 and w["by_generation"] == [1, 0, 1] and w["longest_ms"] == 142
    assert w["visible"] == 1 and w["visible_ms"] == 142  # 5 ms or more
    assert got["engine process"] == {"over_1ms": 1, "visible": 1, "visible_ms": 9, "longest_ms": 9, "by_generation": [0, 1, 0]}
