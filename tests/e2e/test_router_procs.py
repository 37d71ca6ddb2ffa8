"""``tandem router --procs N`` (services/router/procs.py): N router processes on one gRPC port,
tested against the real suite (kvstore + tiny CPU worker in this process, on loopback).

* in-process group (``RouterProcs``, port 0 and HTTP port 0): greedy answers equal a single
  router's, clients on several connections reach both processes (their own metrics endpoints
  count them), the cache is shared across processes (one salt secret), HTTP is served, no
  process says SERVING before the parent saw every one ready, and a second group cannot take
  the port;
* the CLI parent as a process: SIGTERM stops every child and frees the port, a child that dies
  makes the parent exit 1 and stop the others, a child's start-up error is the parent's exit
  code, a SIGKILLed parent leaves no orphan;
* bad values (procs < 1) are refused.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.settings import settings_from_args
from services.common.startup import EXIT_CONFIG, PortInUse, StartupError, check_port_free
from services.router.procs import RouterProcs, child_settings
from services.router.settings import RouterSettings
from suite_rig import LONG_PREFIX, ROOT, TIMEOUT, wait_registered
from tests.free_ports import start_on_free_port
from tests.proc_tree import alive, children_running
from tests.redis_server import free_port
from tandem.router.v1 import router_pb2, router_pb2_grpc

READY_TIMEOUT = 90.0  # two fresh interpreters import grpc, tokenizers, starlette on a loaded 2-core machine
CHANNELS = 12  # connections; the kernel hashes each to one process: all on one is 2^-11


def group_settings(suite, **overrides) -> RouterSettings:
    return RouterSettings(**{"host": "127.0.0.1", "port": 0, "kvstore": suite.kv.address, "grace_s": 0.0,
                             "registry_ttl_s": 0.0, "policy_seed": 7, "procs": 2, **overrides})


@pytest.fixture
def group(suite):
    """kvstore + worker w0 (in-process) + a two-process router group on free ports."""
    suite.add_worker("w0")
    procs = RouterProcs(group_settings(suite, metrics_port=0, http_port=0))
    procs.start()
    try:
        procs.wait_ready(READY_TIMEOUT)
        yield procs
    finally:
        codes = procs.stop()
        assert all(code == 0 for code in codes.values()), codes  # every child drained and exited 0


def requests_served(port: int) -> float:
    """``tandem_router_requests_total`` summed over outcomes, scraped from one process."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT) as response:
        text = response.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "tandem_router_requests_total")


def generate(stub, text: str, max_new_tokens: int = 12) -> tuple[list[int], int]:
    ids, cached = [], -1
    request = router_pb2.GenerateRequest(text=text, max_new_tokens=max_new_tokens, temperature=0.0)
    for msg in stub.Generate(request, timeout=TIMEOUT):
        ids.extend(msg.token_ids)
        if msg.HasField("usage"):
            cached = msg.usage.cached_tokens
    return ids, cached


