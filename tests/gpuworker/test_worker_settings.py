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

    monkeypatch.setattr(runtime, "KVStoreCourier", no_courier)
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
