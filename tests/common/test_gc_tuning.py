"""``services/common/gc_tuning.py``: the pause watcher in this process; the freeze (process-wide
and irreversible) in fresh interpreters; the setting every service reads."""

from __future__ import annotations

import gc
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.gc_tuning import THRESHOLDS, GcPauses

RARE = (50_000, 20, 100)  # thresholds unlike CPython's, to see them set
from services.gpuworker.settings import WorkerSettings
from services.kvstore.settings import KVStoreSettings
from services.router.settings import RouterSettings

ROOT = Path(__file__).resolve().parents[2]


class _Cycle:
    def __init__(self):
        self.me = self  # reachable only through itself: only the cyclic collector frees it


def test_pauses_are_counted_per_generation_and_long_ones_logged(caplog):
    pauses = GcPauses(warn_s=1e-9, name="test process").install()
    try:
        for _ in range(50):
            _Cycle()
        with caplog.at_level(logging.WARNING, logger="services.common.gc_tuning"):
            gc.collect(0)
            gc.collect(2)
    finally:
        pauses.uninstall()
    assert pauses.count[0] >= 1 and pauses.count[2] >= 1
    assert 0 < pauses.longest_s <= sum(pauses.seconds) and pauses.seconds[2] > 0
    lines = [r.getMessage() for r in caplog.records]
    assert any("test process: a generation-2 garbage collection stalled it" in m for m in lines), lines
    assert any("objects collected" in m for m in lines)
    # uninstalled: nothing more is counted
    before = list(pauses.count)
    gc.collect(2)
    assert pauses.count == before
    assert pauses.as_dict()["collections"] == before


def test_no_warning_below_the_threshold(caplog):
    pauses = GcPauses(warn_s=60.0).install()
    try:
        with caplog.at_level(logging.WARNING, logger="services.common.gc_tuning"):
            gc.collect(2)
    finally:
        pauses.uninstall()
    assert pauses.count[2] == 1
    assert not [r for r in caplog.records if r.name == "services.common.gc_tuning"]


def _fresh(code: str, env: dict | None = None) -> dict:
    """Run ``code`` in a fresh interpreter (the freeze is process-wide); its last line is JSON."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True,
                         env=env, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tune_gc_freezes_the_start_up_heap_and_sets_the_thresholds():
    got = _fresh(
        "import gc, json, time\n"
        "import torch, grpc  # a service-sized heap\n"
        "from services.common.gc_tuning import tune_gc\n"
        "before = len(gc.get_objects())\n"
        f"frozen = tune_gc({RARE})\n"
        "t = time.perf_counter(); gc.collect(); after_ms = (time.perf_counter() - t) * 1e3\n"
        "print(json.dumps({'before': before, 'frozen': frozen, 'tracked': len(gc.get_objects()),\n"
        "                  'thresholds': gc.get_threshold(), 'freeze_count': gc.get_freeze_count()}))\n"
    )
    assert got["freeze_count"] >= 0.9 * got["before"] > 10_000
    assert got["tracked"] < 0.05 * got["before"]  # what a full collection still traverses
    assert tuple(got["thresholds"]) == RARE


@pytest.mark.parametrize("freeze", [True, False])
def test_settle_heap_follows_the_setting_and_installs_one_watcher(freeze):
    got = _fresh(
        "import gc, json\n"
        "from services.common import gc_tuning\n"
        "from services.router.settings import RouterSettings\n"
        f"gc.set_threshold(*{RARE})  # something else set them: the setting decides who wins\n"
        f"s = RouterSettings(gc_freeze={freeze}, gc_warn_ms=20)\n"
        "w1 = gc_tuning.settle_heap(s, 'router')\n"
        "after_first = gc.get_threshold()\n"
        "w2 = gc_tuning.settle_heap(s, 'router')  # a second call (a kvstore leader again): one watcher\n"
        "hooks = sum(1 for cb in gc.callbacks if getattr(cb, '__self__', None) is w1)\n"
        "off = gc_tuning.settle_heap(RouterSettings(gc_freeze=False, gc_warn_ms=0), 'x')\n"
        "print(json.dumps({'frozen': gc.get_freeze_count(), 'after_first': after_first,\n"
        "                  'same': w1 is w2, 'hooks': hooks, 'warn_s': w1.warn_s, 'off': off is None}))\n"
    )
    assert (got["frozen"] > 0) is freeze
    # frozen: the services' thresholds; not frozen: the collector left exactly as it was
    assert tuple(got["after_first"]) == (THRESHOLDS if freeze else RARE)
    assert got["same"] and got["hooks"] == 1 and got["warn_s"] == pytest.approx(0.02) and got["off"]


@pytest.mark.parametrize("cls, prefix", [(KVStoreSettings, "KVSTORE"), (WorkerSettings, "WORKER"), (RouterSettings, "ROUTER")])
def test_every_service_reads_the_gc_settings_from_its_environment(monkeypatch, cls, prefix):
    assert cls().gc_freeze is True and cls().gc_warn_ms == 50.0
    monkeypatch.setenv(f"TANDEM_{prefix}_GC_FREEZE", "false")
    monkeypatch.setenv(f"TANDEM_{prefix}_GC_WARN_MS", "7.5")
    s = cls()
    assert s.gc_freeze is False and s.gc_warn_ms == 7.5
    monkeypatch.setenv(f"TANDEM_{prefix}_GC_WARN_MS", "0")  # never
    assert cls().gc_warn_ms == 0
    monkeypatch.setenv(f"TANDEM_{prefix}_GC_WARN_MS", "-1")
    with pytest.raises(ValueError):
        cls()
