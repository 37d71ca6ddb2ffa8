"""Host-to-device copies that never make the host wait for the device.

A copy from pageable host memory to a CUDA device (``torch.tensor(values, device="cuda")``, or
``copy_`` from a tensor numpy made) is synchronous in CUDA's sense: the stream is synchronized
before the copy starts, so the host waits for every kernel queued before it. In a step loop
that is one hidden sync per copy: on the H200 (session 25, ``bench/profile_step.py``) 44 of
them in a speculative step at batch 1 held the host 1.7 ms of a 4.6 ms step, and 165 at batch
64 held it 3.0 ms of 15; the host could never run ahead of the device.

These helpers copy through pinned memory with ``non_blocking=True`` instead: the call returns
as soon as the copy is queued. The pinned tensors come from torch's caching host allocator,
which records an event for every non-blocking copy and reuses a block only after its copy ran,
so a staging tensor may be dropped right after the copy is queued. On other devices (CPU) both
are plain copies.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new tensor of ``values`` (a list or a numpy array) on ``device``; queued, not waited
    for, on CUDA. Pure."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    if isinstance(values, np.ndarray):
        return torch.from_numpy(values).to(dtype).pin_memory().to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(host)`` for a CPU ``host`` tensor, queued, not waited for, when ``dst`` is
    on CUDA. Mutates and returns ``dst``."""
    if dst.device.type != "cuda" or host.device.type == "cuda":
        return dst.copy_(host)
    return dst.copy_(host if host.is_pinned() else host.pin_memory(), non_blocking=True)


__all__ = ["copy_into", "to_device"]
