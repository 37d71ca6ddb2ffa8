"""bench/http_bench.py's arithmetic: the stages of a request line the client's times up with the
router's front trace, the front overhead is TTFT less the worker stage, and the Δ p50 interval
covers a known shift."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import http_bench as hb  # noqa: E402


def test_stages_line_the_client_up_with_the_trace_and_skip_untraced_requests():
    # sent at 10.000 s; the router: entry +1 ms, dispatch +1.5, first event +21.5, first write +22; seen at +23
    sent = hb.Sent(10.000, 10.023, 4, "k1")
    trace = {"k1": {"entry": 10.001, "dispatch": 10.0015, "first_event": 10.0215, "first_write": 10.022},
             "k2": {"entry": 11.0}}  # a line without its later stamps
    st = hb.stage_times([sent, hb.Sent(11.0, 11.5, 4, "k2"), hb.Sent(12.0, 12.5, 4, "unknown")], trace)
    ms = {k: [round(1000 * v, 6) for v in vs] for k, vs in st.items()}
    assert ms == {"client → front": [1.0], "front → dispatch": [0.5], "dispatch → first event": [20.0],
                  "first event → write": [0.5], "write → client": [1.0], "front overhead": [3.0]}
    assert sum(ms[k][0] for k in hb.STAGES) == pytest.approx(1000 * sent.ttft)


def test_p50_delta_interval_covers_a_known_shift_and_narrows_with_more_requests():
    rng = random.Random(1)
    a = [rng.gauss(50, 5) for _ in range(400)]
    b = [x + 1.0 + rng.gauss(0, 5) for x in (rng.gauss(50, 5) for _ in range(400))]
    lo, hi = hb.p50_delta_ci(a, b)
    assert lo < 1.0 < hi
    lo_few, hi_few = hb.p50_delta_ci(a[:40], b[:40])
    assert hi_few - lo_few > hi - lo
