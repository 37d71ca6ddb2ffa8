"""The small per-layer kernels of the decoder, behind one interface: RMSNorm, RoPE and SwiGLU's
SiLU-and-mul, plus fusing q/k/v and gate/up into one GEMM each.

Two implementations:

* ``TorchOps`` — the reference (CPU and GPU; what every CPU test runs): plain torch, RMSNorm in
  float32, rotate-half RoPE from the model's cos/sin tables.
* ``FlashInferOps`` — FlashInfer's fused kernels (``flashinfer.norm.rmsnorm``,
  ``flashinfer.rope.apply_rope_with_cos_sin_cache_inplace``, ``flashinfer.activation.silu_and_mul``);
  ``flashinfer`` is imported when these ops are built, never on a CPU path.

Why: a layer written with torch ops launches ~45 small kernels (a norm alone is six: cast, pow,
mean, rsqrt, mul, mul); a step of a small model at batch 1 is bound by those launches and their
fixed cost, even inside a CUDA graph. With the fused kernels and fused projections a layer is
~14 kernels:

    norm │ qkv GEMM │ rope (q, k in place) │ write K/V │ attend │ o GEMM │ add │ norm │
    gate_up GEMM │ silu·mul │ down GEMM │ add

``use_ops(model, ops)`` points every layer of a model (target or draft) at one implementation;
``fuse_projections(model)`` concatenates q/k/v and gate/up weights into one tensor each and makes
the original parameters views of it (same memory, state dicts unchanged). Both mutate the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.common.errors import FailedPrecondition, InvalidArgument


class TorchOps:
    """Reference implementations (pure torch)."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    def rope_(self, rope, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` [T, qh, d] and ``k`` [T, kh, d] at ``positions``; returns the rotated pair
        (the torch version makes copies, the fused one works in place)."""
        return rope(q, positions), rope(k, positions)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FlashInferOps(TorchOps):
    """FlashInfer's fused kernels (CUDA, 16-bit activations); the float32 RMSNorm of the
    reference becomes one kernel that accumulates in float32 and rounds once."""

    name = "flashinfer"

    def __init__(self):
        try:
            import flashinfer  # noqa: PLC0415 - lazy on purpose: CPU-only paths never import it
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise FailedPrecondition("fused kernels need the flashinfer-python package (pip install 'tandem-serve[gpu]')") from exc
        self._fi = flashinfer
        self._cos_sin: dict[int, torch.Tensor] = {}  # id(rope) -> [max_seq_len, head_dim] float32

    # The kernels launch a grid per row: an empty batch (a fill or chain with no rows this step)
    # is an invalid launch, so empty and float32 inputs take the reference path.
    def rms_norm(self, x, weight, eps):
        if x.dtype == torch.float32 or x.dim() != 2 or x.shape[0] == 0:
            return super().rms_norm(x, weight, eps)
        return self._fi.norm.rmsnorm(x.contiguous(), weight, eps)

    def rope_(self, rope, q, k, positions):
        if q.dtype == torch.float32 or q.shape[0] == 0:
            return super().rope_(rope, q, k, positions)
        cache = self._cos_sin.get(id(rope))
        if cache is None:
            half = rope.cos.shape[-1] // 2  # the tables repeat each frequency twice (rotate-half)
            cache = torch.cat([rope.cos[:, :half], rope.sin[:, :half]], dim=-1).float().contiguous()
            self._cos_sin[id(rope)] = cache
        head_dim = q.shape[-1]
        self._fi.rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1), head_dim, cache, is_neox=True
        )
        return q, k

    def silu_and_mul(self, gate_up):
        if gate_up.dtype == torch.float32 or gate_up.shape[0] == 0:
            return super().silu_and_mul(gate_up)
        return self._fi.activation.silu_and_mul(gate_up.contiguous())


TORCH_OPS = TorchOps()


def get_ops(name: str) -> TorchOps:
    """``"torch"`` or ``"flashinfer"`` (imports flashinfer)."""
    if name == "torch":
        return TORCH_OPS
    if name == "flashinfer":
        return FlashInferOps()
    raise InvalidArgument(f"unknown ops {name!r} (expected 'torch' or 'flashinfer')")


def use_ops(model: nn.Module, ops: TorchOps) -> None:
    """Point every module of ``model`` that has ops (norms, attention, MLPs) at ``ops``."""
    for m in model.modules():
        if hasattr(type(m), "ops"):
            m.ops = ops


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v (and gate/up) of every attention (and MLP) of ``model`` into one weight each;
    the original weights become views of it. Returns how many fusions were made. Idempotent.
    Call it once the model is on its final device and dtype: ``model.to()`` would move the
    parameters but not the fused tensors."""
    count = 0
    for m in model.modules():
        fuse = getattr(m, "fuse_projections", None)
        if fuse is not None and fuse():
            count += 1
    return count


def fused_weight(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding ``linears``' rows in order; each linear's parameters become
    views of it (mutates them; same values, memory shared)."""
    weight = torch.cat([lin.weight.data for lin in linears])
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([lin.bias.data for lin in linears])
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = weight[row : row + n]
        if bias is not None:
            lin.bias.data = bias[row : row + n]
        row += n
    return weight, bias
