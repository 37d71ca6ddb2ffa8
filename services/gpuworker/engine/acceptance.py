"""Speculative acceptance: which draft tokens a verification keeps, and the one token after them.

A verification step fed the target ``[last accepted token, d1 .. dk]`` and got one prediction per
fed position, so there are k+1 target rows::

    fed:        t[L-1]   d1      d2     ...  dk
    target row:   0       1       2     ...   k
    checks:      d1?     d2?     d3?    ... (bonus)

* Greedy: accept the longest prefix of drafts equal to the target's argmax, then append the
  argmax at the first mismatch (a correction) or after the last draft (the bonus token).
* Sampled (temperature > 0), Leviathan et al. 2023 / Chen et al. 2023: accept ``d_j`` with
  probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection sample from
  ``norm(max(0, p_j − q_j))``; if all k are accepted, sample the bonus from ``p_k``. The output is
  then distributed exactly as sampling from p alone. p and q must be the *transformed*
  distributions (temperature, top-k, top-p applied identically), and drafts must have been
  sampled from q.
* Forced (benchmarks only): accept exactly ``a`` drafts whatever they are, then take the target's
  token at row ``a`` (argmax, or a sample from ``p_a``). Output is then NOT the target's.

Functions here are pure: randomness comes in as uniforms the caller drew.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from services.common.errors import InvalidArgument
from services.gpuworker.engine.sampling import sample_rows


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one request's drafts: ``tokens`` = accepted drafts + one more token."""

    accepted: int
    tokens: tuple[int, ...]


def accept_greedy(drafts: Sequence[int], target_argmax: Sequence[int], forced: int | None = None) -> Verdict:
    """Greedy verification of one request. ``target_argmax`` has ``len(drafts) + 1`` entries."""
    k = len(drafts)
    if len(target_argmax) != k + 1:
        raise InvalidArgument(f"need {k + 1} target predictions for {k} drafts, got {len(target_argmax)}")
    if forced is not None:
        if not 0 <= forced <= k:
            raise InvalidArgument(f"forced acceptance {forced} outside [0, {k}]")
        n = forced
    else:
        n = 0
        while n < k and drafts[n] == target_argmax[n]:
            n += 1
    return Verdict(n, tuple(int(d) for d in drafts[:n]) + (int(target_argmax[n]),))


def accept_sampled_batch(
    drafts: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    num_drafts: torch.Tensor,
    u_accept: torch.Tensor,
    u_token: torch.Tensor,
    forced: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sampling verification of B requests at once, padded to K drafts. Pure.

    Shapes: ``drafts [B, K]`` (long), ``q [B, K, V]`` draft probabilities the drafts were sampled
    from, ``p [B, K+1, V]`` target probabilities, ``num_drafts [B]`` real drafts per row (≤ K;
    padding past it is ignored), ``u_accept [B, K]`` and ``u_token [B]`` uniforms in [0, 1),
    ``forced [B]`` accepted count to force, or −1 for a real verification.

    Returns ``(accepted [B], token [B])``: how many drafts are kept and the token after them.
    """
    b, k = drafts.shape
    if q.shape[:2] != (b, k) or p.shape[:2] != (b, k + 1) or q.shape[2] != p.shape[2]:
        raise InvalidArgument(f"shape mismatch: drafts {tuple(drafts.shape)}, q {tuple(q.shape)}, p {tuple(p.shape)}")
    dev = p.device
    num_drafts = num_drafts.to(dev)
    cols = torch.arange(k, device=dev).unsqueeze(0)
    if k > 0:
        idx = drafts.unsqueeze(-1)
        p_d = p[:, :k].gather(-1, idx).squeeze(-1).double()
        q_d = q.gather(-1, idx).squeeze(-1).double()
        # u < p/q  ⇔  u·q < p; avoids dividing by a q(d) that rounds to 0.
        ok = u_accept.to(dev, torch.float64) * q_d < p_d
        ok &= cols < num_drafts.unsqueeze(1)
        accepted = torch.cumprod(ok.long(), dim=1).sum(dim=1)
    else:
        accepted = torch.zeros(b, dtype=torch.long, device=dev)
    rejected = accepted < num_drafts
    if forced is not None:
        forced = forced.to(dev)
        is_forced = forced >= 0
        accepted = torch.where(is_forced, forced, accepted)
        rejected = rejected & ~is_forced
    rows = torch.arange(b, device=dev)
    p_row = p[rows, accepted]
    if k > 0:
        q_row = q[rows, accepted.clamp(max=k - 1)]
        residual = (p_row - q_row).clamp(min=0)
        # p == q up to rounding leaves no residual mass; then p itself is the right fallback.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_row)
        dist = torch.where(rejected.unsqueeze(-1), residual, p_row)
    else:
        dist = p_row
    token = sample_rows(dist, u_token)
    return accepted, token
