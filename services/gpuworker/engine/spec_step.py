"""A whole greedy EAGLE-3 speculative step as one forward: chain, verify, verdict and fill on the
device, so that a captured step is one graph launch and one read-back.

The unfused step (``engine.py``: A chain, B target, C accept, D fill) launches k + 1 forwards,
plans each just before its launch and reads the verdict back between the verify and the fill.
For greedy requests nothing in the step needs the host between the first launch and the verdict:

    inputs (one row per request)      t[L-1] (``last``), d1 and the chain hidden g[T-1] from the
                                      last fill, ``forced`` (benchmarks' forced acceptance, or -1),
                                      ``cap`` (the drafts the request may keep, <= k)
    chain, plans 1 .. k-1             draft layer at T+j-1 reads d_j, g[T+j-2]   -> d_(j+1) = argmax
    verify, plan 0 (cached T, q k+1)  target over [t[L-1], d1 .. dk]             -> g_0 .. g_k (argmax)
    verdict                           n = leading matches of d_j and g_(j-1) (or min(forced, k)),
                                      at most ``cap``
    fill, plan 0 again                draft layer over positions T .. T+k:
                                        ids      d1 .. dn, g_n, 0 ...   (the n+1 final tokens)
                                        context  the verify's aux rows
                                      -> d1' = argmax at row n, g'[T+n] = its hidden

The fill's layout IS the verify's: both cover positions ``[T, T + k + 1)`` of paired pools (the
padded fill of ``DraftRunner._split_fill``, padded to k + 1 rows instead of the batch's longest
accepted run). Its rows past n hold rejected tokens' rows: they write draft KV only at positions
``>= T + n + 1 = T'``, speculative positions that the next chain or fill rewrites before anything
reads them, and causal attention keeps them out of rows ``<= n``::

    position:   T ........ T+n | T+n+1 ....... T+k
    fill rows:  final (n + 1)  | rejected: speculative draft KV, rewritten next step

Two ways to launch it (``EngineConfig.fused_graphs``):

* ``"one"``: the host makes all k plans (the chain's on lanes 1 .. k-1, see
  ``AttentionBackend.plan``), then launches ONE forward (``spec_step_forward``). The device
  idles through every plan of the step.
* ``"split"``: each chain position is a forward of its own on its own lane
  (``chain_position_forward``), launched as soon as it is planned, and the verify, verdict and
  fill one more (``verify_fill_forward``), so that only the first plan runs with the device idle::

      host:    plan 1 | launch | plan 2 | launch | plan 0 (verify) | launch | return
      device:           [chain 1 ]        [chain 2 ]                 [verify · verdict · fill]

Either way nothing is read back inside the step; the host then reads ``accepted``, ``target`` and
``drafts`` in one copy. Tokens equal the unfused step's: the same layers over the same positions
and plans.

A request whose budget is below the batch's k (near ``max_new_tokens``, or a smaller k of its
own) still verifies k drafts, and keeps at most ``cap`` of them: causal attention makes rows
``<= cap`` exactly those of a verify of ``cap`` drafts, so its tokens are the unfused step's, and
the batch stays one launch instead of falling back to phases (with requests ending every few
steps, nearly every step of a busy server has such a request).
"""

from __future__ import annotations

import torch

from services.gpuworker.kv.pool import KVPool
from services.gpuworker.model.draft import DraftModel
from services.gpuworker.model.llama import TargetModel


def spec_lanes(k: int) -> tuple[int, ...]:
    """Query lengths of the step's plans: the verify (and fill), then the k - 1 chain positions."""
    return (k + 1,) + (1,) * (k - 1)


