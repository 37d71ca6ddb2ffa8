"""bench/host_contention_bench.py: the CPU list parser and one short run of its cases."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import host_contention_bench as hc  # noqa: E402


def test_cpu_lists_parse_as_the_kernel_writes_them():
    assert hc.cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert hc.cpu_list("5") == {5} and hc.cpu_list("") == set()


def test_each_case_is_timed_and_the_spinners_are_gone(tmp_path):
    before = os.sched_getaffinity(0)
    args = argparse.Namespace(busy=[1], reps=2, out=None)
    try:
        res = hc.run(args)
    finally:
        os.sched_setaffinity(0, before)  # run() pins this process to one CPU
    names = [r["case"] for r in res["rows"]]
    assert names[:2] == ["alone", "busy 1"] and all(r["ms"] > 0 for r in res["rows"])
    if len(before) > len(hc.siblings(res["measured_cpu"]) & before):
        assert "busy 1 off-sibling" in names  # a CPU outside the measured one's core exists
    # the spinning processes were killed: no child of this process is left
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    assert not children.exists() or not children.read_text().split()
