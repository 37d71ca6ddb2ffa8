"""Issue 8 row 9: every Tandem channel sends HTTP/2 keepalive pings, so a peer that stops
answering with its connection open (SIGSTOP, a hung host) fails the call with UNAVAILABLE after
about keepalive time + timeout, instead of hanging until a distant deadline."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from services.common.channels import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, open_sync_channel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def echo_server():
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "echo_server.py"), "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line
        yield proc, f"127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def test_a_frozen_peer_is_detected_by_keepalive(echo_server):
    proc, address = echo_server
    with open_sync_channel(address) as channel:
        echo = channel.unary_unary("/tandem.bench.Echo/Echo")
        assert echo(b"ping", timeout=10) == b"ping"  # connected
        proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            echo(b"anyone?", timeout=60)
        waited = time.monotonic() - started
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert waited < 3 * (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000  # far below the 60 s deadline
