"""Running the draft layers for a batch: *fill* (after the target) and *chain* (before it).

Notation as in ``model/draft.py``: a request has accepted tokens ``t[0..L)``; its newest token
``t[L-1]`` has not been fed to the target yet, so the target KV (and target hidden) covers
``T = L - 1`` positions while decoding. Proposal ``d_j`` stands for ``t[L-1+j]`` (j ≥ 1).

Fill — positions ``[F, hi)`` of every draft layer, right after the target forward of the step::

    position:      F .......... known-D ........ T-1 | T ...
    draft KV:      final inputs       | speculative  | (chain, next step)
    EAGLE-3 (D=1): token t[i+1], context = target aux a[i]; never speculative (T <= known-1)
    MTP     (D=K): module k reads t[i+k]; where that is past the known tokens it reads the
                   proposal d_(i+k-T) of an earlier module of this same fill

  ``hi = T`` when the request drafts now (it is decoding: ``T = known - 1``); otherwise
  ``hi = min(T, known - D)`` so nothing speculative is written (prefill chunks, k = 0, finished
  requests). Afterwards ``F = min(T, known - D)`` and the target conditioning rows of
  ``[F, T)`` are kept in ``RequestState.pending_hidden`` for the next fill (MTP: K-1 rows).
  A drafting fill proposes ``d_1`` (EAGLE-3) or ``d_1..d_K`` (MTP) from the row at ``T-1``.

Chain — next step, before the target: proposals beyond what the fill made, one position per
call, with EAGLE-style self-feeding: the last draft layer reads the newest proposal and its own
output hidden of the previous position instead of a target hidden state::

    EAGLE-3:          layer at position T-1+j reads d_j, context g[T-2+j]        -> d_(j+1)
    MTP, k > K:       module K at position T+j-K reads d_j, prev hidden m_K[T+j-K-1] -> d_(j+1)
                      (the LAST module is chained; modules 1..K-1 are not used past K)

  Chain positions ``>= T`` are speculative draft KV; the next fill rewrites those that become
  final. A chain of ``k`` proposals ends at position ``T + k - 1 - D < L + k``, inside the
  capacity the step reserved for verification.
"""

from __future__ import annotations

import dataclasses

import torch

from services.common.spec import SpecMode
from services.gpuworker.attention.base import AttentionBackend, AttentionKind, BatchLayout
from services.gpuworker.engine.graphs import ForwardGraphs
from services.gpuworker.engine.request import RequestState
from services.gpuworker.engine.sampling import draw_uniforms, probs_from_logits, sample_rows
from services.gpuworker.kv.pool import KVPool
from services.gpuworker.model.draft import DraftModel, MTPDraft
from services.gpuworker.staging import to_device


@dataclasses.dataclass
class FillJob:
    """One request's fill: the target conditioning rows the step produced for positions
    ``[T_old, T)`` (``new_rows``, may be empty) and how many proposals to make now (0 = none)."""

    state: RequestState
    new_rows: torch.Tensor | None
    wanted: int


