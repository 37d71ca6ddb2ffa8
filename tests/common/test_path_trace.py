"""services/common/path_trace.py: off unless its variable is set; on, one line per stamp in a
file of the process's own; read back as one way per request (the worker's tenant scope cut off),
its first stamp of a point kept, the hops in the order of the way."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.common import path_trace


def test_off_by_default_and_on_in_a_process_given_the_variable(tmp_path):
    prefix = tmp_path / "path"
    code = ("from services.common import path_trace as p\n"
            "p.stamp('router.entry', 'r1'); p.stamp('worker.entry', 'scope/r1'); p.stamp('router.entry', 'r1')\n")
    env = {k: v for k, v in os.environ.items() if k != path_trace.ENV}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    assert not list(tmp_path.iterdir())  # off: no file
    subprocess.run([sys.executable, "-c", code], check=True, env={**env, path_trace.ENV: str(prefix)})
    (f,) = tmp_path.iterdir()
    assert f.name.startswith("path.") and len(f.read_text().splitlines()) == 3
    paths = path_trace.read_paths(prefix)
    assert list(paths) == ["r1"] and set(paths["r1"]) == {"router.entry", "worker.entry"}
    assert paths["r1"]["router.entry"] < paths["r1"]["worker.entry"]  # the first stamp of a point counts


def test_hops_follow_the_way_and_skip_what_a_request_lacks(tmp_path):
    (tmp_path / "path.1").write_text("1.000 router.entry a\n1.002 router.matched a\n1.010 engine.first a\n"
                                     "1.020 router.first b\n")
    (tmp_path / "path.2").write_text("1.005 router.reserved a\n1.012 worker.first t/a\n1.0")  # cut short: ignored
    paths = path_trace.read_paths(tmp_path / "path")
    h = path_trace.hops(paths["a"])
    assert list(h) == ["router.entry → router.matched", "router.matched → router.reserved", "engine.first → worker.first"]
    assert h["router.entry → router.matched"] == pytest.approx(0.002) and h["engine.first → worker.first"] == pytest.approx(0.002)
    assert path_trace.hops(paths["b"]) == {}
