"""Every serving process freezes its start-up heap (``services/common/gc_tuning.py``) once it is
ready: a worker (its gRPC process and its engine process) before it registers with the kvstore,
each router process before its health says SERVING, the kvstore once it serves. Real CLI processes
against the in-process kvstore + worker of the e2e rig; their INFO logs go to files."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from suite_rig import ROOT, TIMEOUT, wait_registered
from tests.free_ports import start_on_free_port

FROZEN = re.compile(r"gc_tuning(?: \[[^]]*\])?: (?P<who>.+?): (?P<n>\d+) start-up objects frozen")
READY_TIMEOUT = 120.0  # fresh interpreters importing torch / grpc on a loaded 2-core machine


def _spawn(args: list[str], log, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "services.cli", "--log-level", "INFO", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_worker_settles_both_its_processes_before_it_registers(suite, tmp_path):
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = _spawn(["worker", "--kvstore", suite.kv.address, "--port", "0", "--worker-id", "gc-w", "--model", "tiny",
                       "--num-blocks", "256", "--heartbeat-s", "0.2", "--engine-process"], log)
        try:
            wait_registered(suite, "gc-w", timeout_s=READY_TIMEOUT)
        finally:
            _stop(proc)
    text = log_path.read_text(errors="replace")
    frozen = {m["who"]: (int(m["n"]), m.start()) for m in FROZEN.finditer(text)}
    assert set(frozen) == {"worker", "engine process"}, text[-3000:]
    assert min(n for n, _ in frozen.values()) > 10_000  # torch and the model at least
    # before the kvstore (hence any router) could know the worker
    assert max(at for _, at in frozen.values()) < text.index("registering with the kvstore"), text[-3000:]


def test_every_router_process_settles_before_serving_and_the_switch_turns_it_off(suite, tmp_path):
    suite.add_worker("gc-w0")
    wait_registered(suite, "gc-w0")
    for procs, freeze in ((2, True), (1, True), (2, False)):
        log_path = tmp_path / f"router-{procs}-{freeze}.log"
        with open(log_path, "wb") as log:
            proc, _port = start_on_free_port(lambda port, env: _spawn(
                ["router", "--procs", str(procs), "--kvstore", suite.kv.address, "--registry-ttl-s", "0", "--grace-s", "0",
                 "--port", str(port), *([] if freeze else ["--no-gc-freeze"])], log, env), READY_TIMEOUT)
            try:
                text = log_path.read_text(errors="replace")  # SERVING: every settle happened already
            finally:
                _stop(proc)
        who = [m["who"] for m in FROZEN.finditer(text)]
        if not freeze:
            assert who == [], text[-3000:]
        elif procs == 1:
            assert who == ["router"], text[-3000:]
        else:
            assert len(set(who)) == 2 and all(w.startswith("router process ") for w in who), text[-3000:]


def test_the_kvstore_settles_once_it_serves(tmp_path):
    log_path = tmp_path / "kvstore.log"
    with open(log_path, "wb") as log:
        proc, _port = start_on_free_port(lambda port, env: _spawn(["kvstore", "--port", str(port)], log, env), READY_TIMEOUT)
        try:
            end = time.monotonic() + TIMEOUT  # settled right after it began serving
            while not FROZEN.search(log_path.read_text(errors="replace")) and time.monotonic() < end:
                time.sleep(0.05)
        finally:
            _stop(proc)
    assert [m["who"] for m in FROZEN.finditer(log_path.read_text(errors="replace"))] == ["kvstore"]