def choose_proposals(states: list[RequestState], logits: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """One proposal per row of ``logits`` [B, V] for ``states[b]``: argmax for greedy requests,
    a sample from the transformed draft distribution otherwise (one uniform drawn from that
    request's generator, which is mutated). Returns ``(tokens [B] on the logits' device,
    per-row distributions q (None for greedy))``."""
    tokens = torch.argmax(logits, dim=-1)
    probs: list[torch.Tensor | None] = [None] * len(states)
    for b, s in enumerate(states):
        if not s.spec.sampling.greedy:
            q = probs_from_logits(logits[b : b + 1], s.spec.sampling)
            tokens[b] = sample_rows(q, draw_uniforms(s.generator, 1))[0]
            probs[b] = q[0]
    return tokens, probs


class DraftRunner:
    """Drives one draft model over the draft pool. Mutates the pool and the ``RequestState``s
    it is given (proposals, draft length, pending rows); returns the position ranges it wrote."""

    def __init__(
        self,
        draft: DraftModel,
        backend: AttentionBackend,
        pool: KVPool,
        device: torch.device,
        *,
        graphs: ForwardGraphs | None = None,
    ):
        self.draft = draft
        self.graphs = graphs
        self.backend = backend
        self.pool = pool
        self.device = device
        self.mode = draft.spec_mode
        self.span = draft.span
        self.num_layers = draft.num_kv_layers
        if self.mode not in (SpecMode.EAGLE3, SpecMode.MTP):
            raise ValueError(f"no draft runner for {self.mode}")
        self._chain_fn = self.chain_forward(draft, backend, pool)
        self._fill_fn = self.fill_forward(draft, backend, pool) if self.mode is SpecMode.EAGLE3 else None

    @property
    def target_aux_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the fill needs (EAGLE-3), else ()."""
        return self.aux_layers_for(self.draft)

    @staticmethod
    def aux_layers_for(draft: DraftModel | None) -> tuple[int, ...]:
        return draft.aux_layers if draft is not None and draft.spec_mode is SpecMode.EAGLE3 else ()

    @staticmethod
    def chain_forward(draft: DraftModel, backend: AttentionBackend, pool: KVPool):
        """``fn(plan, tokens [B], hidden [B, H]) -> {"logits", "hidden"}``: one chain position
        (the last draft layer, self-fed). The same function runs eagerly and under a graph."""
        if draft.spec_mode is SpecMode.EAGLE3:
            def run(plan, tokens, hidden):
                out = draft(tokens, hidden, plan, backend, pool, context_is_aux=False)
                return {"logits": out.logits, "hidden": out.hidden}
        else:
            last = draft.num_kv_layers

            def run(plan, tokens, hidden):
                out = draft(last, tokens, hidden, plan, backend, pool)
                return {"logits": out.logits, "hidden": out.hidden}
        return run

    @staticmethod
    def fill_forward(draft: DraftModel, backend: AttentionBackend, pool: KVPool):
        """EAGLE-3 only: ``fn(plan, ids [N], context [N, 3H], last [B]) -> {"hidden" [N, H],
        "logits" [B, V]}``: the fill's draft layer over N = B * q rows, with logits of each
        request's row ``last[b]`` only. The same function runs eagerly and under a graph."""
        def run(plan, ids, context, last):
            out = draft(ids, context, plan, backend, pool, context_is_aux=True, logits_indices=last)
            return {"hidden": out.hidden, "logits": out.logits}
        return run

    def warmup(self, plan, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """One fill-shaped forward of every draft layer over ``plan`` (kernel compilation only;
        writes the plan's slots of the draft pool)."""
        if self.mode is SpecMode.EAGLE3:
            self.draft(ids, rows, plan, self.backend, self.pool, context_is_aux=True)
        else:
            prev = rows
            for k in range(1, self.num_layers + 1):
                prev = self.draft(k, ids, prev, plan, self.backend, self.pool).hidden

    # -- fill -----------------------------------------------------------------------------------

    def fill(self, jobs: list[FillJob], flush: bool = True) -> dict[str, tuple[int, int]]:
        """Bring every job's draft KV up to date (see the module docstring); make proposals for
        jobs with ``wanted > 0``. ``flush``: a fill round, where plain-decoding jobs fill what
        they have pending too (``_deferred``). Returns request id → written position range
        ``[lo, hi)``."""
        run: list[tuple[FillJob, int, int, torch.Tensor]] = []
        written: dict[str, tuple[int, int]] = {}
        deferred: list[tuple[RequestState, torch.Tensor]] = []
        for job in jobs:
            s = job.state
            known, T, F = s.known_len, s.target_len, s.draft_len  # a pending token is not known yet
            new_rows = job.new_rows if job.new_rows is not None and job.new_rows.shape[0] > 0 else None
            drafting = job.wanted > 0 and T == known - 1
            hi = T if drafting else min(T, known - self.span)
            new_f = max(F, min(T, known - self.span))
            if self._deferred(job, F, new_f, flush):
                # no concatenation per request and step: one more row block, read when it fills
                if new_rows is not None:
                    deferred.append((s, new_rows))
                s.drafts, s.draft_probs, s.chain_hidden = None, None, None
                continue
            parts = s.pending_hidden + [new_rows] if new_rows is not None else s.pending_hidden
            rows = torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else None)
            if hi > F:
                run.append((job, F, hi, rows[: hi - F]))
                written[s.request_id] = (F, hi)
            # clone: a view would keep the whole step's hidden tensor alive until the next fill
            keep = rows is not None and rows.shape[0] > new_f - F
            s.pending_hidden = [rows[new_f - F :].clone()] if keep else []
            s.draft_len = new_f
            s.drafts, s.draft_probs, s.chain_hidden = None, None, None
        if deferred:
            self._keep(deferred)
        if run:
            if self.mode is SpecMode.EAGLE3:
                self._fill_eagle(run)
            else:
                self._fill_mtp(run)
        return written

    @staticmethod
    def _keep(deferred: list[tuple[RequestState, torch.Tensor]]) -> None:
        """Append each deferred row block to its request's ``pending_hidden`` as a view of ONE
        copy of them all: the rows are the step's target outputs, which a graph's next replay
        rewrites (and a view of a prompt chunk's would keep that whole tensor alive), and one
        copy costs one kernel where a copy per request cost a kernel each. Mutates the states."""
        kept = torch.cat([rows for _, rows in deferred])  # a new tensor, even of one part
        for (s, _), rows in zip(deferred, kept.split([r.shape[0] for _, r in deferred])):
            s.pending_hidden.append(rows)

    def _deferred(self, job: FillJob, F: int, new_f: int, flush: bool = True) -> bool:
        """Whether a fill may wait: a plain-decoding request (no proposals wanted) needs its draft
        KV only for publishing, and only whole blocks are published, so its rows are kept in
        ``pending_hidden`` and filled in the engine's fill rounds (``flush``, every
        ``block_size`` steps), all pending requests at once: one draft forward per round instead
        of one per token, or (requests that started at different times cross their block
        boundaries in different steps) one nearly every step at c 64, ~0.85 ms of host time each
        on the H200. A block is published at most ``block_size`` steps late::

            F ─ pending rows ─▶ new_f     within one boundary of F: wait for the round
                                          two boundaries crossed: fill now (bounded memory)

        Never deferred: the rows of the step that completes a prompt (so that a newcomer joins
        fused speculative steps at once: a pending row keeps a whole greedy batch out of them,
        ``FusedSteps._fusable``), proposals wanted, a request's last step or end."""
        s = job.state
        if (flush or job.wanted > 0 or s.finished or s.last_step or s.in_prefill or new_f <= F
                or F <= s.num_prompt - self.span):
            return False
        return new_f // s.block_size - F // s.block_size <= 1

    def _layout(self, run, q: int | None = None) -> BatchLayout:
        """The fill's layout over ``run``: each job's rows ``[lo, hi)``, or ``q`` rows each."""
        return BatchLayout(
            block_tables=[j.state.table_array() for j, _, _, _ in run],
            cached_lens=[lo for _, lo, _, _ in run],
            query_lens=[hi - lo for _, lo, hi, _ in run] if q is None else [q] * len(run),
        )

    @staticmethod
    def _drafts_now(job: FillJob, hi: int) -> bool:
        """The job proposes now: it fills up to the newest token's position (a decoding request
        right after its verify) and wants proposals."""
        return job.wanted > 0 and hi == job.state.target_len == job.state.logical_len - 1

    def _drafting(self, run) -> tuple[list[int], torch.Tensor]:
        """Indices (into ``run``) of drafting jobs and their last rows in the flattened batch."""
        idx, rows, end = [], [], 0
        for b, (job, lo, hi, _) in enumerate(run):
            end += hi - lo
            if self._drafts_now(job, hi):
                idx.append(b)
                rows.append(end - 1)
        return idx, to_device(rows, torch.long, self.device)

    def _fill_eagle(self, run) -> None:
        padded, ragged, q = self._split_fill(run)
        parts = []
        if padded:
            parts.append((padded, *self._fill_padded(padded, q)))
        if ragged:
            plan = self.backend.plan(self._layout(ragged))
            next_ids = to_device([tok for job, lo, hi, _ in ragged for tok in job.state.tokens[lo + 1 : hi + 1]],
                                 torch.long, self.device)
            context = torch.cat([rows for _, _, _, rows in ragged])
            drafting, last_rows = self._drafting(ragged)
            out = self._fill_fn(plan, next_ids, context, last_rows)
            parts.append((ragged, out["hidden"], out["logits"], last_rows, drafting))
        for jobs, hidden, logits, last_rows, drafting in parts:
            if not drafting:
                continue
            states = [jobs[b][0].state for b in drafting]
            tokens, probs = choose_proposals(states, logits)
            last = hidden.index_select(0, last_rows)  # a copy: graph outputs are reused by the next replay
            for i, s in enumerate(states):
                self._set_proposals(s, tokens[i : i + 1], [probs[i]], last[i])

    def _split_fill(self, run) -> tuple[list, list, int]:
        """``(padded, ragged, q)``: the jobs whose fill runs as one captured graph of ``q`` rows a
        job, and the rest (eager and ragged: prompt chunks, plain decoding, ...). A job is padded
        when it drafts now, i.e. fills the rows a verify just accepted (1 .. k + 1 of them): its
        padding rows then write draft KV at positions from T on — speculative positions, inside
        the capacity the verify reserved, that the next chain or fill rewrites before anything
        reads them::

            position:  lo ........ T-1 | T ...... lo+q-1
            rows:      accepted (real) | padding (ids 0, context 0)
        """
        if self.graphs is None or self.mode is not SpecMode.EAGLE3:
            return [], run, 0
        padded, ragged = [], []
        for item in run:
            job, _, hi, _ = item
            (padded if self._drafts_now(job, hi) else ragged).append(item)
        if not padded:
            return [], run, 0
        q = max(hi - lo for _, lo, hi, _ in padded)
        limit = self.draft.target_config.max_seq_len
        fits = all(lo + q <= min(j.state.capacity, limit) for j, lo, _, _ in padded)
        if not fits or not self.graphs.covers("fill", len(padded), q):
            return [], run, 0
        return padded, ragged, q

    def _fill_padded(self, run, q: int):
        """The fill of ``run`` as ``q`` rows per job (see ``_split_fill``): returns the layer
        output of every row, the logits of each job's last real row, those rows and the indices
        of the drafting jobs (all of them)."""
        context = torch.cat([rows for _, _, _, rows in run])
        ids: list[int] = []
        dest: list[int] = []
        last: list[int] = []
        for b, (job, lo, hi, _) in enumerate(run):
            n = hi - lo
            ids += job.state.tokens[lo + 1 : hi + 1] + [0] * (q - n)
            dest += range(b * q, b * q + n)
            last.append(b * q + n - 1)
        padded = context.new_zeros((len(run) * q, context.shape[1]))
        # one staged copy for the three index lists (see staging: each copy of its own waited)
        ids_t, dest_t, last_rows = to_device(ids + dest + last, torch.long, self.device).split([len(ids), len(dest), len(last)])
        padded.index_copy_(0, dest_t, context)
        layout = self._layout(run, q)
        out, _plan = self.graphs.run("fill", layout, {"ids": ids_t, "context": padded, "last": last_rows})
        return out["hidden"], out["logits"], last_rows, list(range(len(run)))

    def _fill_mtp(self, run) -> None:
        draft: MTPDraft = self.draft  # type: ignore[assignment]
        K = self.num_layers
        plan = self.backend.plan(self._layout(run))
        drafting, last_rows = self._drafting(run)
        slot_of = {b: i for i, b in enumerate(drafting)}
        # lookahead[row, k-1] = t[i+k] when known, else -(j) for proposal d_j (j >= 1)
        look, owner = [], []
        for b, (job, lo, hi, _) in enumerate(run):
            toks, T = job.state.tokens, job.state.target_len
            for i in range(lo, hi):
                look.append([toks[i + k] if i + k < len(toks) else -(i + k - T) for k in range(1, K + 1)])
                owner.append(slot_of.get(b, -1))
        look_t = to_device(look, torch.long, self.device)
        owner_t = to_device(owner, torch.long, self.device).clamp(min=0)
        states = [run[b][0].state for b in drafting]
        proposals = torch.zeros(len(drafting), K + 1, dtype=torch.long, device=self.device)  # col j = d_j
        probs_cols: list[list[torch.Tensor | None]] = []
        prev = torch.cat([rows for _, _, _, rows in run])
        for k in range(1, K + 1):
            col = look_t[:, k - 1]
            # an unknown token can only be a proposal of an earlier module (j < k)
            fill = proposals[owner_t, (-col).clamp(min=0, max=K)] if drafting else torch.zeros_like(col)
            tokens = torch.where(col >= 0, col, fill)
            out = draft(k, tokens, prev, plan, self.backend, self.pool, logits_indices=last_rows)
            if drafting:
                chosen, probs = choose_proposals(states, out.logits)
                proposals[:, k] = chosen
                probs_cols.append(probs)
            prev = out.hidden
        if drafting:
            hidden = prev.index_select(0, last_rows)
            for i, s in enumerate(states):
                self._set_proposals(s, proposals[i, 1:], [c[i] for c in probs_cols], hidden[i])

    def _set_proposals(self, s: RequestState, tokens: torch.Tensor, probs: list, hidden: torch.Tensor) -> None:
        s.drafts = tokens.clone()
        s.draft_probs = None if s.spec.sampling.greedy else torch.stack(probs)
        s.chain_hidden = hidden

    # -- chain ----------------------------------------------------------------------------------

    def chain(self, wanted: dict[str, int], states: list[RequestState]) -> dict[str, tuple[int, int]]:
        """Extend each state's proposals to ``wanted[rid]`` by self-fed single-position steps
        (one DECODE forward per extra proposal). Mutates states and the last draft layer's KV.
        Returns request id → written position range.

        Batch-wide tensors carry tokens and hidden rows from one position to the next, and each
        state gets its proposals once at the end (a view of one [B, K + n] matrix when every
        request wants as many): per-request tensor ops per position were a measurable share of
        a 64-request step (py-spy on the H200)."""
        written: dict[str, tuple[int, int]] = {}
        todo = [s for s in states if s.drafts is not None and s.chain_hidden is not None
                and len(s.drafts) == self.num_layers and wanted.get(s.request_id, 0) > len(s.drafts)]
        if not todo:
            return written
        need = [wanted[s.request_id] - len(s.drafts) for s in todo]
        base = [self._chain_position(s) for s in todo]
        for s, n, p in zip(todo, need, base):
            written[s.request_id] = (p, p + n)
        tokens = torch.stack([s.drafts[-1] for s in todo])
        hidden = torch.stack([s.chain_hidden for s in todo])
        active = list(range(len(todo)))  # indices into todo still chaining
        cols: list[tuple[torch.Tensor, list[int], list]] = []  # per position: chosen, active, probs
        last_hidden: list[torch.Tensor | None] = [None] * len(todo)
        for j in range(max(need)):
            step_states = [todo[i] for i in active]
            layout = BatchLayout(
                block_tables=[s.table_array() for s in step_states],
                cached_lens=[base[i] + j for i in active],
                query_lens=[1] * len(active),
            )
            if self.graphs is not None and self.graphs.covers("chain", len(active), 1):
                out, _plan = self.graphs.run("chain", layout, {"tokens": tokens, "hidden": hidden})
            else:
                plan = self.backend.plan(layout, AttentionKind.DECODE)
                out = self._chain_fn(plan, tokens, hidden)
            chosen, probs = choose_proposals(step_states, out["logits"])
            cols.append((chosen, active, probs))
            rows = out["hidden"]
            keep = [r for r, i in enumerate(active) if need[i] > j + 1]
            for r, i in enumerate(active):
                if need[i] == j + 1:
                    # a later replay of a graph overwrites its output memory: copy if one follows
                    last_hidden[i] = rows[r].clone() if keep else rows[r]
            if len(keep) < len(active):
                index = to_device(keep, torch.long, self.device)
                tokens, hidden = chosen.index_select(0, index), rows.index_select(0, index)
                active = [active[r] for r in keep]
            else:
                tokens, hidden = chosen, rows
        self._adopt_chain(todo, need, cols, last_hidden)
        return written

    def _adopt_chain(self, todo: list[RequestState], need: list[int], cols, last_hidden) -> None:
        """Append each state's chained proposals (and draft distributions) to it."""
        if all(n == need[0] for n in need):
            full = torch.cat([torch.stack([s.drafts for s in todo]), torch.stack([c[0] for c in cols], dim=1)], dim=1)
            for i, s in enumerate(todo):
                s.drafts = full[i]
        else:
            for i, s in enumerate(todo):
                s.drafts = torch.cat([s.drafts] + [chosen[r : r + 1] for chosen, active, _ in cols
                                                   for r, a in enumerate(active) if a == i])
        for i, s in enumerate(todo):
            s.chain_hidden = last_hidden[i]
            if s.draft_probs is not None:
                extra = [probs[r] for _, active, probs in cols for r, a in enumerate(active) if a == i]
                s.draft_probs = torch.cat([s.draft_probs, torch.stack(extra)])

    def _chain_position(self, s: RequestState) -> int:
        # the newest proposal d_m is t[T+m]; the last layer reads t[i+D] at position i
        return s.target_len + len(s.drafts) - self.span
