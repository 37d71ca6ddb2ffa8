"""staging.py off CUDA: the same values, dtypes and devices as plain copies (the CPU suite's
engine runs every step through these helpers)."""

from __future__ import annotations

import numpy as np
import torch

from services.gpuworker.staging import copy_into, to_device

CPU = torch.device("cpu")


def test_to_device_from_a_list_and_from_numpy():
    a = to_device([3, 1, 4], torch.long, CPU)
    assert a.dtype == torch.long and a.tolist() == [3, 1, 4]
    b = to_device(np.array([1, 2], dtype=np.int64), torch.int32, CPU)
    assert b.dtype == torch.int32 and b.tolist() == [1, 2]
    assert to_device([], torch.long, CPU).numel() == 0


def test_copy_into_mutates_the_destination():
    dst = torch.zeros(3)
    assert copy_into(dst, torch.tensor([1.0, 2.0, 3.0])) is dst
    assert dst.tolist() == [1.0, 2.0, 3.0]
