"""Step fences: "the GPU step that last wrote these blocks has completed", without stopping the host.

DESIGN §2 lets a worker free blocks (Trim, Release, Abort) only after the step that last wrote them
completed on the device. Blocking the engine thread on ``torch.cuda.synchronize`` for that would
serialize host and device every step; instead each step records a fence (a CUDA event at the end of
its work on the stream) and the kvstore courier holds a freeing verb until the fence reports done,
which the engine thread asks (``done``: an event query, no wait) as it sends and drains::

    engine thread   step N: launch ─ verdict ─ launch fill ─ record fence N ─┐  step N+1: … verdict ─ done(N)? ─ ship
    device                    [ target N ][ fill N ]·fence N                 │                    Trim / Release / Abort
    carrier                                                                  └───────────────────▶ to the kvstore

The only host-device synchronisation left in a step is the accept/reject verdict.
"""

from __future__ import annotations

import time

import torch


class StepFence:
    """Completion of the device work queued before it. ``wait`` blocks until then (any thread);
    ``done`` polls. On the CPU every fence is complete when made (the work ran synchronously)."""

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event | None = None):
        self._event = event

    @classmethod
    def record(cls, device: torch.device, *, blocking: bool = False) -> "StepFence":
        """A fence after everything queued so far on ``device``'s current stream. ``blocking``:
        a thread waiting on it sleeps until the device gets there (``cudaEventBlockingSync``)
        instead of spinning in the driver. Right for a step's fence, which is asked ``done`` every
        turn and waited on only by an engine with nothing else to do (or a step that needs a
        kvstore answer now); wrong for a verdict the engine thread waits on every step, where a
        spin answers soonest."""
        if device.type != "cuda":
            return COMPLETE
        event = torch.cuda.Event(blocking=blocking)
        event.record(torch.cuda.current_stream(device))
        return cls(event)

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def wait_polling(self) -> None:
        """``wait`` for a thread that must answer as soon as the device gets there even when the
        fence was recorded ``blocking`` (a sleeping waiter wakes late): polls, yielding the GIL
        between polls."""
        while not self.done():
            time.sleep(0)

    def done(self) -> bool:
        return self._event is None or self._event.query()


COMPLETE = StepFence()
