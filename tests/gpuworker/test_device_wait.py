"""The engine's count of its waits for the device (``StepReport.device_wait_s``): the read-backs of
a step's tokens and of a fused step's verdict add their fence waits, each wait once, and the
worker's metrics split them by kind of step. On the CPU every fence is complete when made, so
the tests slow the fence down to give the waits a size to check."""

from __future__ import annotations

import time

import pytest
import torch

from services.common.metrics import ServiceMetrics
from services.gpuworker.engine.fence import StepFence
from services.gpuworker.engine.local import run_until_done, submit
from services.gpuworker.engine.readback import Readback
from services.gpuworker.metrics import StepTally, WorkerMetrics
from test_engine_support import make_setup, prompts

FENCE_S = 0.01  # each slowed fence wait


@pytest.fixture
def slow_fences(monkeypatch):
    monkeypatch.setattr(StepFence, "wait", lambda self: time.sleep(FENCE_S))


def test_a_readbacks_wait_is_taken_once_however_often_it_is_read(slow_fences):
    r = Readback(torch.arange(4))
    assert r.values() == [0, 1, 2, 3] and r.values() == [0, 1, 2, 3]
    waited = r.take_wait()
    assert 2 * FENCE_S <= waited < 2 * FENCE_S + 0.5
    assert r.take_wait() == 0.0


def _reports(k: int, **config) -> list:
    """Every step's report of two greedy requests drafting ``k`` a step."""
    setup = make_setup("eagle3", chunk_size=64, max_batch_tokens=128, max_draft_tokens=3, **config)
    for i, p in enumerate(prompts((9, 14), seed=5)):
        submit(setup, f"r{i}", p, max_new_tokens=10, k=k)
    reports = []
    run_until_done(setup, on_step=reports.append)
    return reports


def _decode_steps(reports: list) -> list:
    return [r for r in reports if any(x.new_token_ids for x in r.results.values())
            and not any(x.prefill_tokens for x in r.results.values())]


def test_overlapped_plain_decode_steps_count_the_wait_for_the_last_steps_tokens(slow_fences):
    # a decode step that streams a lagging token read it back through its fence
    lagged = _decode_steps(_reports(0, overlap=True))
    assert len(lagged) >= 5
    assert all(r.device_wait_s >= FENCE_S for r in lagged)
    # without overlap no fence is read: the waits are the synchronous reads only
    plain = _decode_steps(_reports(0, overlap=False))
    assert len(plain) >= 5 and all(r.device_wait_s < FENCE_S for r in plain)


def test_fused_speculative_steps_count_the_wait_for_the_verdict_once(slow_fences):
    verified = [r for r in _decode_steps(_reports(3, overlap=True, graphs="pad", fused_spec=True))
                if any(x.acceptance_lengths for x in r.results.values())]
    assert len(verified) >= 3
    # one verdict read a step (continued or scheduled), never counted twice
    assert all(FENCE_S <= r.device_wait_s < 2 * FENCE_S + 0.5 for r in verified), [r.device_wait_s for r in verified]


def test_the_metric_splits_the_waits_by_kind_of_step():
    metrics = ServiceMetrics("gpuworker")
    m = WorkerMetrics(metrics, running=lambda: 0)
    decode = StepTally(0.003, 0.0, 64, 0, 0, 0, (), (), device_wait_s=0.002)
    prefill = StepTally(0.02, 0.0, 4, 512, 0, 0, (), (), device_wait_s=0.015)
    for tally in (decode, decode, prefill):
        m.record(tally)
    registry = metrics.registry
    name = "tandem_worker_device_wait_seconds_total"
    assert registry.get_sample_value(name, {"step": "decode"}) == pytest.approx(0.004)
    assert registry.get_sample_value(name, {"step": "prefill"}) == pytest.approx(0.015)
