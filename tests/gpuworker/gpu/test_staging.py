"""Host-to-device staging (services/gpuworker/staging.py) and a graph-mode re-plan never make
the host wait for kernels queued before them: a copy from pageable memory would (CUDA
synchronizes the stream first), which is what kept the step loop from running ahead."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.gpuworker.attention.base import AttentionGeometry, AttentionKind, BatchLayout
from services.gpuworker.attention.flashinfer_backend import FlashInferBackend
from services.gpuworker.staging import copy_into, to_device

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda", 0)
SLEEP_CYCLES = 2_000_000_000  # ~1 s of a spinning kernel: far longer than any of the calls below


def busy_device() -> torch.cuda.Event:
    """Queue a long kernel; the returned event completes when it has run."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    done = torch.cuda.Event()
    done.record()
    return done


def test_staged_copies_return_while_the_device_is_busy_and_land_intact():
    dst = torch.zeros(5, dtype=torch.long, device=DEV)
    done = busy_device()
    a = to_device([3, 1, 4, 1, 5], torch.long, DEV)
    b = to_device(np.arange(7, dtype=np.int32), torch.int32, DEV)
    c = to_device(np.full(3, 2.5), torch.float32, DEV)
    copy_into(dst, torch.tensor([9, 8, 7, 6, 5]))
    assert not done.query(), "a staged copy waited for the kernel queued before it"
    torch.cuda.synchronize()
    assert a.tolist() == [3, 1, 4, 1, 5] and a.device == DEV
    assert b.tolist() == list(range(7)) and b.dtype == torch.int32
    assert c.tolist() == [2.5, 2.5, 2.5]
    assert dst.tolist() == [9, 8, 7, 6, 5]


def test_a_graph_mode_replan_does_not_wait_for_the_device():
    geom = AttentionGeometry(num_qo_heads=4, num_kv_heads=2, head_dim=128, block_size=16, dtype=torch.bfloat16)
    backend = FlashInferBackend(DEV, geom, graph_max_pages_per_request=8)
    layout = BatchLayout([[0, 1, 2], [3, 4]], [20, 17], [1, 1])
    backend.plan(layout, AttentionKind.DECODE)  # the key's first plan (wrapper.plan) and its buffers
    torch.cuda.synchronize()
    done = busy_device()
    plan = backend.plan(BatchLayout([[0, 1, 2], [3, 4]], [21, 18], [1, 1]), AttentionKind.DECODE)
    assert not done.query(), "re-planning waited for the kernel queued before it"
    torch.cuda.synchronize()
    assert plan.kv_lens.tolist() == [22, 19]
    assert plan.positions.tolist() == [21, 18]
