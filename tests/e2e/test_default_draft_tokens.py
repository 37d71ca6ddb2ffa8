"""The default number of draft tokens k is the worker's (issue 9): it advertises it in
``Worker.Info`` (its ``--num-draft-tokens``, else its draft folder's recommendation, else 3; 0
without a draft), and a router without a setting of its own asks each worker for its default.

Real kvstore, workers (tiny / demo model, torch backend, CPU) and router on loopback. The k a
worker ran with is observed through its Usage: with ``forced_acceptance`` every verify step
accepts all k drafts, so the mean acceptance length is exactly 1 + k when the token budget is a
whole number of steps (the first token comes from the prompt's forward, each step adds k + 1).
"""

from __future__ import annotations

import json
import shutil

import pytest

from services.gpuworker.model.loader import DEMO_DIR
from suite_rig import TIMEOUT
from tandem.worker.v1 import worker_pb2, worker_pb2_grpc


def _info(svc) -> worker_pb2.InfoResponse:
    return worker_pb2_grpc.WorkerStub(svc.channel).Info(worker_pb2.InfoRequest(), timeout=TIMEOUT)


def _demo_copy(tmp_path, recommends: int):
    """The demo model in a folder of its own whose draft records ``recommends``."""
    folder = tmp_path / f"demo-k{recommends}"
    if folder.is_dir():
        return folder
    shutil.copytree(DEMO_DIR, folder)
    config = folder / "eagle3" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_draft_tokens": recommends}))
    return folder


def test_info_reports_the_workers_default_k(suite, tmp_path):
    fast = {"warmup": False, "num_blocks": 64}
    cases = {
        "plain": ({"spec_mode": "none"}, 0),  # no draft: 0 (advertised, not left unset)
        "fallback": ({}, 3),  # the tiny model's random draft records nothing
        "flag": ({"num_draft_tokens": 2}, 2),
        "flag-zero": ({"num_draft_tokens": 0}, 0),
        "shipped-demo": ({"model": "demo"}, 3),  # services/gpuworker/demo_model/eagle3/config.json
        "recorded": ({"model": str(_demo_copy(tmp_path, 5))}, 5),
        "recorded-capped": ({"model": str(_demo_copy(tmp_path, 12)), "max_draft_tokens": 4}, 4),
        "flag-over-recorded": ({"model": str(_demo_copy(tmp_path, 5)), "num_draft_tokens": 1}, 1),
    }
    for name, (settings, want) in cases.items():
        info = _info(suite.add_worker(name, **fast, **settings))
        assert info.HasField("num_draft_tokens"), name
        assert info.num_draft_tokens == want, (name, info)
        assert info.num_draft_tokens <= info.max_draft_tokens


def _acceptance(suite, k_expected: int, **fields) -> float:
    steps = 4
    _, _, usage = suite.generate("Speculate, please: ", max_new_tokens=1 + steps * (k_expected + 1),
                                 ignore_eos=True, **fields)
    assert usage.completion_tokens == 1 + steps * (k_expected + 1)
    return usage.mean_acceptance_length


def test_a_request_without_k_runs_with_the_workers_default(suite):
    """Router unset: the worker's default (2); a request's own k wins (4, and 0)."""
    suite.add_worker("w0", num_draft_tokens=2, forced_acceptance=32)
    suite.add_router(model="tiny")
    assert _acceptance(suite, 2) == pytest.approx(3.0)
    assert _acceptance(suite, 4, num_draft_tokens=4) == pytest.approx(5.0)
    assert _acceptance(suite, 0, num_draft_tokens=0) == pytest.approx(1.0)
    stats = suite.wait_no_live_reservations()
    assert stats.live_reservations == 0 and suite.invariants().ok


def test_an_explicit_router_setting_wins_over_the_workers_default(suite):
    suite.add_worker("w0", num_draft_tokens=2, forced_acceptance=32)
    suite.add_router(model="tiny", num_draft_tokens=5)
    assert _acceptance(suite, 5) == pytest.approx(6.0)
    assert _acceptance(suite, 1, num_draft_tokens=1) == pytest.approx(2.0)  # the request's own over both
    assert suite.wait_no_live_reservations().live_reservations == 0


def test_greedy_output_with_the_workers_default_is_plain_greedy(suite):
    """The shipped demo model: a request without k runs at its draft's k = 3 (acceptance as
    with an explicit k = 3, above 1: it drafted) and greedy output is token for token k = 0's."""
    suite.add_worker("demo", model="demo", warmup=False, num_blocks=128)
    suite.add_router()  # --model auto: the demo model's byte tokenizer
    prompt = "import os\n\n\ndef main(argv):\n    "
    plain, _, u0 = suite.generate(prompt, max_new_tokens=40, num_draft_tokens=0)
    default, _, u_default = suite.generate(prompt, max_new_tokens=40)
    three, _, u3 = suite.generate(prompt, max_new_tokens=40, num_draft_tokens=3)
    assert default == plain == three
    assert u0.mean_acceptance_length == 1.0
    assert u_default.mean_acceptance_length == u3.mean_acceptance_length > 1.0
    assert u_default.decode_steps == u3.decode_steps < u0.decode_steps
    assert suite.wait_no_live_reservations().live_reservations == 0
