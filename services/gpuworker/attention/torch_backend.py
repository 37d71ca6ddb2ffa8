"""Reference paged attention in plain PyTorch (CPU or GPU, any dtype; math in float32).

Gathers each request's K/V from its pages into a dense tensor and runs masked softmax attention:

    pages of request r:  [ 7 ][ 2 ][ 9 ]   ->  K_r [kv_len, kv_heads, head_dim]   (slots 7*bs.., 2*bs.., ..)
    query at position p  attends K_r[0..p]  (causal within the request, nothing across requests)

DECODE / VERIFY (uniform query length) run as one padded batch; PREFILL (ragged) loops over the
requests so a long prompt chunk never pads every other request to its length.
"""

from __future__ import annotations

import torch

from services.gpuworker.attention.base import AttentionBackend, AttentionKind, AttentionPlan, Workspace


class TorchBackend(AttentionBackend):
    """The reference backend: correctness first, the FlashInfer backend is compared against it."""

    name = "torch"

    def _finish_plan(self, plan: AttentionPlan, ws: Workspace) -> None:
        """Index tensors for the gathers; built once per forward, reused by every layer."""
        bs = self.geometry.block_size
        dev = self.device
        slots = plan.slot_mapping
        plan.extras["write_pages"] = torch.div(slots, bs, rounding_mode="floor")
        plan.extras["write_offsets"] = slots % bs
        tables = plan.block_tables.long().clamp(min=0)  # -1 padding is always masked out below
        if plan.kind is AttentionKind.PREFILL:
            per_request = []
            start = 0
            a = plan.layout.arrays
            for r, (q, kv) in enumerate(zip(a.q.tolist(), a.kv.tolist())):
                j = torch.arange(kv, device=dev)
                pos = plan.positions[start : start + q]
                per_request.append(
                    (start, start + q, tables[r, j // bs], j % bs, j.unsqueeze(0) <= pos.unsqueeze(1))
                )
                start += q
            plan.extras["per_request"] = per_request
        else:
            B, Q, L = plan.batch_size, plan.query_len, plan.max_kv_len
            j = torch.arange(L, device=dev)
            pos = plan.positions.view(B, Q)
            plan.extras["pages"] = tables[:, j // bs]  # [B, L]
            plan.extras["offsets"] = (j % bs).unsqueeze(0).expand(B, L)
            plan.extras["mask"] = j.view(1, 1, L) <= pos.unsqueeze(-1)  # [B, Q, L]

    def _write_kv(self, plan: AttentionPlan, kv_layer, k, v) -> None:
        pages, offs = plan.extras["write_pages"], plan.extras["write_offsets"]
        kv_layer[pages, 0, offs] = k.to(kv_layer.dtype)
        kv_layer[pages, 1, offs] = v.to(kv_layer.dtype)

    def _attend(self, plan: AttentionPlan, q, kv_layer, scale: float) -> torch.Tensor:
        if plan.kind is AttentionKind.PREFILL:
            out = torch.empty_like(q)
            for t0, t1, pages, offs, mask in plan.extras["per_request"]:
                k = kv_layer[pages, 0, offs].unsqueeze(0)
                v = kv_layer[pages, 1, offs].unsqueeze(0)
                o = _masked_attention(q[t0:t1].unsqueeze(0), k, v, mask.unsqueeze(0), scale)
                out[t0:t1] = o[0].to(q.dtype)
            return out
        B, Q = plan.batch_size, plan.query_len
        pages, offs = plan.extras["pages"], plan.extras["offsets"]
        k = kv_layer[pages, 0, offs]  # [B, L, kvh, hd]
        v = kv_layer[pages, 1, offs]
        o = _masked_attention(q.view(B, Q, *q.shape[1:]), k, v, plan.extras["mask"], scale)
        return o.reshape(q.shape).to(q.dtype)


def _masked_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """q [B, Q, qh, d], k/v [B, L, kvh, d], mask [B, Q, L] (True = may attend) -> [B, Q, qh, d]
    in float32. Query head h reads kv head h // (qh // kvh)."""
    B, Q, qh, d = q.shape
    kvh = k.shape[2]
    g = qh // kvh
    qf = q.float().view(B, Q, kvh, g, d)
    scores = torch.einsum("bqhgd,blhd->bhgql", qf, k.float()) * scale
    scores = scores.masked_fill(~mask.view(B, 1, 1, Q, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgql,blhd->bqhgd", probs, v.float())
    return out.reshape(B, Q, qh, d)
