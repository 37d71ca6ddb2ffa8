"""The engine: batched steps of chunked prefill and speculative decoding over paired paged KV.

One ``step()`` runs, for the requests the scheduler picked::

    0. capacity   one batched BlockSource.extend for requests whose step writes past capacity
    A. chain      draft proposals beyond the fill's (EAGLE-3: d2..dk; MTP: d_(K+1)..dk)
    B. target     one forward over [prefill chunks | t[L-1], d1..dk | ...] (request-major)
    C. accept     first token after a prompt; greedy / rejection-sampled / forced verification;
                  stop tokens, max_new_tokens, max_seq_len
    D. fill       draft layers over the newly final positions (+ d1 or d1..dK for next step)
    E. trim       after the step completed: one batched BlockSource.trim of unneeded tail blocks

A decode step of request r with L accepted tokens and k drafts::

    positions:   ...  L-2 | L-1    L     ...   L+k-1 | L+k ...
    target KV:   final    | t[L-1] d1    ...   dk    |            written in B (k+1 positions)
    draft KV:    final    | chain (A): T .. T+k-1-D  |            speculative
    capacity needed: L + k   (decided before the step, so one extend suffices)

A greedy EAGLE-3 step's A-D run as one forward with graphs on (``fused.py``, ``spec_step.py``),
and with overlap the next one is launched before this one's verdict is applied.

The engine is synchronous and deterministic (on CPU): a request's tokens depend on its own seed
and logits only. It is not thread-safe; the worker service owns one engine and calls it from one
thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

import torch

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, TandemError, Unavailable
from services.common.spec import SpecMode
from services.gpuworker.attention.base import AttentionBackend, AttentionKind, BatchLayout
from services.gpuworker.engine.acceptance import accept_greedy, accept_sampled_batch
from services.gpuworker.engine.capacity import BlockSource, blocks_for
from services.gpuworker.engine.drafting import DraftRunner, FillJob
from services.gpuworker.engine.fence import COMPLETE, StepFence
from services.gpuworker.engine.fused import FusedCarry, FusedSteps, PendingVerdict
from services.gpuworker.engine.graphs import ForwardGraphs, buckets_up_to
from services.gpuworker.engine.report import RequestStepResult, StepReport
from services.gpuworker.engine.request import PENDING, FinishReason, RequestSpec, RequestState
from services.gpuworker.engine.sampling import (
    SamplingParams, TokenLogprob, apply_penalties, draw_uniforms, make_generator, probs_from_logits, sample_rows,
    token_logprobs,
)
from services.gpuworker.engine.readback import LaggingTokens
from services.gpuworker.engine.scheduler import ScheduledWork, draft_budget, leading_decodes, schedule
from services.gpuworker.engine.spec_step import chain_position_forward, spec_lanes, spec_step_forward, verify_fill_forward
from services.gpuworker.kv.pool import KVPool
from services.gpuworker.model.draft import DraftModel
from services.gpuworker.model.llama import TargetModel
from services.gpuworker.staging import to_device

log = logging.getLogger(__name__)

TRIM_POLICIES = ("unneeded", "rejected")
MAX_LOGPROBS = 20  # top alternatives per token at most (OpenAI's top_logprobs limit)
GRAPH_MODES = ("off", "pad", "capture")
FUSED_GRAPHS = ("one", "split")  # how a fused speculative step launches (spec_step.py)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. Immutable; validated on construction (``InvalidArgument``).

    * ``max_batch_tokens``: target tokens per step (prefill chunks + 1 + k per decode).
    * ``chunk_size``: prompt positions per request per step.
    * ``max_draft_tokens``: the largest ``k`` a request may ask for.
    * ``max_seq_len``: prompt + output limit; None = the model's.
    * ``forced_acceptance``: BENCHMARKS ONLY, never set by default. Accept exactly
      ``min(a, k_eff)`` drafts every verify, whatever they are, then take the target's token after
      them. Output is no longer the target's; it only pins the acceptance length for timing.
    * ``trim_policy``: ``"unneeded"`` (default) trims blocks past the most a request can still
      write (``prompt + max_new_tokens - 1`` positions, capped by max_seq_len);
      ``"rejected"`` additionally trims, after every verify, the blocks past the logical length —
      those held only rejected drafts — and the next step extends again.
    * ``graphs``: ``"capture"`` replays CUDA graphs of the uniform forwards (plain decode, verify,
      draft chain; see ``graphs.py``), captured by :meth:`Engine.warmup`; ``"pad"`` pads those
      batches to the same buckets but runs them eagerly (CPU tests of the padded layouts);
      ``"off"`` neither. Both others keep the pools' LAST page as the scratch page of padding
      rows: the block source must hand out ids below ``Engine.num_blocks`` only.
    * ``graph_max_batch``: the largest bucket (None = ``max_batch_size``).
    * ``check_graph_inputs``: DEBUGGING, off by default (a sync per input per run): before every
      padded run or graph replay, check that token ids and row indices over the whole padded
      batch are in range and raise ``InvalidArgument`` naming the bad row instead of letting a
      replay hit a device-side assert (``ForwardGraphs.check_inputs``; also turned on by
      ``TANDEM_CHECK_GRAPH_INPUTS=1`` in the environment).
    * ``overlap``: overlapped steps. When every row of a step is a plain greedy decode (k = 0,
      no drafts), its tokens stay on the device: the next step is launched with them as inputs
      before the host reads them back (one step later), so the host plans step N+1 while the
      device runs step N. Output is token-identical; a stop token is then seen one step late
      (that step's extra token is dropped, never emitted).
    * ``fused_spec``: with graphs (``"capture"`` or ``"pad"``) and an EAGLE-3 draft, a step whose
      decode rows are all greedy runs them as ONE forward (chain, verify, the verdict and the
      fill on the device; ``spec_step.py``): one graph launch and one read-back instead of
      k + 1 of each. Every row verifies the batch's largest k; one with a smaller budget (near
      its max_new_tokens) keeps at most its own. Output is token-identical; off runs the phases one by one. With
      ``overlap`` the verdict is read at the start of the next step (tokens stream one step
      later), so the caller's work between steps runs while the device does.
    * ``fused_graphs``: how a fused step launches (``spec_step.py``): ``"split"`` (default), each
      chain position launched right after its own plan and the verify, verdict and fill last, so
      the device runs while the later plans are made, or ``"one"`` forward after all k plans.
      Output is the same; ``"split"`` captures (k_max - 1) more graphs per bucket and was the
      faster on an H100 (step ÷ its parts 1.11-1.16 against 1.20-1.24).
    * ``prefill_wait_steps`` / ``prefill_batch``: new prompts wait up to this many steps while
      other requests decode, or until ``prefill_batch`` of them wait, so that one forward
      prefills several (``scheduler.schedule``; 0 = every prompt starts at once). Trades up to
      that many steps of first-token latency for fewer eager prompt forwards between decodes.
    """

    max_batch_tokens: int = 256
    chunk_size: int = 64
    max_batch_size: int = 64
    max_draft_tokens: int = 8
    max_seq_len: int | None = None
    forced_acceptance: int | None = None
    trim_policy: str = "unneeded"
    graphs: str = "off"
    graph_max_batch: int | None = None
    check_graph_inputs: bool = False
    overlap: bool = False
    fused_spec: bool = True
    fused_graphs: str = "split"
    prefill_wait_steps: int = 0
    prefill_batch: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.prefill_wait_steps, int) or self.prefill_wait_steps < 0:
            raise InvalidArgument(f"prefill_wait_steps must be an integer >= 0, got {self.prefill_wait_steps!r}")
        for name in ("chunk_size", "max_batch_size", "prefill_batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.max_draft_tokens, int) or self.max_draft_tokens < 0:
            raise InvalidArgument(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens!r}")
        if not isinstance(self.max_batch_tokens, int) or self.max_batch_tokens < 1 + self.max_draft_tokens:
            raise InvalidArgument(
                f"max_batch_tokens ({self.max_batch_tokens!r}) must fit one verify of "
                f"1 + max_draft_tokens ({1 + self.max_draft_tokens}) tokens"
            )
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 2):
            raise InvalidArgument(f"max_seq_len must be an integer >= 2, got {self.max_seq_len!r}")
        if self.forced_acceptance is not None and (
            not isinstance(self.forced_acceptance, int) or self.forced_acceptance < 0
        ):
            raise InvalidArgument(f"forced_acceptance must be None or >= 0, got {self.forced_acceptance!r}")
        if self.trim_policy not in TRIM_POLICIES:
            raise InvalidArgument(f"trim_policy must be one of {TRIM_POLICIES}, got {self.trim_policy!r}")
        if self.graphs not in GRAPH_MODES:
            raise InvalidArgument(f"graphs must be one of {GRAPH_MODES}, got {self.graphs!r}")
        if self.fused_graphs not in FUSED_GRAPHS:
            raise InvalidArgument(f"fused_graphs must be one of {FUSED_GRAPHS}, got {self.fused_graphs!r}")
        if self.graph_max_batch is not None and (not isinstance(self.graph_max_batch, int) or self.graph_max_batch < 1):
            raise InvalidArgument(f"graph_max_batch must be None or >= 1, got {self.graph_max_batch!r}")


