"""The README's quickstart path: `tandem up --demo` starts the suite on the shipped demo model,
streams a demo answer twice (the second hitting the first's cached KV) and stops everything
cleanly. The answer is readable text (no control bytes) and its trained draft gets accepted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tandem_up_demo_streams_twice_and_the_second_is_cached(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_HOME": str(tmp_path)}  # no distilled draft
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--demo", "--exit-after-demo",
         "--router-port", "0", "--http-port", "0", "--kvstore-port", "0", "--worker-base-port", "0", "--num-blocks", "256"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "all services SERVING" in out
    assert re.search(r"OpenAI-compatible HTTP API: http://127\.0\.0\.1:\d+/v1", out), out
    # mTLS between the services by default, with a throwaway CA that is gone afterwards
    certs = re.search(r"mTLS between the services: throwaway CA and certificates in (\S+)", out)
    assert certs is not None, out
    assert not Path(certs.group(1)).exists()
    usage = re.findall(r"prompt (\d+) tokens \(cached (\d+)\), completion (\d+) tokens", out)
    assert len(usage) == 2, out
    (p1, c1, n1), (p2, c2, n2) = [tuple(map(int, u)) for u in usage]
    assert p1 == p2 and n1 == n2 == 160
    assert c1 == 0 and c2 > 0
    acceptance = [float(a) for a in re.findall(r"acceptance length ([\d.]+)", out)]
    assert len(acceptance) == 2 and min(acceptance) > 1.5, out  # the shipped draft is trained
    answer = out.split("demo request 1 of 2", 1)[1].split("[worker", 1)[0]
    assert "def read_config(path):" in answer
    assert all(ch.isprintable() or ch in "\n\t" for ch in answer), repr(answer)
    assert "stopping" in out
