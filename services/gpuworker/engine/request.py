"""Requests as the engine sees them: the immutable ``RequestSpec`` a caller submits, and the
mutable ``RequestState`` the engine advances step by step.

The state keeps three lengths apart (they are different numbers almost all the time)::

    tokens        t[0] ........................................ t[L-1]      L = logical length
    target KV     [0 ............................. T)                       T = target_len
    draft KV      [0 ..................... F)                               F = draft_len
    capacity      [0 .......................................................... C)
                                            ^ positions >= F may hold speculative draft KV,
                                              positions >= T rejected target KV: garbage until
                                              rewritten; nothing reads past the logical length

* ``T`` counts positions whose target KV was computed from final tokens. During prefill
  ``T`` is the end of the last chunk; while decoding ``T = L - 1`` (the newest token has not
  been fed to the target yet).
* ``F`` counts positions whose draft KV (every draft layer) was computed from final tokens:
  ``F = min(T, L_known - D)`` where ``L_known`` counts tokens that are final (the whole prompt
  counts from the start). Positions ``< F`` are *publishable* (DESIGN §1).
* ``C`` is what the block source reserved; the engine extends it before a step needs it and trims
  it back after, and never writes past it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np
import torch

from services.gpuworker.engine.sampling import GREEDY, SamplingParams


PENDING = -1  # placeholder in RequestState.tokens for a token still on the device


class FinishReason(enum.Enum):
    """Why a request stopped. The first three match ``tandem.worker.v1.FinishReason``."""

    LENGTH = "length"  # max_new_tokens generated
    STOP = "stop"  # a stop token was generated (it is part of the output)
    MAX_SEQ_LEN = "max_seq_len"  # prompt + output reached the engine's max_seq_len
    CAPACITY = "capacity"  # the block source could not grow the reservation; no progress possible
    ERROR = "error"  # the request's first step failed; it alone was dropped (``Engine.step``)
    ABORT = "abort"  # ended early on request (Worker.Abort); the tokens so far are valid (not the engine's)


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeCounts:
    """A request's speculation counts so far: the one place they are kept (the engine's
    ``RequestState``) and the one formula read from them. Immutable snapshot; ``+`` pools
    several requests."""

    decode_steps: int = 0  # target forwards that produced tokens after the prompt (verify steps)
    proposed_drafts: int = 0
    accepted_drafts: int = 0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens a decode step produced: 1 + accepted drafts per step (1.0 before the
        first decode step, and always without speculation)."""
        return 1.0 + self.accepted_drafts / self.decode_steps if self.decode_steps else 1.0

    def __add__(self, other: "DecodeCounts") -> "DecodeCounts":
        return DecodeCounts(self.decode_steps + other.decode_steps, self.proposed_drafts + other.proposed_drafts,
                            self.accepted_drafts + other.accepted_drafts)

    def __reduce__(self):
        # An engine process pickles one per request and step (engine_process.PipeOutbox): a
        # slotted dataclass's own __getstate__ walks fields() each time, ~3x the cost of this.
        return DecodeCounts, (self.decode_steps, self.proposed_drafts, self.accepted_drafts)


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """What a caller submits. Immutable; validated by ``Engine.add_request``.

    ``block_table`` are the reservation's blocks in position order (its capacity is
    ``len(block_table) * block_size``); the first ``reused_positions`` positions already hold
    target and draft KV (prefix reuse) and are never recomputed. ``k`` draft tokens per step
    (0 = no speculation).
    """

    request_id: str
    prompt_ids: Sequence[int]
    block_table: Sequence[int]
    reused_positions: int = 0
    max_new_tokens: int = 16
    stop_ids: Sequence[int] = ()
    sampling: SamplingParams = GREEDY
    k: int = 0
    # Report each emitted token's raw target logprob and this many top alternatives (None = none).
    logprobs: int | None = None


@dataclasses.dataclass
class RequestState:
    """The engine's mutable view of one live request (see the module docstring for lengths)."""

    spec: RequestSpec
    tokens: list[int]
    block_table: list[int]
    block_size: int
    generator: torch.Generator
    target_len: int
    draft_len: int
    arrival: int  # admission order, for first-come-first-served scheduling
    admitted_step: int = 0  # the engine's step count when it was admitted (prefill batching)
    # Target conditioning rows for positions [draft_len, target_len): what the first draft layer
    # reads there (fused aux states for EAGLE-3, final hidden for MTP). Kept between steps
    # because the draft KV of those positions cannot be final yet. A list of row blocks in order,
    # concatenated only when a fill reads them (a k = 0 request adds one row a step).
    pending_hidden: list[torch.Tensor] = dataclasses.field(default_factory=list)
    # Proposals d_1..d_m for t[L..L+m) (int64 [m], on the model's device: no host sync needed
    # to feed them to the target), the draft distributions they were sampled from ([m, V]; None
    # for greedy), and the last draft layer's output hidden at the position before the next
    # chain position (EAGLE-style self-feeding). All None when nothing is proposed.
    drafts: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    chain_hidden: torch.Tensor | None = None
    # Overlapped steps (EngineConfig.overlap): the newest token of a plain greedy decode is left
    # on the device (``pending_token``, int64 [1]) while the next step is launched with it as
    # input; ``tokens[-1]`` holds PENDING until the next step reads the value back. ``last_step``
    # marks a request whose count-based limit (max_new_tokens / max_seq_len) that token reached:
    # it is not scheduled again, only resolved.
    pending_token: torch.Tensor | None = None
    last_step: bool = False
    proven: bool = False  # it took part in a step that completed (step-failure isolation)
    finish_reason: FinishReason | None = None
    # Penalties (``SamplingParams.penalized``): generated-token counts [V] (float32, on the
    # model's device) and the prompt's tokens [V] (bool; repetition penalty only). None otherwise.
    gen_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    decode_steps: int = 0
    accepted_drafts_total: int = 0
    proposed_drafts_total: int = 0
    _table_cache: tuple | None = dataclasses.field(default=None, repr=False, compare=False)
    # copies of the spec's, read per request many times a step: attributes, not properties
    request_id: str = dataclasses.field(init=False, repr=False, compare=False)
    num_prompt: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.request_id = self.spec.request_id
        self.num_prompt = len(self.spec.prompt_ids)

    def table_array(self) -> np.ndarray:
        """``block_table`` as an int64 array, converted once per table instead of once per
        forward (a speculative step lays out four forwards over the same tables). Tables are
        replaced, never changed in place, so the list's identity keys the cache."""
        cached = self._table_cache
        if cached is None or cached[0] is not self.block_table:
            array = np.asarray(self.block_table, dtype=np.int64)
            array.flags.writeable = False  # shared by every layout of the step
            cached = self._table_cache = (self.block_table, array)
        return cached[1]

    @property
    def counts(self) -> DecodeCounts:
        return DecodeCounts(self.decode_steps, self.proposed_drafts_total, self.accepted_drafts_total)

    @property
    def logical_len(self) -> int:
        """Accepted tokens: prompt + generated."""
        return len(self.tokens)

    @property
    def known_len(self) -> int:
        """Tokens whose values the host knows: ``logical_len`` less a pending token."""
        return len(self.tokens) - (self.pending_token is not None)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def capacity(self) -> int:
        """Reserved positions (whole blocks)."""
        return len(self.block_table) * self.block_size

    @property
    def in_prefill(self) -> bool:
        """True until the last prompt position has been fed to the target."""
        return self.target_len < self.num_prompt

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
