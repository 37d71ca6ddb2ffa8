"""Which requests run in the next step, and how much of each: continuous batching under a
token budget. Pure functions over ``RequestState``; nothing here touches tensors.

Policy (first come, first served inside each class):

1. every decoding request feeds ``1 + k_eff`` target tokens (last accepted token + drafts), where
   ``k_eff`` is its draft count capped by what it may still generate (``draft_budget``) and by the
   budget left; decodes go first so running requests keep streaming;
2. prefilling requests then fill what is left of ``max_batch_tokens`` with chunks of at most
   ``chunk_size`` prompt positions each;
3. optionally (``prefill_wait_steps`` > 0, TGI's ``max_waiting_tokens``), new prompts wait while
   others decode, so that several are prefilled by one forward instead of one forward each::

       step:          s0      s0+1    ...   s0+wait            (s0: the oldest new prompt's admission)
       new prompts:   held    held          released           released at once when
                                                               ``prefill_batch`` of them wait,
                                                               or when nothing decodes

   A prompt already partly prefilled is never held (it is not new), and while one is, no new
   prompt is held either: that step prefills anyway, so new prompts join it (a released batch
   that did not fit one step's budget stays released).

Only target tokens are budgeted; draft-layer work follows from them (a few tokens per request).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from services.gpuworker.engine.request import RequestState


@dataclasses.dataclass(slots=True)
class ScheduledWork:
    """One request's share of a step: a prefill chunk ``[target_len, prefill_end)`` or a decode
    step verifying ``num_drafts`` drafts. Mutable: capacity shortfalls shrink it."""

    state: RequestState
    prefill_end: int | None = None
    num_drafts: int = 0
    # target_len when scheduled: the step's first target position (the state moves on mid-step)
    start: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.start = self.state.target_len

    @property
    def is_prefill(self) -> bool:
        return self.prefill_end is not None

    @property
    def num_target_tokens(self) -> int:
        if self.prefill_end is not None:
            return self.prefill_end - self.start
        return 1 + self.num_drafts

    @property
    def needed_capacity(self) -> int:
        """Positions this step writes up to (exclusive), in the target and the draft pool alike.

        Prefill writes target KV at ``[T, end)`` and draft KV below it. A decode step writes target
        KV at ``[L-1, L+k)`` and chains drafts at ``[L-1, L-1+k-1)``: both end by ``L + k``."""
        if self.prefill_end is not None:
            return self.prefill_end
        return self.state.logical_len + self.num_drafts


def draft_budget(state: RequestState, max_seq_len: int, ahead: int = 0) -> int:
    """Drafts worth proposing for ``state``'s next verify: its ``k``, capped so the verify's
    ``k + 1`` output tokens can neither pass ``max_new_tokens`` nor ``max_seq_len``; as if
    ``ahead`` more tokens were accepted first (a verdict not applied yet). Pure."""
    spec, n = state.spec, len(state.tokens)  # (the logical length; called per request and step)
    if not spec.k:
        return 0
    left_new = spec.max_new_tokens - (n - state.num_prompt) - ahead - 1
    left_seq = max_seq_len - n - ahead - 1
    return max(0, min(spec.k, left_new, left_seq))


def schedule(
    states: Iterable[RequestState],
    *,
    max_batch_tokens: int,
    max_batch_size: int,
    chunk_size: int,
    max_seq_len: int,
    step: int = 0,
    prefill_wait_steps: int = 0,
    prefill_batch: int = 1,
) -> list[ScheduledWork]:
    """Pick the work of one step (the engine's ``step``-th). ``states`` in arrival order;
    finished ones are skipped. Pure."""
    live = [s for s in states if not s.finished]
    decoding = [s for s in live if not s.in_prefill]
    prefilling = [s for s in live if s.in_prefill]
    if prefill_wait_steps and decoding:
        new = [s for s in prefilling if s.target_len == s.spec.reused_positions]  # no chunk run yet
        # A prompt partly prefilled means this step prefills anyway: holding the new ones then
        # saves no forward. It also keeps a released batch released when it did not fit one
        # step's budget (else its tail would wait ``prefill_wait_steps`` again, and again).
        chunk_running = len(new) < len(prefilling)
        if (new and not chunk_running and len(new) < prefill_batch
                and step - min(s.admitted_step for s in new) < prefill_wait_steps):
            prefilling = [s for s in prefilling if s.target_len != s.spec.reused_positions]  # new ones wait
    budget = max_batch_tokens
    work: list[ScheduledWork] = []
    for s in decoding:
        if len(work) >= max_batch_size or budget < 1:
            break
        k = min(draft_budget(s, max_seq_len), budget - 1)
        work.append(ScheduledWork(s, num_drafts=k))
        budget -= 1 + k
    for s in prefilling:
        if len(work) >= max_batch_size or budget < 1:
            break
        end = min(s.num_prompt, s.target_len + chunk_size, s.target_len + budget)
        work.append(ScheduledWork(s, prefill_end=end))
        budget -= end - s.target_len
    return work


def leading_decodes(work: list[ScheduledWork]) -> int:
    """How many rows of ``work`` are decodes: the scheduler puts them first, prompt chunks after."""
    return next((i for i, w in enumerate(work) if w.is_prefill), len(work))
