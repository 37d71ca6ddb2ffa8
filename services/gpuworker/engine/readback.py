"""Device tensors on their way to the host: an asynchronous copy into pinned memory and a fence,
so that the host waits only where it reads (``values()``), not where it asks for the copy. The
engine's two kinds: an overlapped plain-decode step's tokens (``LaggingTokens``) and a fused
speculative step's verdict (``fused.PendingVerdict``)."""

from __future__ import annotations

import time

import torch

from services.gpuworker.engine.fence import StepFence
from services.gpuworker.engine.request import RequestState


class Readback:
    """A device tensor on its way to the host: an asynchronous copy into pinned memory and the
    fence after it; ``values()`` waits for the fence only, and keeps how long it waited for
    ``take_wait`` (the engine's device-wait count: a step that waits ~0 is host-bound)."""

    def __init__(self, values: torch.Tensor):
        self._waited_s = 0.0
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
        else:
            self._host = values.clone()  # the CPU computed it already
        self._fence = StepFence.record(values.device)

    def values(self) -> list:
        started = time.perf_counter()
        self._fence.wait()
        self._waited_s += time.perf_counter() - started
        return self._host.tolist()

    def take_wait(self) -> float:
        """Seconds ``values`` waited for the device since the last call (mutates: each wait is
        taken once, however often the values are read)."""
        waited, self._waited_s = self._waited_s, 0.0
        return waited


class LaggingTokens(Readback):
    """One overlapped step's greedy tokens on their way to the host; ``entries`` are (request
    state, row) pairs."""

    def __init__(self, tokens: torch.Tensor):
        super().__init__(tokens)
        self.entries: list[tuple[RequestState, int]] = []
