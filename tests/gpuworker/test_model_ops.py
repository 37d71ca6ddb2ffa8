"""The kernel interface of the decoder (model/ops.py): fused q/k/v and gate/up projections give
the logits of the separate ones, share their memory, and leave state dicts alone; ops can be
swapped per model."""

from __future__ import annotations

import torch

from services.common.spec import SpecMode
from services.gpuworker.attention.base import BatchLayout, get_backend
from services.gpuworker.model.layers import Attention, RMSNorm
from services.gpuworker.model.loader import load_model
from services.gpuworker.model.ops import TORCH_OPS, TorchOps, fuse_projections, get_ops, use_ops


def _logits(target, draft, tokens):
    backend = get_backend("torch", "cpu", target.attention_geometry(4))
    pool, dpool = target.new_kv_pool(8, 4), draft.new_kv_pool(8, 4)
    plan = backend.plan(BatchLayout([list(range(8))], [0], [len(tokens)]))
    out = target(torch.tensor(tokens), plan, backend, pool, aux_layers=draft.aux_layers)
    d = draft(torch.tensor(tokens), out.aux_hidden, plan, backend, dpool, context_is_aux=True)
    return out.logits, d.logits


@torch.inference_mode()
def test_fused_projections_give_the_same_logits_and_share_memory():
    tokens = list(range(3, 20))
    target, draft, _ = load_model("tiny", spec_mode=SpecMode.EAGLE3)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    ref_t, ref_d = _logits(target, draft, tokens)
    fusions = fuse_projections(target) + fuse_projections(draft)
    assert fusions == 2 * (target.config.num_layers + 1)  # an attention and an MLP per layer
    assert fuse_projections(target) == 0  # idempotent
    attn: Attention = target.layers[0].self_attn
    fused_w = attn._qkv[0]
    assert attn.q_proj.weight.data_ptr() == fused_w.data_ptr()  # a view, not a copy
    assert attn.k_proj.weight.data_ptr() == fused_w[attn.q_proj.weight.shape[0]:].data_ptr()
    new_t, new_d = _logits(target, draft, tokens)
    torch.testing.assert_close(new_t, ref_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_d, ref_d, rtol=1e-5, atol=1e-5)
    after = target.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_ops_are_chosen_per_model():
    class Counting(TorchOps):
        calls = 0

        def rms_norm(self, x, weight, eps):
            Counting.calls += 1
            return super().rms_norm(x, weight, eps)

    target, draft, _ = load_model("tiny", spec_mode=SpecMode.EAGLE3)
    use_ops(target, Counting())
    assert all(m.ops is not TORCH_OPS for m in target.modules() if isinstance(m, RMSNorm))
    assert all(m.ops is TORCH_OPS for m in draft.modules() if isinstance(m, RMSNorm))
    with torch.inference_mode():
        _logits(target, draft, [1, 2, 3])
    assert Counting.calls == 2 * target.config.num_layers + 1  # two norms a layer + the final one
    assert get_ops("torch") is TORCH_OPS
