"""A dense (unpaged) forward of the target for training: ``[B, T]`` token ids in, causal
attention by ``scaled_dot_product_attention``, no KV pool.

Serving runs ``TargetModel.forward`` over paged KV; training a model from scratch (``tandem
train-demo``) needs gradients and long batches, which the paged path does not aim at. Both read
the same parameters and the same RoPE tables, so what this trains is what the engine serves
(``tests/gpuworker/test_train_demo.py`` checks the two forwards agree).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.gpuworker.model.layers import Attention, DecoderLayer
from services.gpuworker.model.llama import TargetModel


def _attend(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    nq, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = attn.q_proj(x).view(B, T, nq, hd)
    k = attn.k_proj(x).view(B, T, nkv, hd)
    v = attn.v_proj(x).view(B, T, nkv, hd)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    pos = torch.arange(T, device=x.device)
    q, k = attn.rope(q, pos), attn.rope(k, pos)  # [B, T, h, d] against [T, 1, d] tables
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if nkv != nq:
        k = k.repeat_interleave(nq // nkv, dim=1)
        v = v.repeat_interleave(nq // nkv, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, nq * hd))


def _layer(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    x = x + _attend(layer.self_attn, layer.input_layernorm(x))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def dense_forward(
    target: TargetModel, ids: torch.Tensor, aux_layers: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``ids`` [B, T] -> (final-normed hidden [B, T, H], aux hidden [B, T, 3H] or None).

    Gradients flow when enabled (unlike ``TargetModel.forward``); positions start at 0."""
    x = target.embed_tokens(ids)
    captured = {}
    for i, layer in enumerate(target.layers):
        x = _layer(layer, x)
        if i in aux_layers:
            captured[i] = x
    aux = torch.cat([captured[i] for i in aux_layers], dim=-1) if aux_layers else None
    return target.norm(x), aux
