"""What one engine step tells its caller: per-request results and the capacity calls it made.

The worker service turns a report into kvstore verbs and client messages:

* ``new_token_ids`` → stream to the client;
* ``publishable_positions`` → ``Publish`` the full blocks below it (``publishable_blocks``);
* ``extend`` / ``trim`` → already issued through the ``BlockSource`` (at most one batched call
  each per step); the report repeats what was asked and the new tables;
* ``finish_reason`` → ``Release`` (or ``Abort`` for ``CAPACITY`` and ``ERROR``) — the engine has dropped the
  request, and every step that wrote its blocks has completed.
"""

from __future__ import annotations

import dataclasses

from services.gpuworker.engine.fence import COMPLETE, StepFence

from services.gpuworker.engine.request import DecodeCounts, FinishReason
from services.gpuworker.engine.sampling import TokenLogprob


@dataclasses.dataclass
class RequestStepResult:
    """One request's outcome of one step. Plain data."""

    request_id: str
    new_token_ids: list[int]
    # Draft tokens verified and how many of them were accepted (0/0 without a verify), over the
    # verifies whose tokens this report carries: the step's own, and with overlapped fused steps
    # also the previous step's verdict, read back at this step's start (``acceptance_lengths``
    # has one entry per verify).
    proposed_drafts: int
    accepted_drafts: int
    logical_len: int  # prompt + generated tokens after the step
    target_len: int  # positions with final target KV
    publishable_positions: int  # positions whose target AND draft KV are final (DESIGN §1)
    block_table: list[int]  # the table after this step's extend/trim
    block_size: int
    blocks_written: list[int]  # ids of blocks this step wrote KV into (either pool), ascending
    capacity_before: int  # reserved positions when the step started
    capacity_after: int  # reserved positions after extend/trim
    prefill_tokens: int = 0  # prompt positions the target computed this step
    verified: bool = False  # a decode (verify) step ran: new tokens came from a target forward
    finish_reason: FinishReason | None = None
    # What the block source answered when it could not extend this request: the step then ran
    # smaller (fewer drafts, a shorter chunk) or, with FinishReason.CAPACITY, not at all.
    error: Exception | None = None
    # the request's totals after this step (the engine keeps them; callers read, never recount)
    counts: DecodeCounts = DecodeCounts()
    # one per new token (same order) when the request asked for logprobs, else None
    new_logprobs: list[TokenLogprob] | None = None
    acceptance_lengths: tuple[int, ...] = ()  # 1 + accepted drafts, per verify reported here

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def publishable_blocks(self) -> list[int]:
        """Full blocks whose every position is publishable, in position order."""
        return self.block_table[: self.publishable_positions // self.block_size]


@dataclasses.dataclass
class StepReport:
    """Everything one ``Engine.step()`` did."""

    results: dict[str, RequestStepResult]
    extend_wants: dict[str, int]  # the one batched extend call (empty: no call)
    trim_keeps: dict[str, int]  # the one batched trim call (empty: no call)
    target_tokens: int  # tokens fed to the target (budgeted)
    draft_tokens: int  # tokens fed to draft layers (catch-up + chain)
    # completes when the step's device work has: free nothing it wrote before (fence.py)
    fence: StepFence = COMPLETE
    # Of the step's wall time, how long the engine thread waited for the device (reading back a
    # step's tokens or verdict). Near the step's time: the device bounds it; near 0: the host
    # does (every forward was done before the host asked), and host time is what to cut.
    device_wait_s: float = 0.0

    @property
    def finished(self) -> list[str]:
        return [rid for rid, r in self.results.items() if r.finished]
