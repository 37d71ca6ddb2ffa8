"""FlashInfer's fused norm / RoPE / SiLU-and-mul kernels and fused projections (model/ops.py)
agree with the torch reference ops on the GPU, in bf16, for the target and the EAGLE-3 draft."""

from __future__ import annotations

import copy

import pytest
import torch

from services.gpuworker.attention.base import BatchLayout, get_backend
from services.gpuworker.model.ops import fuse_projections, get_ops, use_ops
from test_flashinfer_engine import BS, DEV, models  # noqa: F401 - fixture

pytestmark = pytest.mark.gpu


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.inference_mode()
def test_fused_ops_match_the_torch_reference(models):
    target, draft = models
    fused_t, fused_d = copy.deepcopy(target), copy.deepcopy(draft)
    fused_d.__dict__["rotary"] = fused_t.rotary  # the draft shares its target's RoPE tables
    ops = get_ops("flashinfer")
    for m in (fused_t, fused_d):
        use_ops(m, ops)
        assert fuse_projections(m) > 0
    g = torch.Generator().manual_seed(5)
    lengths = [7, 33, 70]
    tokens = torch.randint(0, 1000, (sum(lengths),), generator=g).to(DEV)
    results = []
    for t, d in ((target, draft), (fused_t, fused_d)):
        backend = get_backend("flashinfer", DEV, t.attention_geometry(BS, torch.bfloat16))
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(lengths))]
        plan = backend.plan(BatchLayout(tables, [0] * len(lengths), lengths))
        pool, dpool = t.new_kv_pool(32, BS), d.new_kv_pool(32, BS)
        out = t(tokens, plan, backend, pool, aux_layers=d.aux_layers)
        dout = d(tokens, out.aux_hidden, plan, backend, dpool, context_is_aux=True)
        results.append((out.logits, dout.logits, pool.layer(0)))
    (ref_t, ref_d, ref_kv), (new_t, new_d, new_kv) = results
    assert rel_err(new_t, ref_t) < 2e-2
    assert rel_err(new_d, ref_d) < 2e-2
    assert rel_err(new_kv, ref_kv) < 2e-2  # RoPE'd keys written to the same pages
    assert (new_t.argmax(-1) == ref_t.argmax(-1)).float().mean() > 0.97


def test_fused_ops_take_empty_and_strided_rows():
    """A step may norm zero rows (a fill with nothing new) or a strided slice: the kernels would
    fail the launch, so the ops must still answer like the reference."""
    ops, ref = get_ops("flashinfer"), get_ops("torch")
    w = torch.randn(64, device=DEV, dtype=torch.bfloat16)
    empty = torch.empty(0, 64, device=DEV, dtype=torch.bfloat16)
    assert ops.rms_norm(empty, w, 1e-5).shape == (0, 64)
    assert ops.silu_and_mul(torch.empty(0, 128, device=DEV, dtype=torch.bfloat16)).shape == (0, 64)
    wide = torch.randn(5, 128, device=DEV, dtype=torch.bfloat16)
    strided = wide[:, :64]
    assert rel_err(ops.rms_norm(strided, w, 1e-5), ref.rms_norm(strided, w, 1e-5)) < 1e-2
