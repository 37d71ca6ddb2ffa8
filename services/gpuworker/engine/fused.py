"""Fused speculative steps: a greedy EAGLE-3 step's decodes as one launch (``spec_step.py``), its
verdict read back at the start of the next step, and the next step launched from that verdict
before the host applies it (``FusedSteps._continue_fused``) whenever the next batch is known
without it. ``Engine`` inherits these methods; they read and move its requests, ledger and
graphs, and call its acceptance bookkeeping (``_count_verify``, ``_append``, ``_reserve``,
``_run_target``, ``_accept``).

A busy server's step (requests ending and arriving)::

    host:    read verdict N ─ project ─ plan, launch N+1 ─┐ apply N ─ schedule prompts ─ run them ─ return
    device:  [ step N ]                                   └ [ step N+1 ......................................
                       |<────────── device idle ─────────>|
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from services.gpuworker.attention.base import BatchLayout
from services.gpuworker.engine.drafting import FillJob
from services.gpuworker.engine.readback import Readback
from services.gpuworker.engine.request import RequestState
from services.gpuworker.engine.scheduler import ScheduledWork, draft_budget, leading_decodes, schedule
from services.gpuworker.staging import to_device


class FusedSteps:
    """The fused-step half of ``Engine`` (a mixin: every attribute it uses is the engine's)."""

    def _fused_k(self, work: list[ScheduledWork]) -> int:
        """The k of a step whose decodes run as one fused forward (``spec_step.py``), or 0: every
        decode row (prompt chunks may follow them) a greedy decode (no penalties, no logprobs, no
        token still on the device), its draft KV complete up to its target KV, holding the one
        proposal and chain hidden an EAGLE-3 fill left if it drafts at all; k the most drafts any
        of them verifies (>= 1), the others verifying k too and keeping at most their own count
        (``_launch_fused``'s caps), as long as k more positions stay inside the model; the decode
        batch and k covered by the captured graphs. Pure."""
        graphs = self.graphs
        if not work or graphs is None or not self.config.fused_spec or self.drafter is None:
            return 0
        decodes = work[: leading_decodes(work)]
        if not decodes:
            return 0
        k = max(w.num_drafts for w in decodes)
        # one launch registers "spec" (keyed k), the other "spec_verify" (keyed q = k + 1)
        if k < 1 or not (graphs.covers("spec", len(decodes), k) or graphs.covers("spec_verify", len(decodes), k + 1)):
            return 0
        positions = self.target.config.max_seq_len
        for w in decodes:
            s = w.state
            if not self._fusable(s, w.num_drafts):
                return 0
            if w.num_drafts < k and s.logical_len + k > positions:  # its padded verify would pass the model's last position
                return 0
        return k

    def _continue_fused(self, states: list[RequestState]) -> tuple[set[str], int, int, dict[str, int], list[FillJob]] | None:
        """With overlap: launch the next fused step straight from the last one's verdict, and
        only then apply that verdict (tokens, stop rules, counts, proposals) and schedule the
        prompt chunks beside, so the device runs step N+1 while the host does step N's
        bookkeeping::

            scheduled:  read verdict N, apply it, schedule, reserve, plan, launch N+1, prompts
            continued:  read verdict N, project,             plan, launch N+1, apply it, prompts

        Only where the decodes the scheduler would pick are known without applying the verdict:
        verdict N's requests minus those it ends (a stop rule fires on its tokens) or that were
        aborted, plus requests whose prompt ended since (their first proposal on the host, from
        the fill), in arrival order; each greedy and fusable (``_fusable``), drafting its budget
        within the capacity it holds (no extend; a smaller budget than the batch's k is a cap,
        as in ``_fused_k``), all of them inside the step's batch and token limits; no plain
        decode's token pending. Anything else returns None before touching a thing, and the step
        is scheduled. After the launch the real schedule must pick exactly those decodes with
        those budgets (else RuntimeError: a bug); its prompt chunks run beside, as in
        ``_scheduled_step``. Returns what ``_scheduled_step`` returns. Mutates as
        ``_launch_fused``, ``_apply_verdict`` and ``_scheduled_step``."""
        last = self._verdict
        if last is None or self._lagging is not None:
            return None
        cfg, k_last, max_seq_len = self.config, last.k, self.max_seq_len
        rows = last.rows()  # the step's one wait for the device
        self._device_wait_s += last.take_wait()
        row_of = {id(s): i for i, s in enumerate(last.states)}  # (an aborted one is no longer in states)
        batch: list[RequestState] = []
        sources: list[int | None] = []  # each row's row of verdict N, None for a newcomer (its state)
        starts: list[int] = []
        caps: list[int] = []
        prompts_wait = False
        for s in states:
            source = row_of.get(id(s))
            if source is not None:
                tokens = accepted_tokens(rows[source], k_last)
                if not self._no_stop_rule_fires(s, tokens):
                    continue  # it ends on them: not in the next batch
                start, budget = s.logical_len + len(tokens) - 1, draft_budget(s, max_seq_len, ahead=len(tokens))
            elif s.in_prefill:
                prompts_wait = True  # scheduled beside, below
                continue
            elif s.last_step:
                continue
            else:  # decoding, outside verdict N: its prompt ended since
                start, budget = s.target_len, draft_budget(s, max_seq_len)
                if not self._fusable(s, budget):
                    return None
            if start + 1 + budget > s.capacity:  # the step's needed capacity: an extend first
                return None
            batch.append(s)
            sources.append(source)
            starts.append(start)
            caps.append(budget)
        k = max(caps, default=0)
        b = len(batch)
        if (k < 1 or b > cfg.max_batch_size or b + sum(caps) > cfg.max_batch_tokens
                or not (self.graphs.covers("spec", b, k) or self.graphs.covers("spec_verify", b, k + 1))):
            return None
        if min(caps) < k:
            positions = self.target.config.max_seq_len
            if any(start + 1 + k > positions for start, cap in zip(starts, caps) if cap < k):
                return None  # a padded verify would pass the model's last position
        same = k == k_last and b == len(last.states) and all(src is not None for src in sources)
        self._verdict = None
        self._in_step = batch
        starts_a = np.asarray(starts, dtype=np.int64)
        if same:  # verdict N's batch as it was: its tensors and layout serve as they are
            verdict = self._launch_fused(batch, k, starts_a, last_step=last, caps=caps)
        else:
            verdict = self._launch_fused(batch, k, starts_a, caps=caps, feed=self._feed(last, batch, sources))
        self._verdict = verdict
        self.continued_steps += 1
        ledger = self._ledger
        for s in batch:  # a scheduled request reports this step even if it streams nothing
            ledger[s.request_id].emit(())
        draft_rows = self._apply_verdict(last)
        self._carry = None  # spent: the step just launched took it; its own verdict carries next
        for s, start in zip(batch, starts):
            if s.finished or s.target_len != start:  # the projection and the bookkeeping disagree: a bug
                raise RuntimeError(f"continued fused step: {s.request_id} ended or moved to {s.target_len}, not {start}")
        prompts: list[ScheduledWork] = []
        if prompts_wait:  # the real schedule: its decodes must be the batch launched, its prompts run beside
            work = schedule([s for s in states if not s.last_step], max_batch_tokens=cfg.max_batch_tokens,
                            max_batch_size=cfg.max_batch_size, chunk_size=cfg.chunk_size, max_seq_len=max_seq_len,
                            step=self._steps, prefill_wait_steps=cfg.prefill_wait_steps, prefill_batch=cfg.prefill_batch)
            n_dec = leading_decodes(work)
            if [w.state for w in work[:n_dec]] != batch or [w.num_drafts for w in work[:n_dec]] != caps:
                raise RuntimeError("continued fused step: the scheduler picked other decodes than the projection: "
                                   f"{[(w.state.request_id, w.num_drafts) for w in work[:n_dec]]} vs "
                                   f"{[(s.request_id, c) for s, c in zip(batch, caps)]}")
            prompts = work[n_dec:]
        self._steps += 1
        extend_wants, fill_jobs = {}, []
        if prompts:
            self._in_step = batch + [w.state for w in prompts]
            for w in prompts:
                self._ledger[w.state.request_id].emit(())
            extend_wants, waiting = self._reserve(prompts)
            prompts = [w for w in prompts if not w.state.finished and w.state.request_id not in waiting]
            for w in prompts:
                self._ledger[w.state.request_id].prefill_tokens = w.num_target_tokens
            if prompts:
                launched = self._run_target(prompts)
                self._committed = True  # from here on, request state moves: no isolation (see step)
                fill_jobs = self._accept(prompts, *launched)
        target_tokens = b + sum(caps) + sum(w.num_target_tokens for w in prompts)
        in_work = {s.request_id for s in batch}
        in_work.update(w.state.request_id for w in prompts)
        return in_work, target_tokens, draft_rows, extend_wants, fill_jobs

    def _fusable(self, s: RequestState, num_drafts: int) -> bool:
        """Whether ``s`` may decode in a fused step drafting ``num_drafts``: greedy, no penalties
        or logprobs, no token still on the device, its draft KV complete up to its target KV,
        and (if it drafts at all) holding the one proposal and chain hidden an EAGLE-3 fill
        left. Pure."""
        return (s.spec.sampling.greedy and s.gen_counts is None and s.spec.logprobs is None
                and s.pending_token is None and not s.pending_hidden and s.draft_len == s.target_len
                and (not num_drafts or (s.drafts is not None and len(s.drafts) == 1 and s.chain_hidden is not None)))

    def _feed(self, last: "PendingVerdict", batch: list[RequestState], sources: list[int | None]):
        """The inputs of a fused step over ``batch``: a row of ``last`` (its newest token and
        next proposal, still on the device) for each request it carries, the state's own for a
        newcomer. Pure (device copies and gathers)."""
        tokens, drafts, hidden = last.next_last, last.next_draft, last.next_hidden
        newcomers = [s for s, src in zip(batch, sources) if src is None]
        if newcomers:
            n_d, n_h = self._proposals(newcomers, like=(drafts, hidden))
            tokens = torch.cat([tokens, to_device([s.tokens[-1] for s in newcomers], torch.long, self.device)])
            drafts, hidden = torch.cat([drafts, n_d]), torch.cat([hidden, n_h])
        n, j, index = len(last.states), 0, []
        for src in sources:
            if src is None:
                index.append(n + j)
                j += 1
            else:
                index.append(src)
        index_t = to_device(index, torch.long, self.device)
        return tokens.index_select(0, index_t), drafts.index_select(0, index_t), hidden.index_select(0, index_t)

    def _launch_fused(self, states: list[RequestState], k: int, starts: np.ndarray | None = None,
                      last_step: "PendingVerdict | None" = None, caps: list[int] | None = None,
                      feed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> "PendingVerdict":
        """A-D of a fused step's decodes (see ``_fused_k``): plan the verify and the k - 1 chain
        positions and launch once. ``caps``: the drafts each request may keep (None: k each);
        one below k still verifies k, its positions past its capacity on the graphs' scratch
        page (only rows past its cap, whose outputs are dropped, read them)::

            positions:  start ... start + cap | ... start + k      capacity >= start + cap + 1
            verify:     kept (at most cap + 1 tokens)  | dropped    past capacity: the scratch page

        Moves no request state: the verdict is applied by
        ``_apply_verdict``, in this step, or with ``overlap`` at the start of the next one, so
        that the caller's own per-step work (streaming, publishing) runs while the device does::

            step N:    plan, launch N ─────────────────┐ return ── caller's work ──┐
            device:                  [ fused step N .............. ]               │
            step N+1:                                  read verdict N, apply, plan, launch N+1

        ``starts`` (each request's first position) and either ``last_step`` (the verdict of the
        step before over the same requests in order) or ``feed`` (each request's newest token,
        proposal and chain hidden row, batched: ``_feed``) are given by ``_continue_fused``,
        which launches before that verdict is applied; by default they come from the states and
        the carry. Mutates both pools (on the device), the ledger's written ranges and the fused
        step counter."""
        b = len(states)
        tables = [s.table_array() for s in states]
        if starts is None:
            starts = np.fromiter((s.target_len for s in states), dtype=np.int64, count=b)
            carry = self._carry  # the last fused step's, when it ran these requests in this order
            if (carry is not None and len(carry.drafts) == b
                    and all(s is t and s.drafts is d for s, t, d in zip(states, carry.verdict.states, carry.drafts))):
                last_step = carry.verdict
        if caps is not None and min(caps) == k:
            caps = None  # every request keeps up to k: the shared row tensor
        if caps is not None:
            scratch = np.array([self.graphs.scratch_block], dtype=np.int64)
            for i, (s, start) in enumerate(zip(states, starts.tolist())):
                if start + k + 1 > s.capacity:  # one block at most: k < block_size (graph q <= block_size)
                    tables[i] = np.concatenate([tables[i], scratch])
        if (last_step is not None and last_step.verify.arrays.uniform_q == k + 1
                and all(t is u for t, u in zip(tables, last_step.tables))):
            verify = last_step.verify.with_cached_lens(starts)  # same tables: no conversion, no check
        else:
            verify = BatchLayout(tables, starts, np.full(b, k + 1, dtype=np.int64))
        layouts = [verify] + [verify.shifted(j - 1, 1) for j in range(1, k)]  # the chain: same tables
        forced = self._forced(k)
        forced = -1 if forced is None else forced
        forced_t = self._rows_of(b, forced)
        cap_t = self._rows_of(b, k) if caps is None else to_device(caps, torch.long, self.device)
        if feed is not None:  # built by the caller (``_feed``)
            last, d1, hidden = feed
        elif last_step is not None:  # the same requests, in order: their newest tokens and proposals are on the device
            last, d1, hidden = last_step.next_last, last_step.next_draft, last_step.next_hidden
        else:
            last = to_device([s.tokens[-1] for s in states], torch.long, self.device)
            d1, hidden = self._proposals(states)
        for s, start in zip(states, starts.tolist()):
            self._ledger[s.request_id].written.append((start, min(start + k + 1, s.capacity)))
        inputs = {"forced": forced_t, "cap": cap_t}
        if self.config.fused_graphs == "one":
            out = self.graphs.run_lanes("spec", k, layouts, {"last": last, "d1": d1, "hidden": hidden, **inputs})
        else:
            out = self._launch_split(layouts, last, d1, hidden, inputs)
        self.fused_steps += 1
        # each request's newest token after the verdict: the target's token after its accepted run
        # (a request whose stop rule cut the run short ends, and with it the next step's match)
        bonus = out["target"].gather(1, out["accepted"].unsqueeze(1)).squeeze(1)
        # copies: a graph's outputs are rewritten by its next replay
        return PendingVerdict(torch.cat([out["accepted"].unsqueeze(1), out["target"], out["drafts"]], dim=1),
                               states, k, out["next_draft"].clone(), out["next_hidden"].clone(), bonus, verify, tables,
                               caps)

    def _rows_of(self, b: int, value: int) -> torch.Tensor:
        """A device row of ``b`` copies of ``value`` (a fused step's forced count or cap), made
        once: inputs are copied into the graphs' buffers, so one tensor serves every step."""
        t = self._constant_rows.get((b, value))
        if t is None:
            t = self._constant_rows[(b, value)] = to_device([value] * b, torch.long, self.device)
        return t

    def _proposals(self, states: list[RequestState], like: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's proposal d1 and chain hidden row, batched; a request drafting nothing
        this step (its budget spent: it keeps no draft) feeds zeros, whose rows its cap drops
        (shaped as another request's, or as ``like``'s rows: batched proposals and hidden rows)."""
        if all(s.drafts is not None for s in states):
            return torch.cat([s.drafts for s in states]), torch.stack([s.chain_hidden for s in states])
        some = next((s for s in states if s.drafts is not None), None)
        if some is not None:
            no_token, no_hidden = torch.zeros_like(some.drafts), torch.zeros_like(some.chain_hidden)
        else:
            no_token, no_hidden = torch.zeros_like(like[0][:1]), torch.zeros_like(like[1][0])
        return (torch.cat([no_token if s.drafts is None else s.drafts for s in states]),
                torch.stack([no_hidden if s.chain_hidden is None else s.chain_hidden for s in states]))

    def _launch_split(self, layouts: list[BatchLayout], last, d1, hidden, verdict_inputs) -> dict[str, torch.Tensor]:
        """``fused_graphs="split"``: chain position j planned on lane j and launched at once, the
        verify, verdict and fill planned last (on lane 0) while the chain runs. All graphs share
        one memory pool, so a later replay may overwrite an earlier graph's outputs (which of
        them depends on the capture order): each proposal is copied into the verify's ids as
        soon as its graph is queued, and the next position's inputs are staged before it runs."""
        ids = torch.empty((last.shape[0], len(layouts) + 1), dtype=torch.long, device=last.device)
        ids[:, 0], ids[:, 1] = last, d1
        out = {"tokens": d1, "hidden": hidden}
        for j, layout in enumerate(layouts[1:], start=1):
            out, _plan = self.graphs.run(f"spec_chain{j}", layout, {"tokens": out["tokens"], "hidden": out["hidden"]})
            ids[:, j + 1].copy_(out["tokens"])
        out, _plan = self.graphs.run("spec_verify", layouts[0], {"ids": ids.view(-1), **verdict_inputs})
        return out

    def _resolve_verdict(self) -> int:
        """Apply a fused step's verdict left on the device (overlap), if any; see ``_apply_verdict``.
        Like the plain-decode lagging tokens, this is the outcome of a step that completed, not
        of this one: it does not commit this step (a newcomer whose first step fails still ends
        alone, see ``step``)."""
        verdict, self._verdict = self._verdict, None
        return self._apply_verdict(verdict) if verdict is not None else 0

    def _apply_verdict(self, verdict: "PendingVerdict") -> int:
        """Read a fused step's verdict back (waits for it) and move every state of that step that
        is still live as ``_accept`` and the fill would: tokens, stop rules, counts, lengths, the
        next proposal. The fill's rows are the verify's, already counted as written by that step.
        Returns the draft rows made final. Mutates the states, the ledger and the carry."""
        k = verdict.k
        rows = verdict.rows()  # the step's one read-back
        self._device_wait_s += verdict.take_wait()
        kept: list[torch.Tensor | None] = []
        draft_rows = 0
        # per-request views made in two calls (indexing row by row cost ~1 us a view)
        next_drafts, next_hidden = verdict.next_draft.split(1), verdict.next_hidden.unbind(0)
        caps = verdict.caps
        for i, (s, row) in enumerate(zip(verdict.states, rows)):
            if self._states.get(s.request_id) is not s:
                kept.append(None)
                continue  # aborted since
            entry = self._ledger[s.request_id]
            self._count_verify(entry, k if caps is None else caps[i], row[0])
            entry.emit(self._append(s, accepted_tokens(row, k)))
            t_old = s.target_len
            s.target_len = s.logical_len - 1  # the newest token is fed next step
            # the fill made draft KV final up to the new target length (a stop cuts it shorter)
            s.draft_len = s.target_len
            draft_rows += s.target_len - t_old
            s.draft_probs = None
            if not s.finished and draft_budget(s, self.max_seq_len) > 0:
                s.drafts, s.chain_hidden = next_drafts[i], next_hidden[i]
            else:
                s.drafts = s.chain_hidden = None
            kept.append(s.drafts)
        self._carry = FusedCarry(kept, verdict)
        return draft_rows


def accepted_tokens(row: list[int], k: int) -> list[int]:
    """The tokens a fused verdict row ``[accepted n, target argmax (k + 1), drafts (k)]`` accepts:
    the first n drafts, then the target's token after them. Pure."""
    n = row[0]
    return row[k + 2 : k + 2 + n] + [row[1 + n]]


@dataclasses.dataclass(slots=True)
class FusedCarry:
    """What an applied fused step leaves the next one: a next step over the same requests in the
    same order feeds ``verdict``'s batch tensors as they are (newest tokens, proposals, chain
    hidden rows) and, while no table was replaced, moves its verify layout to the new lengths.
    ``drafts[i]`` is the view request i holds (None: it ended or was aborted); any change to a
    request's proposals breaks the identity and the match."""

    drafts: list[torch.Tensor | None]
    verdict: "PendingVerdict"


class PendingVerdict(Readback):
    """A fused step's verdict rows ``[accepted, target argmax (k + 1), drafts (k)]`` per request
    of ``states``, its next proposals and each request's newest token (device tensors, copies of
    the graph's outputs), the verify's layout over ``tables`` (what ``FusedCarry`` hands on) and
    the drafts each request might keep (``caps``; None: k each)."""

    def __init__(self, rows: torch.Tensor, states: list[RequestState], k: int, next_draft: torch.Tensor,
                 next_hidden: torch.Tensor, next_last: torch.Tensor, verify: BatchLayout, tables: list[np.ndarray],
                 caps: list[int] | None = None):
        super().__init__(rows)
        self._rows: list[list[int]] | None = None
        self.states, self.k, self.caps = states, k, caps
        self.next_draft, self.next_hidden, self.next_last = next_draft, next_hidden, next_last
        self.verify, self.tables = verify, tables

    def rows(self) -> list[list[int]]:
        """The verdict rows on the host (the first call waits for the step and copies)."""
        if self._rows is None:
            self._rows = self.values()
        return self._rows