def chain_position_forward(draft: DraftModel, backend, draft_pool: KVPool):
    """``fn(plan, tokens [B], hidden [B, Hc]) -> {"tokens", "hidden"}``: one greedy chain position
    (the EAGLE-3 layer fed its own last proposal and hidden row; ``tokens`` the argmax). Mutates
    the draft pool at the plan's positions."""

    def run(plan, tokens, hidden):
        out = draft(tokens, hidden, plan, backend, draft_pool, context_is_aux=False)
        return {"tokens": torch.argmax(out.logits, dim=-1), "hidden": out.hidden}

    return run


def verify_fill_forward(target: TargetModel, draft: DraftModel, backend, target_pool: KVPool, draft_pool: KVPool,
                        aux_layers: tuple[int, ...]):
    """``fn(plan, ids [B * (k + 1)], forced [B], cap [B]) -> per-request outputs``: the verify
    over each request's ``[t[L-1], d1 .. dk]`` (``ids``, request-major), the verdict (at most
    ``cap`` drafts kept) and the fill, all on the verify's plan. Outputs as
    ``spec_step_forward``'s (``drafts`` are ``ids``' last k columns). Mutates both pools."""

    def run(plan, ids, forced, cap):
        batch = forced.shape[0]
        k = ids.shape[0] // batch - 1
        drafts = ids.view(batch, k + 1)[:, 1:]
        out = target(ids, plan, backend, target_pool, aux_layers=aux_layers)
        greedy = torch.argmax(out.logits, dim=-1).view(batch, k + 1)
        matched = (drafts == greedy[:, :k]).long().cumprod(dim=1).sum(dim=1)
        accepted = torch.minimum(torch.where(forced >= 0, forced.clamp(max=k), matched), cap)
        cols = torch.arange(k + 1, device=ids.device).unsqueeze(0)
        n = accepted.unsqueeze(1)
        bonus = greedy.gather(1, n)
        padded = torch.cat([drafts, torch.zeros_like(bonus)], dim=1)
        fill_ids = torch.where(cols < n, padded, torch.where(cols == n, bonus, torch.zeros_like(padded))).reshape(-1)
        context = out.aux_hidden if aux_layers else out.hidden
        last_rows = torch.arange(batch, device=ids.device) * (k + 1) + accepted
        fill = draft(fill_ids, context, plan, backend, draft_pool, context_is_aux=True, logits_indices=last_rows)
        return {"drafts": drafts, "target": greedy, "accepted": accepted,
                "next_draft": torch.argmax(fill.logits, dim=-1), "next_hidden": fill.hidden.index_select(0, last_rows)}

    return run


def spec_step_forward(target: TargetModel, draft: DraftModel, backend, target_pool: KVPool, draft_pool: KVPool,
                      aux_layers: tuple[int, ...]):
    """``fn(plans, last [B], d1 [B], hidden [B, Hc], forced [B], cap [B]) -> per-request outputs``:

    * ``drafts`` [B, k]: d1 .. dk, the proposals verified;
    * ``target`` [B, k + 1]: the target's argmax after t[L-1], d1 .. dk;
    * ``accepted`` [B]: n <= cap, the drafts kept (the step's tokens are d1 .. dn, target[n]);
    * ``next_draft`` [B], ``next_hidden`` [B, Hc]: the fill's proposal d1' and the draft layer's
      hidden at the newest position (what the next step's chain reads).

    The chain positions and ``verify_fill_forward`` in one forward (``"one"`` above). Mutates both
    pools (see the module docstring for positions). The same function runs eagerly (graph padding
    on CPU) and under a graph."""
    position = chain_position_forward(draft, backend, draft_pool)
    verify_fill = verify_fill_forward(target, draft, backend, target_pool, draft_pool, aux_layers)

    def run(plans, last, d1, hidden, forced, cap):
        proposals, out = [d1], {"tokens": d1, "hidden": hidden}
        for plan in plans[1:]:
            out = position(plan, out["tokens"], out["hidden"])
            proposals.append(out["tokens"])
        ids = torch.stack([last, *proposals], dim=1).reshape(-1)
        return verify_fill(plans[0], ids, forced, cap)

    return run