def test_two_processes_serve_the_same_answers_share_the_cache_and_both_take_traffic(suite, group):
    assert group.port and all(c.metrics_port for c in group.children)
    assert len({c.metrics_port for c in group.children}) == 2  # one endpoint per process
    prompt = LONG_PREFIX + "Which pool holds the draft KV?"
    # one channel per connection: without a local subchannel pool they would share one
    channels = [grpc.insecure_channel(group.address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(CHANNELS)]
    try:
        answers = [generate(router_pb2_grpc.RouterStub(ch), prompt) for ch in channels]
    finally:
        for ch in channels:
            ch.close()
    served = [requests_served(c.metrics_port) for c in group.children]
    assert sum(served) == CHANNELS and min(served) >= 1, served  # both processes took connections
    ids = {tuple(a[0]) for a in answers}
    assert len(ids) == 1 and len(next(iter(ids))) == 12  # greedy: one answer whichever process served it
    # one salt secret for the group: the first request's published blocks serve every later one,
    # on either process (a secret per process would give the other process's requests 0)
    assert all(cached > 0 for _, cached in answers[1:]), [c for _, c in answers]

    # the same answer as a single in-process router gives
    suite.add_router()
    assert suite.generate(prompt, max_new_tokens=12)[0] == answers[0][0]

    # the OpenAI HTTP front is on the group's HTTP port, in every process
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{group.http_port}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == 12


def health_on_connections(address: str, n: int = CHANNELS) -> list[int]:
    """grpc.health.v1 status seen over ``n`` fresh connections (each lands on some process)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    out = []
    for _ in range(n):
        with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            out.append(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status)
    return out


def test_no_process_says_serving_before_the_parent_saw_every_one_ready(suite):
    from grpc_health.v1 import health_pb2

    suite.add_worker("w0")
    wait_registered(suite, "w0")
    group = RouterProcs(group_settings(suite))
    group.start()
    try:
        # read the children's reports here instead of group.poll(), which would answer them
        end = time.monotonic() + READY_TIMEOUT
        for child in group.children:
            while not child.ready:
                assert time.monotonic() < end and child.process.exitcode is None
                if child.reports.poll(0.1):
                    child.ready = bool(child.reports.recv().get("ready"))
        # both are ready (kvstore answered, worker registered) but nobody told them: NOT_SERVING
        assert set(health_on_connections(group.address)) == {health_pb2.HealthCheckResponse.NOT_SERVING}
        assert group.poll() is None and group.serving  # every child ready: the parent says go
        end = time.monotonic() + TIMEOUT
        while set(health_on_connections(group.address)) != {health_pb2.HealthCheckResponse.SERVING}:
            assert time.monotonic() < end
            time.sleep(0.1)
    finally:
        assert all(code == 0 for code in group.stop().values())


def test_a_child_that_fails_to_start_ends_the_group_with_its_exit_code(tmp_path):
    proc = spawn_router("127.0.0.1:1", "--model", str(tmp_path / "missing"), "--port", "0")
    assert proc.wait(TIMEOUT) == 3  # the environment's code, as one router would exit
    err = proc.stderr.read()
    # whichever process failed first said why in one line (the other may be stopped before it does)
    assert re.search(r"tandem router \(process [01]\): error: cannot load the tokenizer", err), err[-2000:]
    assert "during start-up" in err


def test_a_second_group_cannot_join_the_port(suite, group):
    # SO_REUSEPORT would let any process of the same user bind it: the parent's check refuses
    other = RouterProcs(group_settings(suite, port=group.port))
    with pytest.raises(PortInUse):
        other.start()
    assert not other.children
    with pytest.raises(PortInUse):
        check_port_free("127.0.0.1", group.port)


def test_child_settings_give_each_process_its_metrics_port_and_seed_and_one_secret():
    s = RouterSettings(procs=3, metrics_port=9200, policy_seed=5, port=0)
    kids = [child_settings(s, i, 50050, 8000, "s" * 32) for i in range(3)]
    assert [k.metrics_port for k in kids] == [9200, 9201, 9202]
    assert [k.policy_seed for k in kids] == [5, 6, 7]
    assert {(k.procs, k.port, k.http_port, k.salt_secret) for k in kids} == {(1, 50050, 8000, "s" * 32)}
    assert child_settings(RouterSettings(metrics_port=0), 1, 1, None, "x").metrics_port == 0  # any free port each
    assert child_settings(RouterSettings(), 1, 1, None, "x").metrics_port is None  # off stays off


@pytest.mark.parametrize("flags, fragment", [
    ({"procs": "0"}, "--procs / TANDEM_ROUTER_PROCS: Input should be greater than or equal to 1"),
    ({"procs": "-2"}, "--procs / TANDEM_ROUTER_PROCS: Input should be greater than or equal to 1"),
    ({"procs": "two"}, "--procs / TANDEM_ROUTER_PROCS"),
    ({"procs": "4", "metrics_port": "65534"}, "metrics_port + procs - 1"),
])
def test_bad_values_are_refused(flags, fragment):
    with pytest.raises(StartupError) as err:
        settings_from_args(RouterSettings, argparse.Namespace(**flags), environ={})
    assert err.value.exit_code == EXIT_CONFIG and fragment in err.value.message, err.value.message


def test_a_bad_environment_value_is_refused(monkeypatch):
    monkeypatch.setenv("TANDEM_ROUTER_PROCS", "0")
    with pytest.raises(StartupError) as err:
        settings_from_args(RouterSettings, argparse.Namespace(), environ={})
    assert err.value.exit_code == EXIT_CONFIG and "TANDEM_ROUTER_PROCS" in err.value.message


# ------------------------------------------------------------------------- the CLI as a process
def spawn_router(kv_address: str, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "router", "--procs", "2", "--kvstore", kv_address,
            "--registry-ttl-s", "0", "--grace-s", "0", *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def router_children(pid: int) -> list[int]:
    """The serving children (multiprocessing's resource tracker is a child too; it is not ours)."""
    return children_running(pid, b"spawn_main")


def wait_gone(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    end = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.fixture
def cli_router(suite):
    """``tandem router --procs 2`` as a process against the in-process kvstore + worker, SERVING;
    yields (process, port, its two serving children's pids)."""
    suite.add_worker("w0")
    wait_registered(suite, "w0")
    proc, port = start_on_free_port(lambda port, env: spawn_router(suite.kv.address, "--port", str(port), env=env),
                                    READY_TIMEOUT)
    kids: list[int] = []
    try:
        kids = router_children(proc.pid)
        assert len(kids) == 2
        yield proc, port, kids
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for kid in kids:  # only if a test failed: never leave a child behind
            if alive(kid):
                os.kill(kid, signal.SIGKILL)


def test_sigterm_to_the_parent_drains_every_child_and_frees_the_port(cli_router):
    proc, port, kids = cli_router
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    assert generate(router_pb2_grpc.RouterStub(channel), "hello")[0]
    channel.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(TIMEOUT) == 0, proc.stderr.read()[-2000:]
    assert wait_gone(kids) == []  # no orphan
    check_port_free("127.0.0.1", port)  # nothing holds the port any more


def test_a_child_that_dies_is_reported_and_the_parent_stops_the_rest_and_exits_1(cli_router):
    proc, _port, kids = cli_router
    os.kill(kids[0], signal.SIGKILL)
    assert proc.wait(TIMEOUT) == 1
    err = proc.stderr.read()
    assert f"(pid {kids[0]}) was killed by SIGKILL" in err and "stopped the others" in err, err[-2000:]
    assert wait_gone(kids) == []


def test_children_of_a_killed_parent_drain_by_themselves(cli_router):
    proc, port, kids = cli_router
    proc.kill()  # SIGKILL: the parent cannot stop anyone
    proc.wait()
    assert wait_gone(kids) == []  # each noticed its parent was gone (within a second) and drained
    check_port_free("127.0.0.1", port)


def test_ctrl_c_during_start_up_stops_the_group_without_an_error(suite):
    """Ctrl-C goes to the whole foreground process group: children still importing die of it
    (exit 130) before the parent's own SIGINT handler runs. The parent then stops the group as
    for any SIGINT — exit 0, no "failed during start-up" line, no orphan."""
    port = free_port()
    argv = [sys.executable, "-m", "services.cli", "--log-level", "INFO", "router", "--procs", "2", "--kvstore",
            suite.kv.address, "--registry-ttl-s", "0", "--grace-s", "0", "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as a terminal's job is
    kids: list[int] = []
    try:
        end = time.monotonic() + READY_TIMEOUT
        while len(kids) < 2 and time.monotonic() < end and proc.poll() is None:
            kids = router_children(proc.pid)
            time.sleep(0.01)
        assert len(kids) == 2
        os.killpg(proc.pid, signal.SIGINT)  # while the children start (they import for a second or more)
        code = proc.wait(TIMEOUT)
        err = proc.stderr.read()
        assert code == 0, err[-2000:]
        assert "during start-up" not in err and "error" not in err.lower(), err[-2000:]
        assert wait_gone(kids) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for kid in kids:
            if alive(kid):
                os.kill(kid, signal.SIGKILL)
