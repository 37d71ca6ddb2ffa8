"""Building blocks of the Llama-family decoder: RMSNorm, RoPE (default / linear / llama3),
GQA self-attention over a paged KV layer, SwiGLU MLP, and the pre-norm decoder layer.

Parameter names follow Hugging Face ``LlamaForCausalLM`` so checkpoints load by name.
Nothing here owns KV memory: attention writes and reads the KV layer it is handed through an
``AttentionBackend`` and an ``AttentionPlan`` (services/gpuworker/attention/base.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from services.gpuworker.attention.base import AttentionBackend, AttentionPlan
from services.gpuworker.model.config import LlamaConfig
from services.gpuworker.model.ops import TORCH_OPS, fused_weight


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, computed in float32 like the reference implementation
    (``ops``: see ``model/ops.py``)."""

    ops = TORCH_OPS

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (float32), with linear or llama3 scaling applied.

    llama3 (Llama 3.1): wavelengths longer than ``orig_ctx / low_freq_factor`` are divided by
    ``factor``, shorter than ``orig_ctx / high_freq_factor`` kept, and the band between
    interpolated smoothly."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling or {}
    kind = config.rope_type
    if kind == "linear":
        inv = inv / float(s["factor"])
    elif kind == "llama3":
        factor = float(s["factor"])
        low = float(s.get("low_freq_factor", 1.0))
        high = float(s.get("high_freq_factor", 4.0))
        orig = float(s.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > orig / low, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= orig / high) & (wavelen <= orig / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with cos/sin tables for positions ``0..max_seq_len-1`` (float32 buffers,
    cast to the activation dtype at use)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv = rope_inv_freq(self.config)
        t = torch.arange(self.config.max_seq_len, dtype=torch.float32)
        emb = torch.cat([torch.outer(t, inv)] * 2, dim=-1)
        return emb.cos(), emb.sin()

    def reset_tables(self) -> None:
        """Recompute the tables in place (after ``to_empty`` left them uninitialized)."""
        cos, sin = self._tables()
        with torch.no_grad():
            self.cos = cos.to(self.cos.device)
            self.sin = sin.to(self.sin.device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` [T, heads, head_dim] -> rotated copy; ``positions`` [T] int64."""
        cos = self.cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin[positions].to(x.dtype).unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    """GQA self-attention whose K/V live in a paged KV layer.

    ``input_size`` is normally ``hidden_size``; EAGLE-3's draft layer projects q/k/v from the
    concatenated ``2 * hidden_size`` input. After ``fuse_projections`` one GEMM computes q, k
    and v together."""

    ops = TORCH_OPS

    def __init__(self, config: LlamaConfig, rope: RotaryEmbedding, input_size: int | None = None):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        nq, nkv = config.num_heads, config.num_kv_heads
        in_size = input_size or h
        # Llama's attention_bias covers q/k/v/o; Qwen2's bias is on q/k/v only
        bias = config.attention_bias or config.qkv_bias
        self.q_proj = nn.Linear(in_size, nq * hd, bias=bias)
        self.k_proj = nn.Linear(in_size, nkv * hd, bias=bias)
        self.v_proj = nn.Linear(in_size, nkv * hd, bias=bias)
        self.o_proj = nn.Linear(nq * hd, h, bias=config.attention_bias)
        # Qwen3: RMSNorm over head_dim of every q and k head, before RoPE
        self.q_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = nq, nkv, hd
        self.scale = hd**-0.5
        # a plain attribute, not a submodule: one table shared by every layer
        self.__dict__["rope"] = rope
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fuse_projections(self) -> bool:
        """One weight for q/k/v (the three parameters become views of it). Mutates; idempotent."""
        if self._qkv is not None:
            return False
        self._qkv = fused_weight([self.q_proj, self.k_proj, self.v_proj])
        return True

    def forward(
        self,
        x: torch.Tensor,
        plan: AttentionPlan,
        backend: AttentionBackend,
        kv_layer: torch.Tensor,
    ) -> torch.Tensor:
        """``x`` [T, input_size] -> [T, hidden]. Mutates ``kv_layer`` at ``plan.slot_mapping``."""
        T = x.shape[0]
        nq, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if self._qkv is not None:
            q, k, v = F.linear(x, *self._qkv).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(T, nq, hd), k.view(T, nkv, hd), v.view(T, nkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rope_(self.rope, q, k, plan.positions)
        backend.write_kv(plan, kv_layer, k, v)
        out = backend.attend(plan, q, kv_layer, scale=self.scale)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; after ``fuse_projections`` gate and up are one
    GEMM feeding one fused SiLU-and-mul."""

    ops = TORCH_OPS

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self._gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fuse_projections(self) -> bool:
        """One weight for gate/up (both parameters become views of it). Mutates; idempotent."""
        if self._gate_up is not None:
            return False
        self._gate_up = fused_weight([self.gate_proj, self.up_proj])
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is not None:
            return self.down_proj(self.ops.silu_and_mul(F.linear(x, *self._gate_up)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``+ mlp(norm(.))``. Returns the residual stream."""

    def __init__(self, config: LlamaConfig, rope: RotaryEmbedding, intermediate_size: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rope)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(
            config.hidden_size, intermediate_size or config.intermediate_size, config.mlp_bias
        )

    def forward(self, x, plan: AttentionPlan, backend: AttentionBackend, kv_layer) -> torch.Tensor:
        """Mutates ``kv_layer`` (this forward's positions) only."""
        x = x + self.self_attn(self.input_layernorm(x), plan, backend, kv_layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def init_weights(module: nn.Module, generator: torch.Generator, std: float = 0.02) -> None:
    """Seeded random init (mutates ``module``): normal(0, std) for linear/embedding weights, zeros
    for biases, ones for norms. Same seed, same weights, on any machine."""
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # RMSNorm weights
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * std)
