"""``tandem up`` supervises its children: a crashed worker comes back (with backoff) and serves
again, the suite stops router → workers → kvstore, a child that loses the free port picked for it
is started again on another, and a worker started before its kvstore waits for it, logging a line
every few seconds rather than every probe."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from services import launcher
from services.launcher import Child, restart_delay, stop_children

ROOT = Path(__file__).resolve().parents[2]

# Each fake child logs when SIGTERM arrives and when it has finished draining (0.3 s later).
FAKE_CHILD = """
import signal, sys, time
name, log = sys.argv[1], sys.argv[2]
def note(what):
    with open(log, "a") as f:
        f.write(f"{name} {what}\\n")
def on_term(*_):
    note("term"); time.sleep(0.3); note("exit"); sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
note("up")
while True:
    time.sleep(0.05)
"""


def test_stop_order_is_router_then_workers_then_kvstore(tmp_path):
    log = tmp_path / "events"
    names = ["kvstore", "worker0", "worker1", "router"]
    children = [Child(n, "", [], {}, subprocess.Popen([sys.executable, "-c", FAKE_CHILD, n, str(log)]), time.monotonic())
                for n in names]
    end = time.monotonic() + 10
    while log.read_text().count(" up") < 4 if log.exists() else True:
        assert time.monotonic() < end
        time.sleep(0.05)
    assert stop_children(children) == ["router", "worker0", "worker1", "kvstore"]
    events = log.read_text().split("\n")
    at = {e: i for i, e in enumerate(events)}
    assert at["router exit"] < at["worker0 term"] and at["router exit"] < at["worker1 term"]
    assert max(at["worker0 exit"], at["worker1 exit"]) < at["kvstore term"]  # the kvstore outlives every worker
    assert all(c.proc.returncode == 0 for c in children)


def test_restart_backoff_doubles_and_is_capped():
    assert [restart_delay(n) for n in (1, 2, 3, 4, 5, 6, 7, 20)] == [1, 2, 4, 8, 16, 30, 30, 30]


def _lines(proc: subprocess.Popen, stream) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump():
        for line in stream:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _expect(q: queue.Queue, pattern: str, timeout: float = 120) -> re.Match:
    end = time.monotonic() + timeout
    seen = []
    while time.monotonic() < end:
        try:
            line = q.get(timeout=max(0.1, end - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(seen[-40:])}")


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    return dict(env, PYTHONPATH=str(ROOT), TANDEM_HOME=str(tmp_path), PYTHONUNBUFFERED="1")


def test_a_crashed_worker_is_restarted_and_serves_again(tmp_path):
    from services.client import generate_and_print

    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--device", "cpu", "--router-port", "0", "--kvstore-port", "0",
         "--worker-base-port", "0", "--num-blocks", "128", "--log-level", "warning"],
        cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        out, err = _lines(proc, proc.stdout), _lines(proc, proc.stderr)
        worker_pid = int(_expect(out, r"worker0 .*\(pid (\d+)\)").group(1))
        router = _expect(out, r"router\s+(\S+)").group(1)
        _expect(out, "serving; Ctrl-C stops everything")
        os.kill(worker_pid, signal.SIGKILL)
        _expect(err, r"worker0 exited with code -9; restarting in 1 s \(restart 1 in a row\)", timeout=30)
        new_pid = int(_expect(out, r"worker0 restarted \(pid (\d+)\)", timeout=30).group(1))
        assert new_pid != worker_pid
        end = time.monotonic() + 60
        while generate_and_print(router, "hello again", max_new_tokens=4, timeout_s=10, out=open(os.devnull, "w")) != 0:
            assert time.monotonic() < end, "the restarted worker never served"
            time.sleep(0.5)
        assert proc.poll() is None  # the suite kept running throughout
        proc.send_signal(signal.SIGTERM)
        assert _expect(out, r"stopped (\w+)").group(1) == "router"
        assert _expect(out, r"stopped (\w+)").group(1) == "worker0"
        assert _expect(out, r"stopped (\w+)").group(1) == "kvstore"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _suite_env(monkeypatch, tmp_path) -> None:
    for name in [k for k in os.environ if k.startswith("TANDEM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.chdir(ROOT)


def _health_server_saying_serving():
    """Another process's gRPC server as a port thief looks to a prober: it says SERVING."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_a_child_whose_picked_port_was_taken_starts_again_on_another(tmp_path, monkeypatch, capfd):
    """Between ``tandem up`` picking a free port and the child binding it (seconds of imports),
    another process can take the port: here a gRPC server that itself says SERVING takes the
    kvstore's (its answer must not pass for the kvstore's) and a bare socket the router's. Both
    children exit with code 3 and are started again on fresh ports; the suite then serves."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    thief, thief_port = _health_server_saying_serving()
    taken = socket.create_server(("127.0.0.1", 0))  # listening: no SO_REUSEADDR can share it
    picks = {1: thief_port, 4: taken.getsockname()[1]}  # the kvstore's first pick, then (after the worker's) the router's
    calls = []
    real_free_port = launcher._free_port

    def free_port(host):
        calls.append(host)
        return picks.get(len(calls)) or real_free_port(host)

    _suite_env(monkeypatch, tmp_path)
    monkeypatch.setattr(launcher, "_free_port", free_port)
    s = launcher.UpSettings(device="cpu", router_port=0, kvstore_port=0, worker_base_port=0, http=False, insecure=True,
                            num_blocks=128, startup_timeout_s=120)
    children = []
    try:
        children = launcher.start_suite(s, launcher.choose_workers(s), "WARNING")
        err = capfd.readouterr().err
        for name in ("kvstore", "router"):
            assert f"tandem up: {name} exited with code 3: another process took a port picked for it" in err
        assert "already in use" in err  # the child's own one-line reason
        assert [c.name for c in children] == ["kvstore", "worker0", "router"]
        for child in children:
            assert int(child.address.rsplit(":", 1)[1]) not in picks.values() and child.proc.poll() is None
            with grpc.insecure_channel(child.address) as channel:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        assert f"--kvstore {children[0].address}" in " ".join(children[1].argv)  # the worker got the kvstore's new port
    finally:
        stop_children(children)
        thief.stop(0)
        taken.close()


def test_a_port_the_user_chose_is_not_changed(tmp_path, monkeypatch, capfd):
    """Only ports we picked move: the router's port is ours to pick (0) but its HTTP port was
    named and is taken at bind time; the router exits 3 and the start fails, with no new start
    on other ports (its picked port is free: that was not the reason)."""
    taken = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setattr(launcher, "check_ports", lambda s, n: None)  # lose the race after the up-front check
    _suite_env(monkeypatch, tmp_path)
    s = launcher.UpSettings(device="cpu", kvstore_port=0, router_port=0, worker_base_port=0, http=True,
                            http_port=taken.getsockname()[1], insecure=True, num_blocks=128, startup_timeout_s=60)
    try:
        with pytest.raises(launcher.StartupError, match="process exited with code 3"):
            launcher.start_suite(s, launcher.choose_workers(s), "WARNING")
        err = capfd.readouterr().err
        assert "already in use" in err and "starting it again" not in err
    finally:
        taken.close()


def _exited(code: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    proc.wait()
    return proc


def test_a_worker_that_lost_its_picked_port_is_restarted_on_another(monkeypatch):
    """supervise_once: a worker that exits 3 while another process holds the port we had picked
    for it comes back on a new one; one that exits 3 with its port free (a missing model, say)
    comes back on the same; a port the user named never moves."""
    spawned = []
    monkeypatch.setattr(launcher, "_spawn", lambda name, argv, address, env=None, auto_ports=(): spawned.append(argv) or
                        Child(name, address, argv, env or {}, _exited(0), time.monotonic(), auto_ports=auto_ports))
    holder = socket.create_server(("127.0.0.1", 0))
    held = holder.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    try:
        for port, auto, moves in [(held, ("--port",), True), (free, ("--port",), False), (held, (), False)]:
            spawned.clear()
            children = [Child("worker0", f"127.0.0.1:{port}", ["worker", "--port", str(port)], {}, _exited(3),
                              time.monotonic(), auto_ports=auto)]
            assert launcher.supervise_once(children, 100.0) is None  # schedules the restart
            assert launcher.supervise_once(children, 200.0) is None  # performs it
            new_port = int(spawned[0][spawned[0].index("--port") + 1])
            assert (new_port != port) == moves, (port, auto)
            assert children[0].address == f"127.0.0.1:{new_port}"
    finally:
        holder.close()


def test_worker_waits_for_a_late_kvstore_with_a_line_every_few_seconds(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        kv_port = s.getsockname()[1]
    worker = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "worker", "--port", "0", "--kvstore", f"127.0.0.1:{kv_port}", "--num-blocks", "64"],
        cwd=ROOT, env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    kvstore = None
    try:
        err = _lines(worker, worker.stderr)
        first = _expect(err, rf"waiting for the kvstore at 127.0.0.1:{kv_port} \(.*\); retrying, 0 s so far")
        assert first
        started = time.monotonic()
        time.sleep(7)
        assert worker.poll() is None  # it waits, it does not exit
        waited = []
        while not err.empty():
            line = err.get()
            if line and "waiting for the kvstore" in line:
                waited.append(line)
        assert 1 <= len(waited) <= 2, waited  # about one line per 5 s, not one per 200 ms probe
        kvstore = subprocess.Popen([sys.executable, "-m", "services.cli", "kvstore", "--port", str(kv_port)],
                                   cwd=ROOT, env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _expect(err, r"worker worker0 serving on", timeout=30)
        assert time.monotonic() - started < 30
    finally:
        for p in (worker, kvstore):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(15)
