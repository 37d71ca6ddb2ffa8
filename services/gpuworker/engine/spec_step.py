"""A whole greedy EAGLE-3 speculative step as one forward: chain, verify, verdict and fill on the
device, so that a captured step is one graph launch and one read-back.

The unfused step (``engine.py``: A chain, B target, C accept, D fill) launches k + 1 forwards,
plans each just before its launch and reads the verdict back between the verify and the fill.
For greedy requests nothing in the step needs the host between the first launch and the verdict:

    inputs (one row per request)      t[L-1] (``last``), d1 and the chain hidden g[T-1] from the
                                      last fill, ``forced`` (benchmarks' forced acceptance, or -1)
    chain, plans 1 .. k-1             draft layer at T+j-1 reads d_j, g[T+j-2]   -> d_(j+1) = argmax
    verify, plan 0 (cached T, q k+1)  target over [t[L-1], d1 .. dk]             -> g_0 .. g_k (argmax)
    verdict                           n = leading matches of d_j and g_(j-1) (or min(forced, k))
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

The host plans all k plans before the launch (the chain's on lanes 1 .. k-1, see
``AttentionBackend.plan``), then reads back ``accepted``, ``target`` and ``drafts`` in one copy.
Tokens equal the unfused step's: the same layers over the same positions and plans.
"""

from __future__ import annotations

import torch

from services.gpuworker.kv.pool import KVPool
from services.gpuworker.model.draft import DraftModel
from services.gpuworker.model.llama import TargetModel


def spec_lanes(k: int) -> tuple[int, ...]:
    """Query lengths of the step's plans: the verify (and fill), then the k - 1 chain positions."""
    return (k + 1,) + (1,) * (k - 1)


def spec_step_forward(target: TargetModel, draft: DraftModel, backend, target_pool: KVPool, draft_pool: KVPool,
                      aux_layers: tuple[int, ...]):
    """``fn(plans, last [B], d1 [B], hidden [B, Hc], forced [B]) -> per-request outputs``:

    * ``drafts`` [B, k]: d1 .. dk, the proposals verified;
    * ``target`` [B, k + 1]: the target's argmax after t[L-1], d1 .. dk;
    * ``accepted`` [B]: n, the drafts kept (the step's tokens are d1 .. dn, target[n]);
    * ``next_draft`` [B], ``next_hidden`` [B, Hc]: the fill's proposal d1' and the draft layer's
      hidden at the newest position (what the next step's chain reads).

    Mutates both pools (see the module docstring for positions). The same function runs eagerly
    (graph padding on CPU) and under a graph."""

    def run(plans, last, d1, hidden, forced):
        verify, chain = plans[0], plans[1:]
        batch, k = last.shape[0], len(chain) + 1
        proposals, token, h = [d1], d1, hidden
        for plan in chain:
            out = draft(token, h, plan, backend, draft_pool, context_is_aux=False)
            token, h = torch.argmax(out.logits, dim=-1), out.hidden
            proposals.append(token)
        drafts = torch.stack(proposals, dim=1)
        ids = torch.cat([last.unsqueeze(1), drafts], dim=1).reshape(-1)
        out = target(ids, verify, backend, target_pool, aux_layers=aux_layers)
        greedy = torch.argmax(out.logits, dim=-1).view(batch, k + 1)
        matched = (drafts == greedy[:, :k]).long().cumprod(dim=1).sum(dim=1)
        accepted = torch.where(forced >= 0, forced.clamp(max=k), matched)
        cols = torch.arange(k + 1, device=last.device).unsqueeze(0)
        n = accepted.unsqueeze(1)
        bonus = greedy.gather(1, n)
        padded = torch.cat([drafts, torch.zeros_like(bonus)], dim=1)
        fill_ids = torch.where(cols < n, padded, torch.where(cols == n, bonus, torch.zeros_like(padded))).reshape(-1)
        context = out.aux_hidden if aux_layers else out.hidden
        last_rows = torch.arange(batch, device=last.device) * (k + 1) + accepted
        fill = draft(fill_ids, context, verify, backend, draft_pool, context_is_aux=True, logits_indices=last_rows)
        return {"drafts": drafts, "target": greedy, "accepted": accepted,
                "next_draft": torch.argmax(fill.logits, dim=-1), "next_hidden": fill.hidden.index_select(0, last_rows)}

    return run