class Engine(FusedSteps):
    """Continuous-batching speculative decoder over one target (+ optional draft) and its pools.

    ``add_request`` / ``abort`` between steps; ``step()`` advances every scheduled request and
    returns a ``StepReport``. All three mutate the engine; ``step`` also mutates both KV pools and
    calls the block source (at most one ``extend`` and one ``trim``)."""

    def __init__(
        self,
        target: TargetModel,
        draft: DraftModel | None,
        backend: AttentionBackend,
        target_pool: KVPool,
        draft_pool: KVPool | None,
        block_source: BlockSource,
        config: EngineConfig = EngineConfig(),
    ):
        if (draft is None) != (draft_pool is None):
            raise InvalidArgument("a draft model needs a draft pool and vice versa")
        if draft_pool is not None and (
            draft_pool.num_blocks != target_pool.num_blocks or draft_pool.block_size != target_pool.block_size
        ):
            raise InvalidArgument("draft and target pools must pair: same num_blocks and block_size")
        if backend.geometry.block_size != target_pool.block_size:
            raise InvalidArgument("backend and pools disagree on block_size")
        self.target = target
        self.backend = backend
        self.target_pool = target_pool
        self.block_source = block_source
        self.config = config
        self.block_size = target_pool.block_size
        self.device = target_pool.device
        self.graphs = self._make_graphs(target, draft, draft_pool)
        # padding rows of graph batches write the last page of each pool: never handed out
        self.num_blocks = target_pool.num_blocks - (1 if self.graphs is not None else 0)
        self.drafter = (
            DraftRunner(draft, backend, draft_pool, self.device, graphs=self.graphs) if draft is not None else None
        )
        self.span = draft.span if draft is not None else 0
        model_max = target.config.max_seq_len
        self.max_seq_len = min(config.max_seq_len or model_max, model_max)
        self._states: dict[str, RequestState] = {}
        self._arrivals = 0
        self._steps = 0  # steps run (prefill batching counts waits in steps)
        # completion of the last step's device work: a block it wrote is freed only after it
        self.last_fence: StepFence = COMPLETE
        self._lagging: LaggingTokens | None = None  # overlap: the last step's tokens, on their way
        self._device_wait_s = 0.0  # the running step's waits for the device (StepReport.device_wait_s)
        self._committed = False  # this step moved request state (tokens, lengths): see step()
        self._in_step: list[RequestState] = []  # the states the running step scheduled
        self._ledger: dict[str, _Ledger] = {}  # the running step's record of each live request
        self._carry: FusedCarry | None = None  # the last fused step's proposals, batched
        self._constant_rows: dict[tuple[int, int], torch.Tensor] = {}  # (batch, value) -> a fused step's forced or cap rows
        self._verdict: PendingVerdict | None = None  # overlap: the last fused step's, on its way
        self.fused_steps = 0  # steps whose decodes ran as one fused speculative forward (``_launch_fused``)
        self.continued_steps = 0  # of those, launched before the last one's verdict was applied (``_continue_fused``)

    def _make_graphs(self, target: TargetModel, draft: DraftModel | None, draft_pool: KVPool | None) -> ForwardGraphs | None:
        """The padded/captured uniform forwards (None with ``graphs="off"``): the target over
        decode and verify batches (q = 1 .. max_draft_tokens + 1), the draft chain (q = 1) and the
        EAGLE-3 fill after a verify (q = 1 .. max_draft_tokens + 1)."""
        cfg = self.config
        if cfg.graphs == "off":
            return None
        if self.target_pool.num_blocks < 2:
            raise InvalidArgument("graph padding needs a pool of at least 2 blocks (one is the scratch page)")
        graphs = ForwardGraphs(
            self.backend,
            scratch_block=self.target_pool.num_blocks - 1,
            buckets=buckets_up_to(cfg.graph_max_batch or cfg.max_batch_size),
            capture=cfg.graphs == "capture",
            check_inputs=True if cfg.check_graph_inputs else None,  # None: TANDEM_CHECK_GRAPH_INPUTS
        )
        aux = DraftRunner.aux_layers_for(draft)
        vocab = target.config.vocab_size
        backend, pool = self.backend, self.target_pool
        hidden = target.config.hidden_size
        dtype = target.embed_tokens.weight.dtype

        def target_forward(plan, ids):
            out = target(ids, plan, backend, pool, aux_layers=aux)
            rows = {"logits": out.logits, "hidden": out.hidden}
            if out.aux_hidden is not None:
                rows["aux"] = out.aux_hidden
            return rows

        max_q = min(1 + (cfg.max_draft_tokens if draft is not None else 0), self.block_size)
        graphs.register("target", target_forward, {"ids": ((), torch.long)}, range(1, max_q + 1), bounds={"ids": vocab})
        if draft is not None:
            chain = DraftRunner.chain_forward(draft, backend, draft_pool)
            # the chain reads back the draft's own output hidden: an EAGLE-3 layer's width may
            # differ from the target's (``Eagle3Draft``: own ``hidden_size``)
            graphs.register("chain", chain, {"tokens": ((), torch.long), "hidden": ((draft.chain_hidden_size,), dtype)}, (1,),
                            bounds={"tokens": vocab})
        if draft is not None and draft.spec_mode is SpecMode.EAGLE3:
            # the fill after a verify: 1 .. k + 1 accepted rows per request, padded to the longest
            fill = DraftRunner.fill_forward(draft, backend, draft_pool)
            graphs.register("fill", fill, {"ids": ((), torch.long), "context": ((3 * hidden,), dtype),
                                           "last": ((), torch.long)}, range(1, max_q + 1), per_request=("last", "logits"),
                            bounds={"ids": vocab, "last": lambda batch, q: batch * q})
            verdict = ("drafts", "target", "accepted", "next_draft", "next_hidden")
            if cfg.fused_spec and max_q > 1 and cfg.fused_graphs == "one":
                # a whole greedy speculative step as one forward over k plans (spec_step.py)
                step = spec_step_forward(target, draft, backend, pool, draft_pool, aux)
                inputs = {"last": ((), torch.long), "d1": ((), torch.long), "forced": ((), torch.long),
                          "cap": ((), torch.long), "hidden": ((draft.chain_hidden_size,), dtype)}
                graphs.register("spec", step, inputs, range(1, max_q), lanes=spec_lanes, bounds={"last": vocab, "d1": vocab},
                                per_request=(*inputs, *verdict))
            elif cfg.fused_spec and max_q > 1:
                # the same step as k forwards: chain position j on lane j, then the verify + fill
                position = chain_position_forward(draft, backend, draft_pool)
                for j in range(1, max_q - 1):
                    graphs.register(f"spec_chain{j}", position, {"tokens": ((), torch.long),
                                    "hidden": ((draft.chain_hidden_size,), dtype)}, (1,), bounds={"tokens": vocab}, lane=j)
                graphs.register("spec_verify", verify_fill_forward(target, draft, backend, pool, draft_pool, aux),
                                {"ids": ((), torch.long), "forced": ((), torch.long), "cap": ((), torch.long)},
                                range(2, max_q + 1), per_request=("forced", "cap", *verdict), bounds={"ids": vocab})
        return graphs

    @torch.inference_mode()
    def warmup(self, progress=None) -> int:
        """Run every kernel family once and capture the graphs (``graphs="capture"``), so the
        first request pays for neither JIT compilation nor capture. Writes only the scratch page.
        Returns the number of graphs captured; a no-op without a scratch page."""
        if self.graphs is None:
            return 0
        say = progress or (lambda msg: None)
        scratch = self.graphs.scratch_block
        n = min(3, self.block_size)
        plan = self.backend.plan(BatchLayout(block_tables=[[scratch]], cached_lens=[0], query_lens=[n]))
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        aux = self.drafter.target_aux_layers if self.drafter is not None else ()
        out = self.target(ids, plan, self.backend, self.target_pool, aux_layers=aux)
        if self.drafter is not None:
            self.drafter.warmup(plan, ids, out.aux_hidden if aux else out.hidden)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        say("prefill kernels ready")
        count = self.graphs.capture_all(say)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return count

    # -- request lifecycle ------------------------------------------------------------------------

    def add_request(self, spec: RequestSpec) -> None:
        """Admit a request (joins the next step). Validates it (``InvalidArgument``,
        ``AlreadyExists``); its positions below ``reused_positions`` are never recomputed."""
        self._validate(spec)
        r = spec.reused_positions
        gen_counts = prompt_mask = None
        if spec.sampling.penalized:
            vocab = self.target.config.vocab_size
            gen_counts = torch.zeros(vocab, dtype=torch.float32, device=self.device)
            if spec.sampling.repetition_penalty != 1.0:
                prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
                prompt_mask[to_device(list(spec.prompt_ids), torch.long, self.device)] = True
        self._states[spec.request_id] = RequestState(
            spec=spec,
            tokens=[int(t) for t in spec.prompt_ids],
            block_table=[int(b) for b in spec.block_table],
            block_size=self.block_size,
            generator=make_generator(spec.sampling, spec.request_id),
            target_len=r,
            draft_len=r,
            arrival=self._arrivals,
            admitted_step=self._steps,
            gen_counts=gen_counts,
            prompt_mask=prompt_mask,
        )
        self._arrivals += 1

    def abort(self, request_id: str) -> None:
        """Drop a live request (between steps, so no step of the engine is writing its blocks).
        The caller ends its reservation. ``NotFound`` for unknown ids."""
        if self._states.pop(request_id, None) is None:
            raise NotFound(f"unknown request {request_id!r}")

    def has_work(self) -> bool:
        return bool(self._states)

    def remap_blocks(self, request_id: str, block_table) -> None:
        """Adopt the kvstore's block table after a Publish deduplicated some of this request's
        blocks (another request had published the same keys first; the kvstore pinned that copy
        and freed ours). Only blocks whose every position is publishable may change — their KV is
        identical by the publish invariant — so later reads see the same values. Mutates the
        request's table; ``NotFound`` / ``FailedPrecondition`` otherwise, changing nothing."""
        s = self._states.get(request_id)
        if s is None:
            raise NotFound(f"unknown request {request_id!r}")
        new = list(map(int, block_table))
        # the kvstore's table may be longer or shorter by now (an Extend or a Trim answered
        # since): only the positions both know are remapped
        n = min(len(new), len(s.block_table))
        if new[:n] == s.block_table[:n]:
            return  # nothing deduplicated: the usual answer (one per Publish)
        self._check_only_final_blocks_moved(s, new[:n])
        s.block_table = new[:n] + s.block_table[n:]

    def adopt_table(self, request_id: str, block_table) -> bool:
        """Adopt the kvstore's newer table for a request: an ahead-of-need Extend's answer (more
        blocks at the end), possibly with deduplicated final blocks (as ``remap_blocks``). A
        table shorter than the request's own is stale and ignored; so is an unknown (finished)
        request. Returns whether the table was adopted; ``FailedPrecondition`` (changing
        nothing) if a non-final block moved."""
        s = self._states.get(request_id)
        new = [int(b) for b in block_table]
        if s is None or len(new) < len(s.block_table):
            return False
        self._check_only_final_blocks_moved(s, new)
        s.block_table = new
        return True

    def _check_only_final_blocks_moved(self, s: RequestState, new: list[int]) -> None:
        old = s.block_table
        m = min(len(old), len(new))
        if old[:m] == new[:m]:
            return  # the usual answer: the same blocks, more (or fewer) of them
        final_blocks = s.draft_len // self.block_size
        changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
        if changed and changed[-1] >= final_blocks:
            raise FailedPrecondition(
                f"{s.request_id}: the kvstore moved block {changed[-1]}, past its {final_blocks} final blocks"
            )

    def capacity_wants(self, watermark_blocks: int, chunk_blocks: int, skip=()) -> dict[str, int]:
        """Ahead-of-need capacity (read-only): decoding requests with fewer than
        ``watermark_blocks`` blocks of headroom past their next step get ``chunk_blocks`` more,
        never past what the request can still write (so no trim takes them back). Requests in
        ``skip`` (an Extend already in flight) are left out. Empty under the "rejected" trim
        policy, which gives blocks back after every verify."""
        if self.config.trim_policy == "rejected":
            return {}
        bs = self.block_size
        headroom, max_k = watermark_blocks * bs, self.config.max_draft_tokens
        wants: dict[str, int] = {}
        for rid, s in self._states.items():
            if rid in skip or s.finished or s.in_prefill:
                continue
            cap = s.capacity
            next_need = s.logical_len + min(s.spec.k, max_k)
            if cap - next_need >= headroom:
                continue  # the usual case, decided before the limit is worked out
            limit = blocks_for(self._most_positions(s), bs) * bs
            if cap < limit:
                wants[rid] = min(max(cap, next_need) + chunk_blocks * bs, limit)
        return wants

    def _most_positions(self, s: RequestState) -> int:
        """Positions a request can still write up to (exclusive of the last token, never fed)."""
        return min(s.num_prompt + s.spec.max_new_tokens, self.max_seq_len) - 1

    def request_ids(self) -> list[str]:
        return list(self._states)

    def state(self, request_id: str) -> RequestState:
        """The live state (read it, do not mutate it). ``NotFound`` for unknown ids."""
        if request_id not in self._states:
            raise NotFound(f"unknown request {request_id!r}")
        return self._states[request_id]

    def _validate(self, spec: RequestSpec) -> None:
        if not isinstance(spec, RequestSpec):
            raise InvalidArgument("add_request needs a RequestSpec")
        if not isinstance(spec.request_id, str) or not spec.request_id:
            raise InvalidArgument("request_id must be a non-empty string")
        if spec.request_id in self._states:
            raise AlreadyExists(f"request {spec.request_id!r} is already running")
        n, vocab = len(spec.prompt_ids), self.target.config.vocab_size
        if n == 0:
            raise InvalidArgument("prompt_ids must not be empty")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in spec.prompt_ids):
            raise InvalidArgument(f"prompt token ids must be integers in [0, {vocab})")
        if n >= self.max_seq_len:
            raise InvalidArgument(f"prompt of {n} tokens leaves no room under max_seq_len {self.max_seq_len}")
        if not isinstance(spec.max_new_tokens, int) or spec.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {spec.max_new_tokens!r}")
        if not isinstance(spec.sampling, SamplingParams):
            raise InvalidArgument("sampling must be a SamplingParams")
        if not isinstance(spec.k, int) or not 0 <= spec.k <= self.config.max_draft_tokens:
            raise InvalidArgument(f"k must be in [0, {self.config.max_draft_tokens}], got {spec.k!r}")
        if spec.logprobs is not None and (not isinstance(spec.logprobs, int) or not 0 <= spec.logprobs <= MAX_LOGPROBS):
            raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {spec.logprobs!r}")
        if spec.k > 0 and self.drafter is None:
            raise InvalidArgument("this engine has no draft model; k must be 0")
        table = list(spec.block_table)
        if any(not isinstance(b, int) or not 0 <= b < self.num_blocks for b in table):
            raise InvalidArgument(f"block ids must be integers in [0, {self.num_blocks})")
        if len(set(table)) != len(table):
            raise InvalidArgument("block_table repeats a block id")
        r = spec.reused_positions
        limit = min(n - self.span, n - 1)
        if not isinstance(r, int) or r < 0 or r % self.block_size or r > limit:
            raise InvalidArgument(
                f"reused_positions {r!r} must be a multiple of {self.block_size} in [0, {max(limit, 0)}] "
                "(the last position and the trailing lookahead span are always recomputed)"
            )
        if r > len(table) * self.block_size:
            raise InvalidArgument(f"reused_positions {r} exceed the block table's capacity")

    # -- the step -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> StepReport:
        """Run one batched step (see the module docstring). Mutates the pools, the requests and the
        block source. Finished requests are reported once and dropped.

        Failure isolation: if the step raises (anything but a ``TandemError``, which is the block
        source's or a caller's) before any request's tokens or lengths moved, the requests of
        the step that never completed a step are the suspects (a malformed request fails its
        first step): they alone end, as ``FinishReason.ERROR`` results after the device finished
        the failed work; the others keep their state and simply run again next step. A failure
        after that point, or one with no suspect, is raised (the caller fails everything)."""
        self._committed = False
        self._in_step: list[RequestState] = []
        self._ledger = {}
        self._device_wait_s = 0.0
        try:
            report = self._step()
        except TandemError:
            raise
        except Exception as exc:
            suspects = [s for s in self._in_step if not s.proven and self._states.get(s.request_id) is s]
            if self._committed or not suspects:
                raise
            return self._isolate(suspects, exc)
        for s in self._in_step:
            s.proven = True
        return report

    def _isolate(self, suspects: list[RequestState], exc: Exception) -> StepReport:
        """End ``suspects`` after a failed, uncommitted step (see ``step``); report the tokens
        the step had already read back for the others (overlap). Mutates."""
        log.warning("engine step failed (%s: %s); dropping the %d request(s) in their first step: %s",
                    type(exc).__name__, exc, len(suspects), ", ".join(s.request_id for s in suspects))
        # their blocks are freed after this fence: behind whatever the failed step had queued
        self.last_fence = fence = StepFence.record(self.device, blocking=True)
        for s in suspects:
            s.finish_reason = FinishReason.ERROR
            self._ledger[s.request_id].error = exc
        results = {}
        for rid, entry in self._ledger.items():
            s = entry.state
            if self._states.get(rid) is not s or (not entry.emitted and not s.finished):
                continue
            if s.finished:
                s.drafts = s.draft_probs = s.chain_hidden = None
            entry.prefill_tokens = 0  # nothing the failed step computed counts
            results[rid] = entry.result(self.block_size, blocks_written=[])
            if s.finished:
                del self._states[rid]
        return StepReport(results=results, extend_wants={}, trim_keeps={}, target_tokens=0, draft_tokens=0,
                          fence=fence, device_wait_s=self._device_wait_s)

    def _step(self) -> StepReport:
        states = sorted(self._states.values(), key=lambda s: s.arrival)
        ledger = self._ledger = {s.request_id: _Ledger(s, s.capacity) for s in states}
        step = self._continue_fused(states)
        if step is None:
            step = self._scheduled_step(states)
        in_work, target_tokens, draft_tokens, extend_wants, fill_jobs = step
        if self.drafter is not None:  # ended on a read-back token outside this step: final fill
            fill_jobs += [FillJob(e.state, None, 0) for rid, e in ledger.items()
                          if e.emitted is not None and rid not in in_work and e.state.finished]
        if self.drafter is not None and fill_jobs:
            # plain-decoding requests fill their pending draft rows in rounds (see _deferred)
            filled = self.drafter.fill(fill_jobs, flush=self._steps % self.block_size == 0)
            for rid, rng in filled.items():
                ledger[rid].written.append(rng)
            draft_tokens += sum(hi - lo for lo, hi in filled.values())
        # Blocks may be given back (trim) only after the step completed on the device (DESIGN
        # §2): the fence travels with the trim instead of stopping the host here (fence.py).
        blocks_written = {rid: self._blocks_of(e.state, e.written) for rid, e in ledger.items()}
        self.last_fence = fence = StepFence.record(self.device, blocking=True)
        trim_keeps = self._trim(states, fence)

        results: dict[str, RequestStepResult] = {}
        for rid, e in ledger.items():
            s = e.state
            if e.emitted is None and e.error is None and rid not in trim_keeps:
                continue  # untouched this step
            results[rid] = e.result(self.block_size, blocks_written[rid])
            if s.finished:
                del self._states[rid]
        return StepReport(results=results, extend_wants=extend_wants, trim_keeps=trim_keeps,
                          target_tokens=target_tokens, draft_tokens=draft_tokens, fence=fence,
                          device_wait_s=self._device_wait_s)

    def _scheduled_step(self, states: list[RequestState]) -> tuple[set[str], int, int, dict[str, int], list[FillJob]]:
        """A-D of a step as the scheduler picks it (see the module docstring), after applying
        the last fused step's verdict. Returns the ids of the requests that ran, the target and
        draft rows computed, the step's extend wants and the fills still to run. Mutates."""
        cfg = self.config
        ledger = self._ledger
        # the last fused step's verdict, left on the device (overlap): its tokens stream now
        lagged_draft_rows = self._resolve_verdict()
        work = schedule([s for s in states if not s.last_step], max_batch_tokens=cfg.max_batch_tokens,
                        max_batch_size=cfg.max_batch_size, chunk_size=cfg.chunk_size, max_seq_len=self.max_seq_len,
                        step=self._steps, prefill_wait_steps=cfg.prefill_wait_steps, prefill_batch=cfg.prefill_batch)
        self._steps += 1
        self._in_step = [w.state for w in work]
        for w in work:  # a scheduled request reports this step even if it streams nothing
            ledger[w.state.request_id].emit(())

        if self._lagging is not None and any(w.needed_capacity > w.state.capacity for w in work):
            # an extend may end a request for want of capacity: first learn whether it had stopped
            self._resolve_lagging()
            work = [w for w in work if not w.state.finished]
        extend_wants, waiting = self._reserve(work)
        work = [w for w in work if not w.state.finished and w.state.request_id not in waiting]
        for w in work:
            if w.is_prefill:
                ledger[w.state.request_id].prefill_tokens = w.num_target_tokens
        fused_k = self._fused_k(work)
        if self.drafter is not None and not fused_k:
            self._chain(work)
        target_tokens = sum(w.num_target_tokens for w in work)
        fill_jobs: list[FillJob] = []
        draft_tokens = lagged_draft_rows
        if fused_k:
            # decodes in one graph; prompt chunks beside them (the scheduler puts them last) run
            # phase by phase in a second, eager forward launched right behind it. Nothing moves
            # before both are launched (a failing newcomer's prompt still ends alone, see step).
            n_dec = leading_decodes(work)
            prompts = work[n_dec:]
            verdict = self._launch_fused([w.state for w in work[:n_dec]], fused_k, caps=[w.num_drafts for w in work[:n_dec]])
            launched = self._run_target(prompts) if prompts else None
            self._resolve_lagging()  # an earlier overlapped step's tokens, while the device runs this one
            if self.config.overlap:
                # the host goes back to its caller (streaming, publishing) while the device runs
                # the step; the next step begins by reading the verdict, its one synchronisation
                self._verdict = verdict
            else:
                self._committed = True  # from here on, request state moves: no isolation (see step)
                draft_tokens += self._apply_verdict(verdict)
            if launched is not None:
                self._committed = True
                fill_jobs = self._accept(prompts, *launched)
        else:
            launched = self._run_target(work) if work else None
            # the previous step's tokens, read back while the device runs this step's target forward
            self._resolve_lagging()
            if launched is not None:
                self._committed = True  # from here on, request state moves: no isolation (see step)
                fill_jobs = self._accept(work, *launched)
        return {w.state.request_id for w in work}, target_tokens, draft_tokens, extend_wants, fill_jobs

    # -- 0. capacity ------------------------------------------------------------------------------

    def _reserve(self, work: list[ScheduledWork]) -> tuple[dict[str, int], set[str]]:
        """One batched extend; shrink (or finish with CAPACITY) what did not get its capacity.
        An ``Unavailable`` answer (the kvstore is away or slow, the Extend still pending) is no
        verdict: the request runs in the capacity it holds, or waits this step out. Returns the
        wants and the ids of the requests that wait."""
        wants = {w.state.request_id: w.needed_capacity for w in work if w.needed_capacity > w.state.capacity}
        waiting: set[str] = set()
        if not wants:
            return {}, waiting
        answers = self.block_source.extend(dict(wants))
        for w in work:
            s = w.state
            if s.request_id not in wants:
                continue
            ans = answers.get(s.request_id)
            transient = isinstance(ans, Unavailable)  # no verdict: nothing recorded against it
            if isinstance(ans, Exception) or ans is None:
                if not transient:
                    self._ledger[s.request_id].error = ans or FailedPrecondition("block source gave no answer")
            else:
                table = [int(b) for b in ans]
                # only deduplicated final blocks may differ (a Publish answered meanwhile)
                self._check_only_final_blocks_moved(s, table)
                s.block_table = table
            # Whatever we got, fit the step into it: fewer drafts, a shorter chunk, or nothing.
            cap = s.capacity
            if w.is_prefill:
                w.prefill_end = min(w.prefill_end, cap)
                ok = w.prefill_end > s.target_len
            else:
                w.num_drafts = min(w.num_drafts, cap - s.logical_len)
                ok = w.num_drafts >= 0
            if not ok and transient:
                waiting.add(s.request_id)
            elif not ok:
                s.finish_reason = FinishReason.CAPACITY
                entry = self._ledger[s.request_id]
                entry.error = entry.error or FailedPrecondition("no capacity for the next step")
        return wants, waiting

    # -- A. chain drafting ---------------------------------------------------------------------------

    def _chain(self, work: list[ScheduledWork]) -> None:
        """Make each decoding request's proposals exactly this step's ``num_drafts`` (truncate, or
        chain more inside the capacity reserved for the step)."""
        decoding = [w for w in work if not w.is_prefill and w.num_drafts > 0]
        for w in decoding:  # never verify more than this step may: truncate to its k
            s = w.state
            if s.drafts is None:
                w.num_drafts = 0
            elif len(s.drafts) > w.num_drafts:
                s.drafts = s.drafts[: w.num_drafts]
                if s.draft_probs is not None:
                    s.draft_probs = s.draft_probs[: w.num_drafts]
        chained = self.drafter.chain({w.state.request_id: w.num_drafts for w in decoding}, [w.state for w in decoding])
        for rid, rng in chained.items():
            self._ledger[rid].written.append(rng)
        for w in decoding:  # a chain that could not run leaves fewer proposals than planned
            w.num_drafts = min(w.num_drafts, 0 if w.state.drafts is None else len(w.state.drafts))

    # -- B + C. target forward and acceptance ----------------------------------------------------

    def _run_target(self, work: list[ScheduledWork]):
        """B: the target over every scheduled request (request-major rows; a graph for the decode
        and verify rows, an eager forward for prompt chunks). Returns the logits, the draft
        conditioning rows (aux / final hidden, all T rows) and, per request that gets logits,
        ``(first logits row, count)``."""
        pieces: list[list[int] | torch.Tensor] = []  # the rows' token ids: host lists, device tensors
        logit_rows: list[int] = []
        row = 0
        for w in work:
            s = w.state
            if w.is_prefill:
                pieces.append(s.tokens[s.target_len : w.prefill_end])
                if w.prefill_end == s.num_prompt:
                    logit_rows.append(row + w.num_target_tokens - 1)
            else:
                # overlap: the last step's token is still on the device
                pieces.append(s.pending_token if s.pending_token is not None else s.tokens[-1:])
                if w.num_drafts:  # proposals stay on the device: no host round trip
                    pieces.append(s.drafts[: w.num_drafts])
                logit_rows.extend(range(row, row + w.num_target_tokens))
            self._ledger[s.request_id].written.append((s.target_len, s.target_len + w.num_target_tokens))
            row += w.num_target_tokens
        input_ids = self._input_ids(pieces)
        aux = self.drafter.target_aux_layers if self.drafter is not None else ()
        n_dec = leading_decodes(work)
        decode_layout = self._layout(work[:n_dec]) if n_dec and self.graphs is not None else None
        q = decode_layout.arrays.uniform_q if decode_layout is not None else None
        if q is not None and self.graphs is not None and self.graphs.covers("target", n_dec, q):
            # Decode/verify rows replay a graph (every row gets logits); prompt chunks beside them
            # run eagerly as a second forward, launched while the device runs the graph. With
            # requests arriving one by one nearly every step has a prompt chunk: one eager
            # forward over the whole batch was what made a served step slower than the engine's.
            decode_rows = n_dec * q
            rows, _plan = self.graphs.run("target", decode_layout, {"ids": input_ids[:decode_rows]})
            logits, hidden, aux_hidden = rows["logits"], rows["hidden"], rows.get("aux")
            if n_dec < len(work):
                out = self._eager_target(work[n_dec:], input_ids[decode_rows:], aux,
                                         [r - decode_rows for r in logit_rows if r >= decode_rows])
                logits, hidden = torch.cat([logits, out.logits]), torch.cat([hidden, out.hidden])
                aux_hidden = torch.cat([aux_hidden, out.aux_hidden]) if aux_hidden is not None else None
        else:
            out = self._eager_target(work, input_ids, aux, logit_rows)
            logits, hidden, aux_hidden = out.logits, out.hidden, out.aux_hidden
        cond = None
        if self.drafter is not None:
            cond = aux_hidden if aux else hidden
        picks: dict[str, tuple[int, int]] = {}  # rid -> (first logits row, count)
        cursor = 0
        for w in work:
            s = w.state
            if w.is_prefill and w.prefill_end == s.num_prompt:
                picks[s.request_id] = (cursor, 1)
                cursor += 1
            elif not w.is_prefill:
                picks[s.request_id] = (cursor, 1 + w.num_drafts)
                cursor += 1 + w.num_drafts
        return logits, cond, picks

    def _input_ids(self, pieces: list[list[int] | torch.Tensor]) -> torch.Tensor:
        """One id tensor of ``pieces`` in order: every host list goes to the device in one
        staged copy (a copy per request waited for the device each, see ``staging``); device
        tensors (pending tokens, proposals) join it there. Pure."""
        host = [t for p in pieces if isinstance(p, list) for t in p]
        staged = to_device(host, torch.long, self.device) if host else None
        if all(isinstance(p, list) for p in pieces):
            return staged
        parts, at = [], 0
        for p in pieces:
            if isinstance(p, list):
                parts.append(staged[at : at + len(p)])
                at += len(p)
            else:
                parts.append(p)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    @staticmethod
    def _layout(work: list[ScheduledWork]) -> BatchLayout:
        return BatchLayout(
            block_tables=[w.state.table_array() for w in work],
            cached_lens=[w.state.target_len for w in work],
            query_lens=[w.num_target_tokens for w in work],
        )

    def _eager_target(self, work: list[ScheduledWork], input_ids: torch.Tensor, aux, logit_rows: list[int]):
        """The target over ``work`` without a graph (prompt chunks, ragged or uncovered batches),
        logits of ``logit_rows`` only."""
        layout = self._layout(work)
        q = layout.arrays.uniform_q
        decoding = not any(w.is_prefill for w in work)
        kind = AttentionKind.VERIFY if decoding and q is not None and q > 1 else None
        plan = self.backend.plan(layout, kind)
        return self.target(input_ids, plan, self.backend, self.target_pool, aux_layers=aux,
                           logits_indices=to_device(logit_rows, torch.long, self.device))

    def _accept(self, work: list[ScheduledWork], logits, cond, picks) -> list[FillJob]:
        """C: first tokens after prompts and verification of drafts (one host sync for every
        greedy decision), stop rules, new lengths; builds the fill jobs. Mutates the states.
        Penalties change the rows of the requests that ask for them (greedy and sampled alike);
        logprobs are read from the raw rows."""
        raw = logits
        logits = self._penalize(work, logits, picks)
        argmax = torch.argmax(logits, dim=-1) if logits.shape[0] else None
        sampled = [w for w in work if w.state.request_id in picks and not w.state.spec.sampling.greedy]
        lagging = None
        if self.config.overlap and argmax is not None and all(self._may_lag(w) for w in work):
            # no row needs a token value now: leave them on the device (see EngineConfig.overlap)
            lagging = LaggingTokens(argmax)
        sampled_tokens = self._sample_or_verify(sampled, logits, picks)
        started = time.perf_counter()  # these reads wait for this step's forward: the device's time
        greedy_host = argmax.tolist() if argmax is not None and lagging is None else []
        draft_host = self._drafts_to_host([w for w in work if not w.is_prefill and w.num_drafts
                                           and w.state.spec.sampling.greedy])
        self._device_wait_s += time.perf_counter() - started

        jobs: list[FillJob] = []
        # per-request views made in one call each (a slice per request cost ~1 us a view)
        token_views = argmax.split(1) if lagging is not None else None
        cond_views = cond[: sum(w.num_target_tokens for w in work)].split([w.num_target_tokens for w in work]) \
            if cond is not None and self.drafter is not None else None
        for i, w in enumerate(work):
            s = w.state
            rid = s.request_id
            entry = self._ledger[rid]
            t_old = s.target_len
            if s.finished:
                pass  # overlap: its previous token, read back this step, was a stop; drop this one
            elif lagging is not None:
                first, _count = picks[rid]
                s.tokens.append(PENDING)
                s.pending_token = token_views[first]
                lagging.entries.append((s, first))
                self._count_verify(entry, 0, 0)
                # count-based ends are known now; a stop token only when the value is read back
                s.last_step = s.num_generated >= s.spec.max_new_tokens or s.logical_len >= self.max_seq_len
                s.target_len = s.logical_len - 1
            elif w.is_prefill:
                s.target_len = w.prefill_end
                if rid in picks:
                    tok = sampled_tokens[rid][1] if rid in sampled_tokens else (greedy_host[picks[rid][0]],)
                    self._emit(entry, raw, picks[rid][0], self._append(s, list(tok)))
            else:
                first, count = picks[rid]
                if rid in sampled_tokens:
                    n_acc, toks = sampled_tokens[rid]
                else:
                    v = accept_greedy(draft_host.get(rid, []), greedy_host[first : first + count],
                                      self._forced(w.num_drafts))
                    n_acc, toks = v.accepted, v.tokens
                self._count_verify(entry, w.num_drafts, n_acc)
                self._emit(entry, raw, first, self._append(s, list(toks)))
                s.target_len = s.logical_len - 1  # the newest token is fed next step
            s.drafts = s.draft_probs = s.chain_hidden = None
            if self.drafter is None:
                s.draft_len = s.target_len
                continue
            new_rows = None
            if cond_views is not None:
                new_rows = cond_views[i]
                if s.target_len - t_old < w.num_target_tokens:  # rejected drafts' rows, a stop
                    new_rows = new_rows[: s.target_len - t_old]
            wanted = 0
            if not s.finished and not s.in_prefill and s.spec.k > 0:
                wanted = min(draft_budget(s, self.max_seq_len), self.drafter.num_layers)
            jobs.append(FillJob(s, new_rows, wanted))
        if lagging is not None:
            self._lagging = lagging
        return jobs

    @staticmethod
    def _count_verify(entry: "_Ledger", proposed: int, accepted: int) -> None:
        """One decode step verified ``proposed`` drafts and kept ``accepted``: in this step's
        report and in the request's totals. Mutates both."""
        entry.verify(proposed, accepted)
        s = entry.state
        s.decode_steps += 1
        s.proposed_drafts_total += proposed
        s.accepted_drafts_total += accepted

    @staticmethod
    def _drafts_to_host(work: list[ScheduledWork]) -> dict[str, list[int]]:
        """The verified proposals of ``work`` as host lists: one device-to-host copy for the
        batch (a ``tolist`` per request was a sync per request, 64 of them a step at c = 64)."""
        if not work:
            return {}
        flat = torch.cat([w.state.drafts[: w.num_drafts] for w in work]).tolist()
        out, at = {}, 0
        for w in work:
            out[w.state.request_id] = flat[at : at + w.num_drafts]
            at += w.num_drafts
        return out

    @staticmethod
    def _may_lag(w: ScheduledWork) -> bool:
        """A row whose token the host need not see before the next step: a plain greedy decode."""
        s = w.state
        return (not w.is_prefill and w.num_drafts == 0 and s.spec.k == 0 and s.spec.sampling.greedy
                and not s.finished and s.gen_counts is None and s.spec.logprobs is None)

    @staticmethod
    def _penalize(work: list[ScheduledWork], logits: torch.Tensor, picks) -> torch.Tensor:
        """``logits`` with the rows of penalized requests replaced by their penalized values (a
        float32 copy when any; see ``apply_penalties``). Row ``j`` of a verify counts the drafts
        before it. Pure."""
        out = None
        for w in work:
            s = w.state
            if s.gen_counts is None or s.request_id not in picks:
                continue
            first, count = picks[s.request_id]
            if out is None:
                out = logits.float()
                out = out.clone() if out is logits else out
            drafts = s.drafts[: count - 1] if count > 1 else None
            out[first : first + count] = apply_penalties(logits[first : first + count], s.spec.sampling,
                                                         s.gen_counts, s.prompt_mask, drafts)
        return logits if out is None else out

    @staticmethod
    def _emit(entry: "_Ledger", raw: torch.Tensor, first: int, emitted: list[int]) -> None:
        """Stream ``emitted`` (the tokens of rows ``first ..``), with their raw logprobs if asked."""
        n = entry.state.spec.logprobs
        entry.emit(emitted, token_logprobs(raw[first : first + len(emitted)], emitted, n) if n is not None else None)

    def _resolve_lagging(self) -> None:
        """Read back the last step's lagging tokens (waits for that step's forward, normally done
        by now): put them in place of the placeholders, emit them, apply the stop rules."""
        lag, self._lagging = self._lagging, None
        if lag is None:
            return
        values = lag.values()  # tokens land in the ledger: reported even if the step then fails
        self._device_wait_s += lag.take_wait()
        for s, row in lag.entries:
            if self._states.get(s.request_id) is not s or s.pending_token is None:
                continue  # aborted meanwhile
            token = values[row]
            s.tokens[-1] = token
            s.pending_token = None
            self._ledger[s.request_id].emit((token,))
            self._check_finished(s, token)

    def _forced(self, num_drafts: int) -> int | None:
        a = self.config.forced_acceptance
        return None if a is None else min(a, num_drafts)

    def _sample_or_verify(self, sampled: list[ScheduledWork], logits, picks) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Temperature > 0: the first token after a prompt is sampled from p; decode steps are
        verified by rejection sampling, batched and padded to the largest k of the batch.
        Draws from each request's generator (mutated). Returns rid -> (accepted, tokens)."""
        out: dict[str, tuple[int, tuple[int, ...]]] = {}
        verify = []
        for w in sampled:
            s = w.state
            first, count = picks[s.request_id]
            p = probs_from_logits(logits[first : first + count], s.spec.sampling)
            if w.is_prefill:
                out[s.request_id] = (0, (int(sample_rows(p, draw_uniforms(s.generator, 1))[0]),))
            else:
                verify.append((w, p))
        if not verify:
            return out
        kmax = max(w.num_drafts for w, _ in verify)
        b, vocab = len(verify), logits.shape[-1]
        dev = logits.device
        drafts = torch.zeros(b, kmax, dtype=torch.long, device=dev)
        q = torch.zeros(b, kmax, vocab, device=dev)
        p_all = torch.zeros(b, kmax + 1, vocab, device=dev)
        num = torch.zeros(b, dtype=torch.long)
        u_acc = torch.zeros(b, kmax, dtype=torch.float64)
        u_tok = torch.zeros(b, dtype=torch.float64)
        forced = torch.full((b,), -1, dtype=torch.long)
        for i, (w, p) in enumerate(verify):
            s, k = w.state, w.num_drafts
            if k:
                drafts[i, :k] = s.drafts[:k]
                q[i, :k] = s.draft_probs[:k]
            p_all[i, : k + 1] = p
            num[i] = k
            u_acc[i, :k] = draw_uniforms(s.generator, k)  # a fixed count per step: reproducible
            u_tok[i] = draw_uniforms(s.generator, 1)[0]
            f = self._forced(k)
            forced[i] = -1 if f is None else f
        accepted, token = accept_sampled_batch(drafts, q, p_all, num, u_acc, u_tok, forced)
        started = time.perf_counter()
        acc_host, tok_host, drafts_host = accepted.tolist(), token.tolist(), drafts.tolist()
        self._device_wait_s += time.perf_counter() - started
        for i, (w, _) in enumerate(verify):
            n = acc_host[i]
            out[w.state.request_id] = (n, tuple(drafts_host[i][:n]) + (tok_host[i],))
        return out

    def _append(self, s: RequestState, tokens: list[int]) -> list[int]:
        """Append accepted tokens until a stop condition; sets ``finish_reason``; counts them for
        penalties. Mutates ``s``."""
        emitted = [int(t) for t in tokens]
        if self._no_stop_rule_fires(s, emitted):
            s.tokens.extend(emitted)  # the loop below would take them all
        else:
            for i, t in enumerate(emitted):
                s.tokens.append(t)
                self._check_finished(s, t)
                if s.finished:
                    del emitted[i + 1 :]
                    break
        if s.gen_counts is not None and emitted:
            ids = to_device(emitted, torch.long, s.gen_counts.device)
            s.gen_counts.index_add_(0, ids, torch.ones(len(emitted), device=s.gen_counts.device))
        return emitted

    def _no_stop_rule_fires(self, s: RequestState, tokens: list[int]) -> bool:
        """Whether ``s`` may take all of ``tokens`` without ending (``_check_finished`` after
        each would not fire). Pure."""
        n = len(s.tokens) + len(tokens)  # the logical length after them
        if n - s.num_prompt >= s.spec.max_new_tokens or n >= self.max_seq_len:
            return False
        stop = s.spec.stop_ids
        return not (len(stop) and any(t in stop for t in tokens))

    def _check_finished(self, s: RequestState, token: int) -> None:
        """Stop rules after ``token`` became the request's newest token. Mutates ``s``."""
        if token in s.spec.stop_ids:
            s.finish_reason = FinishReason.STOP
        elif s.num_generated >= s.spec.max_new_tokens:
            s.finish_reason = FinishReason.LENGTH
        elif s.logical_len >= self.max_seq_len:
            s.finish_reason = FinishReason.MAX_SEQ_LEN

    # -- E. trim -------------------------------------------------------------------------------------

    def _trim(self, states: Iterable[RequestState], fence: StepFence) -> dict[str, int]:
        """One batched trim of blocks no later step of a live request will write (freed by the
        source once ``fence`` completed)."""
        keeps: dict[str, int] = {}
        rejected = self.config.trim_policy == "rejected"
        # a fused step whose verdict is still on the device (overlap) writes up to L + k
        verdict = self._verdict if rejected else None
        pending = {id(s): verdict.k for s in verdict.states} if verdict is not None else {}
        for s in states:
            if s.finished:
                continue  # the caller releases the whole reservation
            keep = max(self._most_positions(s), s.target_len, s.draft_len)
            if rejected and not s.in_prefill:
                keep = s.logical_len + pending.get(id(s), 0)  # positions >= L hold only rejected or no KV
            if blocks_for(keep, self.block_size) < len(s.block_table):
                keeps[s.request_id] = keep
        if keeps:
            # a source that trims asynchronously answers nothing: the table is cut as asked
            tables = self.block_source.trim(dict(keeps), after=fence) or {}
            for rid, keep in keeps.items():
                s = self._states[rid]
                table = tables.get(rid)
                if table is None:
                    s.block_table = s.block_table[: blocks_for(keep, self.block_size)]
                    continue
                table = [int(b) for b in table]
                if table != s.block_table[: len(table)]:
                    raise FailedPrecondition(f"{rid}: trim changed kept blocks")
                s.block_table = table
        return keeps

    def _blocks_of(self, s: RequestState, ranges: list[tuple[int, int]]) -> list[int]:
        bs = self.block_size
        if len(ranges) == 1:  # the usual decode: one range, often inside one block
            lo, hi = ranges[0]
            if hi > lo and lo // bs == (hi - 1) // bs:
                return [s.block_table[lo // bs]]
        ids: set[int] = set()
        for lo, hi in ranges:
            if hi > lo:
                for i in range(lo // bs, (hi - 1) // bs + 1):
                    ids.add(s.block_table[i])
        return sorted(ids)


@dataclasses.dataclass(slots=True)
class _Ledger:
    """What the running step did to one live request: the one record per request that every
    phase writes into and the step's results are read from (instead of one dict per fact)."""

    state: RequestState
    capacity_before: int
    written: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # position ranges, either pool
    emitted: list[int] | None = None  # tokens streamed this step (None: nothing to stream)
    logprobs: list[TokenLogprob] | None = None  # one per emitted token, when the request asked
    # the decode steps whose tokens this step reports: its own, and (overlapped fused steps) the
    # previous step's verdict read back at this step's start; drafts verified and accepted over
    # them, and 1 + accepted of each
    proposed: int = 0
    accepted: int = 0
    acceptance_lengths: list[int] = dataclasses.field(default_factory=list)
    prefill_tokens: int = 0
    error: Exception | None = None

    def verify(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.acceptance_lengths.append(1 + accepted)

    def emit(self, tokens, logprobs: list[TokenLogprob] | None = None) -> None:
        if self.emitted is None:
            self.emitted = []
        self.emitted.extend(tokens)
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + logprobs

    def result(self, block_size: int, blocks_written: list[int]) -> RequestStepResult:
        """The step's result for this request, as its state stands now. Pure."""
        s = self.state
        return RequestStepResult(
            request_id=s.request_id,
            new_token_ids=self.emitted or [],
            proposed_drafts=self.proposed,
            accepted_drafts=self.accepted,
            logical_len=s.logical_len,
            target_len=s.target_len,
            publishable_positions=s.draft_len,
            block_table=list(s.block_table),
            block_size=block_size,
            blocks_written=blocks_written,
            capacity_before=self.capacity_before,
            capacity_after=s.capacity,
            prefill_tokens=self.prefill_tokens,
            verified=bool(self.acceptance_lengths),
            acceptance_lengths=tuple(self.acceptance_lengths),
            finish_reason=s.finish_reason,
            error=self.error,
            counts=s.counts,
            new_logprobs=self.logprobs,
        )
