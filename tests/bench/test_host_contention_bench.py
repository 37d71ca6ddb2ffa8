"""bench/host_contention_bench.py and the CPU placement helpers of bench/_common.py: the CPU list
parser, one short run of its cases, busy processes placed anywhere, pinning a process tree."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _common  # noqa: E402
import host_contention_bench as hc  # noqa: E402


def test_cpu_lists_parse_as_the_kernel_writes_them():
    assert _common.cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert _common.cpu_list("5") == {5} and _common.cpu_list("") == set()


def test_each_case_is_timed_and_the_spinners_are_gone(tmp_path):
    before = os.sched_getaffinity(0)
    args = argparse.Namespace(busy=[1], reps=2, out=None)
    try:
        res = hc.run(args)
    finally:
        os.sched_setaffinity(0, before)  # run() pins this process to one CPU
    names = [r["case"] for r in res["rows"]]
    assert names[:2] == ["alone", "busy 1"] and names[-1] == "alone again" and all(r["ms"] > 0 for r in res["rows"])
    if len(before) > len(hc.siblings(res["measured_cpu"]) & before):
        assert "busy 1 off-sibling" in names  # a CPU outside the measured one's core exists
    # the spinning processes were killed: no child of this process is left
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    assert not children.exists() or not children.read_text().split()


def test_busy_processes_placed_by_the_os_do_not_inherit_a_pinned_callers_cpu():
    """A caller pinned to the CPU it measures: its "placed by the OS" spinners may still run on
    every CPU (they once inherited the caller's one CPU and timed N + 1 processes sharing it)."""
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        with _common.busy_processes([None, {min(before)}]) as procs:
            free, pinned = (os.sched_getaffinity(p.pid) for p in procs)
    finally:
        os.sched_setaffinity(0, before)
    assert free == set(range(os.cpu_count())) and pinned == {min(before)}


def test_pinning_a_process_tree_and_splitting_the_cpus():
    """``split_cpus``: the last N CPUs, and the rest without them or their SMT siblings;
    ``pin_tasks``: every thread of a process (and of its children, unless told not to)."""
    import subprocess

    own, rest = _common.split_cpus(1)
    assert len(own) == 1 and rest and not (rest & set().union(*(_common.siblings(c) for c in own)))
    assert max(os.sched_getaffinity(0)) in own
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(100):  # its child has started
            kids = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
            if kids:
                break
            __import__("time").sleep(0.05)
        child = int(kids[0])
        assert _common.pin_tasks(parent.pid, rest) >= 2
        assert os.sched_getaffinity(parent.pid) == rest == os.sched_getaffinity(child)
        assert _common.pin_tasks(parent.pid, own, descendants=False) >= 1
        assert os.sched_getaffinity(parent.pid) == own and os.sched_getaffinity(child) == rest
    finally:
        for pid in [int(k) for k in kids]:
            os.kill(pid, 9)
        parent.kill()
        parent.wait()


def test_steal_share_is_the_stolen_part_of_the_ticks_between_two_readings():
    assert _common.steal_share((10, 1000), (60, 2000)) == 0.05
    assert _common.steal_share((0, 0), (0, 0)) == 0.0  # no /proc/stat: nothing claimed
    steal, total = _common.cpu_jiffies()
    assert 0 <= steal <= total and total > 0  # Linux
