"""Device tensors on their way to the host: an asynchronous copy into pinned memory and a fence,
so that the host waits only where it reads (``values()``), not where it asks for the copy. The
engine's two kinds: an overlapped plain-decode step's tokens (``LaggingTokens``) and a fused
speculative step's verdict (``fused.PendingVerdict``)."""

from __future__ import annotations

import torch

from services.gpuworker.engine.fence import StepFence
from services.gpuworker.engine.request import RequestState


class Readback:
    """A device tensor on its way to the host: an asynchronous copy into pinned memory and the
    fence after it; ``values()`` waits for the fence only."""

    def __init__(self, values: torch.Tensor):
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
        else:
            self._host = values.clone()  # the CPU computed it already
        self._fence = StepFence.record(values.device)

    def values(self) -> list:
        self._fence.wait()
        return self._host.tolist()


class LaggingTokens(Readback):
    """One overlapped step's greedy tokens on their way to the host; ``entries`` are (request
    state, row) pairs."""

    def __init__(self, tokens: torch.Tensor):
        super().__init__(tokens)
        self.entries: list[tuple[RequestState, int]] = []
