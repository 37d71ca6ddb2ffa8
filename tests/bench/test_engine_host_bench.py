"""bench/engine_host_bench.py's harness: with the forwards nulled the engine still runs its real
per-step bookkeeping (every request moves by k + 1 tokens a step under forced acceptance, every
step fused), and the device-idle interval it reports lies inside the step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import engine_host_bench as ehb  # noqa: E402

from services.common.spec import SpecMode  # noqa: E402
from services.gpuworker.model.loader import load_model  # noqa: E402

STEPS = 12


@pytest.fixture(scope="module")
def models():
    target, draft, _ = load_model("tiny", spec_mode=SpecMode.EAGLE3, device="cpu", seed=0)
    return target, draft


@pytest.mark.parametrize("k, launch", [(3, "one"), (3, "split"), (0, "one")])
@torch.inference_mode()
def test_nulled_steps_move_every_request_as_real_ones(models, k, launch):
    row = ehb.run_case(models, 3, k, launch, STEPS)
    # the timed steps and the ten unmeasured ones before them (overlap: each step applies the
    # previous one's verdict or tokens, one on its way at either end)
    assert row["tokens_moved_per_request"] == [(STEPS + 10) * (k + 1)]
    assert row["batch"] == 3 and row["tokens_per_step"] == 3 * (k + 1)
    # the null forwards ran, once a step per forward of the launch
    want = {"target": STEPS + 10} if not k else (
        {"spec": STEPS + 10} if launch == "one" else {"spec_chain1": STEPS + 10, "spec_chain2": STEPS + 10, "spec_verify": STEPS + 10})
    assert row["null_calls"] == want
    if k:
        assert row["exposed_us"] is not None and 0 < row["exposed_us"] < row["total_us"]  # recorded, inside the step
    else:
        assert row["exposed_us"] is None


@pytest.mark.parametrize("launch", ["one", "split"])
@pytest.mark.parametrize("batch", [1, 4])
@torch.inference_mode()
def test_churn_ends_and_admits_requests_and_keeps_the_steps_fused(models, launch, batch):
    """``--churn``: requests end (their max_new_tokens spread) and the next ones arrive, their
    prompts prefilled for real beside the nulled decodes; every step runs fused (alone, a
    request's last token, with no draft budget left, is a plain decode), most of them launched
    from the last verdict before it is applied."""
    row = ehb.run_case(models, batch, 3, launch, 40, churn=True)
    assert row["churn"] and row["requests_ended"] >= 2
    assert row["fused_share"] >= (0.9 if batch == 1 else 1.0) and row["continued_share"] >= 0.6, row
    assert row["exposed_us"] is not None and 0 < row["exposed_us"] < row["total_us"]
    with pytest.raises(ValueError, match="k > 0"):
        ehb.run_case(models, 4, 0, launch, 30, churn=True)
