"""A real ``redis-server`` for tests, on a free loopback port (never a fake).

``scripts/test.sh`` installs the server where it is missing (the Debian package). A test that
needs Redis and finds no ``redis-server`` fails with that hint rather than skipping: Redis is a
part CI requires.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import uuid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process (AOF with ``appendfsync always`` unless told otherwise)."""

    def __init__(self, *, appendfsync: str = "always"):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: run scripts/test.sh (it installs it) or apt-get install redis-server")
        self.dir = tempfile.mkdtemp(prefix="tandem-redis-")
        for attempt in range(3):  # another process may bind the picked port before redis-server does
            self.port = free_port()
            self.proc = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
                 "--appendonly", "yes", "--appendfsync", appendfsync, "--protected-mode", "no"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            try:
                self._wait()
                return
            except RuntimeError:
                if self.proc.poll() is None or attempt == 2:  # still running: not a lost port
                    self.stop()
                    raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _wait(self, timeout_s: float = 10.0) -> None:
        import redis

        end = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        while True:
            try:
                # ours, not another test's server that took the port first (it answers PING too)
                if client.info("server")["process_id"] != self.proc.pid:
                    client.close()
                    self.proc.wait(10)  # ours cannot bind the port: it exits, and is started again
                    raise RuntimeError(f"another redis-server answers on port {self.port}")
                client.close()
                return
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def unique_prefix() -> str:
    """Keys of one test, apart from every other test sharing the server."""
    return f"t{uuid.uuid4().hex[:10]}:"
