"""The engine on a CUDA device with the torch backend in float32 (marker ``gpu``; deselected in CI).

Catches host/device mix-ups on the paths the CPU suite cannot see: proposals kept on the device,
uniforms drawn on the host and moved, rejection sampling batched on the device, the sync before
trim. Runs under pytest (``pytest -m gpu``) or as a plain script on a box without pytest plugins:
``PYTHONPATH=. python3 tests/gpuworker/test_engine_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from services.common.spec import SpecMode
from services.gpuworker.engine.engine import EngineConfig
from services.gpuworker.engine.local import build_local, run_until_done, submit
from services.gpuworker.engine.sampling import SamplingParams
from services.gpuworker.model.loader import load_model

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _setup(mode: SpecMode, depth: int = 1, **config):
    target, draft, _ = load_model("tiny", spec_mode=mode, mtp_depth=depth, device=DEV)
    return build_local(models=(target, draft), num_blocks=256, block_size=16, device=DEV,
                       config=EngineConfig(**{"chunk_size": 8, "max_batch_tokens": 32, **config}))


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 19, 33)]


@torch.inference_mode()
def _run(mode, depth, k, sampling=SamplingParams(), **config):
    setup = _setup(mode, depth, **config)
    for i, p in enumerate(_prompts()):
        submit(setup, f"r{i}", p, max_new_tokens=12, k=k, sampling=sampling)
    done = run_until_done(setup)
    assert setup.source.free_blocks == setup.source.num_blocks
    return [done[f"r{i}"] for i in range(3)]


@pytest.mark.parametrize("mode,depth", [(SpecMode.EAGLE3, 1), (SpecMode.MTP, 2)])
def test_speculative_greedy_on_cuda_matches_plain(mode, depth):
    plain = [c.tokens for c in _run(mode, depth, 0)]
    for k in (1, 3):
        assert [c.tokens for c in _run(mode, depth, k)] == plain
    forced = _run(mode, depth, 3, forced_acceptance=2)
    assert all(c.accepted_drafts > 0 for c in forced)
    top1 = _run(mode, depth, 3, SamplingParams(temperature=0.8, top_k=1, seed=3))
    assert [c.tokens for c in top1] == plain


@pytest.mark.parametrize("mode,depth", [(SpecMode.EAGLE3, 1), (SpecMode.MTP, 3)])
def test_sampled_speculation_on_cuda_is_reproducible(mode, depth):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    a = [c.tokens for c in _run(mode, depth, 4, params, trim_policy="rejected")]
    b = [c.tokens for c in _run(mode, depth, 4, params, trim_policy="rejected")]
    assert a == b and all(len(t) == 12 for t in a)


if __name__ == "__main__":
    for fn, cases in ((test_speculative_greedy_on_cuda_matches_plain, [(SpecMode.EAGLE3, 1), (SpecMode.MTP, 2)]),
                      (test_sampled_speculation_on_cuda_is_reproducible, [(SpecMode.EAGLE3, 1), (SpecMode.MTP, 3)])):
        for case in cases:
            fn(*case)
            print("ok", fn.__name__, case[0].name, case[1])
