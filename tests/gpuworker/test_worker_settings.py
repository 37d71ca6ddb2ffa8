"""Worker settings whose defaults depend on the device (step budget, prefill chunk, GIL interval)."""

import sys

import pytest
from pydantic import ValidationError

from services.gpuworker.build import engine_config
from services.gpuworker.settings import WorkerSettings


def test_step_budget_defaults_follow_the_device():
    cpu = WorkerSettings(device="cpu")
    assert (cpu.step_tokens, cpu.prefill_chunk) == (256, 64)
    # on CUDA a prefill chunk is one eager forward whatever its size: one chunk per prompt
    gpu = WorkerSettings(device="cuda:0", backend="flashinfer", dtype="bfloat16")
    assert (gpu.step_tokens, gpu.prefill_chunk) == (2048, 2048)
    cfg = engine_config(gpu)
    assert (cfg.max_batch_tokens, cfg.chunk_size) == (2048, 2048)


def test_explicit_step_budget_wins_on_every_device():
    s = WorkerSettings(device="cuda:0", max_batch_tokens=512, chunk_size=128)
    assert (s.step_tokens, s.prefill_chunk) == (512, 128)
    s = WorkerSettings(device="cuda:0", max_batch_tokens=512)
    assert s.prefill_chunk == 512
    s = WorkerSettings(device="cpu", chunk_size=8)
    assert (s.step_tokens, s.prefill_chunk) == (256, 8)


@pytest.mark.parametrize("bad", [0, -1.0, 1000])
def test_gil_switch_interval_is_bounded(bad):
    with pytest.raises(ValidationError):
        WorkerSettings(gil_switch_interval_ms=bad)


def test_gil_switch_interval_is_applied_where_the_engine_runs(monkeypatch):
    from services.gpuworker import runtime

    seen = []
    monkeypatch.setattr(sys, "setswitchinterval", seen.append)

    class Stop(Exception):
        pass

    def no_courier(*a, **k):  # stop right after the interval is set: nothing else is under test
        raise Stop

    monkeypatch.setattr(runtime, "build_courier", no_courier)
    with pytest.raises(Stop):
        runtime.build_runtime(WorkerSettings(gil_switch_interval_ms=0.5), link=None)
    assert seen == [0.0005]


def test_the_engine_gets_its_own_process_on_cuda_by_default():
    assert WorkerSettings(device="cuda:0").separate_engine_process
    assert not WorkerSettings(device="cpu").separate_engine_process
    assert WorkerSettings(device="cpu", engine_process=True).separate_engine_process
    assert not WorkerSettings(device="cuda:0", engine_process=False).separate_engine_process


def test_dtype_auto_follows_the_device():
    from services.gpuworker.build import model_dtype
    import torch

    assert WorkerSettings(device="cpu").torch_dtype_name == "float32"
    assert WorkerSettings(device="cuda:0", backend="flashinfer").torch_dtype_name == "bfloat16"
    assert model_dtype(WorkerSettings(device="cuda:1")) is torch.bfloat16
    assert WorkerSettings(device="cpu", dtype="bfloat16").torch_dtype_name == "bfloat16"  # explicit wins
    with pytest.raises(ValidationError, match="flashinfer backend runs bfloat16 or float16"):
        WorkerSettings(device="cuda:0", backend="flashinfer", dtype="float32")


# ------------------------------------------------------------------------- default draft tokens k
def test_default_draft_tokens_come_from_the_flag_then_the_draft_then_three():
    from services.common.spec import DEFAULT_DRAFT_TOKENS

    s = WorkerSettings()  # no --num-draft-tokens
    assert s.num_draft_tokens is None
    assert s.default_draft_tokens(None, has_draft=True) == DEFAULT_DRAFT_TOKENS == 3
    assert s.default_draft_tokens(5, has_draft=True) == 5  # the draft folder's recommendation
    assert s.default_draft_tokens(0, has_draft=True) == 0  # a draft may recommend plain decoding
    assert s.default_draft_tokens(20, has_draft=True) == s.max_draft_tokens == 8  # capped, not refused
    assert WorkerSettings(max_draft_tokens=2).default_draft_tokens(None, has_draft=True) == 2
    flag = WorkerSettings(num_draft_tokens=2)
    assert flag.default_draft_tokens(5, has_draft=True) == 2  # the flag wins over the draft
    assert flag.default_draft_tokens(None, has_draft=False) == 0  # nothing to draft with
    assert WorkerSettings(spec_mode="none").default_draft_tokens(None, has_draft=False) == 0


@pytest.mark.parametrize("bad, match", [
    ({"num_draft_tokens": -1}, "greater than or equal to 0"),
    ({"num_draft_tokens": 9}, r"--num-draft-tokens 9 exceeds --max-draft-tokens 8"),
    ({"num_draft_tokens": 3, "max_draft_tokens": 2}, r"exceeds --max-draft-tokens 2"),
    ({"num_draft_tokens": 1, "spec_mode": "none"}, "needs a draft"),
])
def test_bad_num_draft_tokens_are_refused(bad, match):
    with pytest.raises(ValidationError, match=match):
        WorkerSettings(**bad)
    WorkerSettings(num_draft_tokens=0, spec_mode="none")  # 0 without a draft is what it gets anyway


def test_num_draft_tokens_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_WORKER_NUM_DRAFT_TOKENS", "2")
    assert WorkerSettings().num_draft_tokens == 2


def test_a_bad_num_draft_tokens_stops_the_worker_with_one_line():
    """Refused at start, before any model is loaded: exit 2 and one ``error:`` line."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(PYTHONPATH=str(root), TANDEM_WORKER_NUM_DRAFT_TOKENS="9")
    proc = subprocess.run([sys.executable, "-m", "services.cli", "worker", "--model", "tiny"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "--num-draft-tokens 9 exceeds --max-draft-tokens 8" in lines[0], proc.stderr
